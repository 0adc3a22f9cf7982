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

import torch

from echorl.protocol import GroupAudit, ScoredGroup
from echorl.trainer.batch import Batch


@torch.no_grad()
def audit_batch(
    groups: list[ScoredGroup], batch: Batch, logp: torch.Tensor, tolerance: float = 2.0
) -> list[GroupAudit]:
    """One GroupAudit per group of `batch` (its rows are the groups' completions in order),
    from this policy's log-probs `logp` of it."""
    mask = batch.loss_mask.bool()
    delta = torch.where(mask, batch.behaviour_logp - logp, 0.0)  # sampler - trainer
    audits, start = [], 0
    for group in groups:
        end = start + len(group.completions)
        d, m = delta[start:end], mask[start:end]
        audits.append(
            GroupAudit(
                job_id=group.job_id,
                tokens=int(m.sum()),
                abs_delta=float(d.abs().sum()),
                kl=float(d.sum()),
                beyond=int(((d.abs() > tolerance) & m).sum()),
            )
        )
        start = end
    return audits
