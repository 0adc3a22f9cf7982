"""The trainer's audit of what samplers report: its own log-probs of every consumed token
against the sampler's behaviour log-probs.

Samplers are machines nobody here controls. Their completions are re-scored by the
broker, but the log-probs they report feed the importance weights, and a sampler can
lie about them, sample from other weights, or make completions up. The trainer already
holds the policy the tokens should have come from (the proximal policy: its weights
before this step's update), so the proximal forward pass the update makes anyway gives, per group, the
sum of |trainer - sampler| over the model's tokens, the sum of (sampler - trainer) (an
estimate of KL(sampler || trainer), since the tokens were drawn by the sampler), and
how many tokens are off by more than a tolerance. The broker keeps these per sampler
and quarantines one far beyond what honest samplers show.
"""

from __future__ import annotations

import itertools

import torch

from echorl.protocol import MIN_LOGPROB, GroupAudit, ScoredGroup
from echorl.trainer.batch import Batch, token_logprobs
from echorl.trainer.distributed import resharded


def group_rows(groups: list[ScoredGroup], picked: list[bool]) -> torch.Tensor:
    """The batch rows (each group's completions, in order) of the picked groups."""
    first = [0, *itertools.accumulate(len(g.completions) for g in groups)]
    rows = [r for i, p in enumerate(picked) if p for r in range(first[i], first[i + 1])]
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def audit_batch(
    groups: list[ScoredGroup],
    batch: Batch,
    logp: torch.Tensor,
    tolerance: float = 2.0,
    detailed: int = 1,
) -> list[GroupAudit]:
    """One GroupAudit per group of `batch` (its rows are the groups' completions in order),
    from this policy's log-probs `logp` of it; the first `detailed` carry the log-prob of
    each token too (the dashboard's drill-down)."""
    mask = batch.loss_mask.bool()
    delta = torch.where(mask, batch.behaviour_logp - logp, 0.0)  # sampler - trainer
    audits, start = [], 0
    for k, group in enumerate(groups):
        end = start + len(group.completions)
        d, m = delta[start:end], mask[start:end]
        audits.append(
            GroupAudit(
                job_id=group.job_id,
                tokens=int(m.sum()),
                abs_delta=float(d.abs().sum()),
                kl=float(d.sum()),
                beyond=int(((d.abs() > tolerance) & m).sum()),
                logprobs=completion_logprobs(group, batch, logp, start) if k < detailed else None,
            )
        )
        start = end
    return audits


def completion_logprobs(
    group: ScoredGroup, batch: Batch, logp: torch.Tensor, first: int
) -> list[list[float]]:
    """`logp` of each of the group's completion tokens (its rows start at `first`; token k of
    a row is predicted in column prompt + k - 1), 0 at the environment's tokens."""
    rows = []
    for j, c in enumerate(group.completions):
        r = first + j
        at = int(batch.prompt_lens[r]) - 1
        cols = slice(at, at + len(c.token_ids))
        lp = torch.where(batch.loss_mask[r, cols].bool(), logp[r, cols], 0.0)
        rows.append([round(x, 4) for x in lp.clamp(MIN_LOGPROB, 0.0).float().tolist()])
    return rows


class PastVersions:
    """The trainable weights of the last few versions (a LoRA run's adapters: a few per cent
    of the model; a full fine-tune's: a copy of it each), so that a stale group is audited
    against the version that generated it, exactly, for a forward pass of its rows. Without
    them the policy's drift since that version would count as the sampler's mismatch."""

    def __init__(self, keep: int):
        self.keep = keep
        self.held: dict[int, dict[str, torch.Tensor]] = {}
        self.scratch: dict[str, torch.Tensor] = {}  # the current weights while older are in

    @torch.no_grad()
    def record(self, model, version: int) -> None:
        """The trainable tensors of `model` as they are at `version` (copied into the
        buffers of the version that falls out of the window: no allocation per step)."""
        gone = sorted(v for v in self.held if v < version - self.keep)
        spare = self.held.pop(gone[0]) if gone else None
        for v in gone[1:]:
            del self.held[v]
        params = {n: p for n, p in resharded(model).named_parameters() if p.requires_grad}
        if spare is None:
            self.held[version] = {n: p.detach().clone() for n, p in params.items()}
        else:
            for n, p in params.items():
                spare[n].copy_(p)
            self.held[version] = spare

    def recomputes(self, group: ScoredGroup) -> bool:
        """Whether `logprobs` scores this group's rows under its own, older version."""
        return group.version != max(self.held, default=None) and group.version in self.held

    @torch.no_grad()
    def logprobs(
        self, model, groups: list[ScoredGroup], batch: Batch, logp: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        """`logp` (the current policy's) with each stale group's rows recomputed under its
        own version, where that version is held."""
        latest = max(self.held, default=None)
        versions = sorted({g.version for g in groups if self.recomputes(g)})
        if not versions:
            return logp
        params = dict(resharded(model).named_parameters())  # FSDP2: each rank's shards
        if not self.scratch:
            self.scratch = {n: torch.empty_like(params[n]) for n in self.held[latest]}
        now = self.scratch
        for n, t in now.items():
            t.copy_(params[n])
        out = logp.clone()
        try:
            for version in versions:
                resharded(model)  # FSDP2: the next forward gathers the shards copied in here
                for n, t in self.held[version].items():
                    params[n].copy_(t)
                idx = group_rows(groups, [g.version == version for g in groups])
                out[idx] = token_logprobs(model, batch.rows(idx), temperature)[0]
        finally:
            resharded(model)
            for n, t in now.items():
                params[n].copy_(t)
        return out
