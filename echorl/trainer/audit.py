"""The trainer's audit of what samplers report: its own log-probs of every consumed token
against the sampler's behaviour log-probs.

Samplers are machines nobody here controls. Their completions are re-scored by the
broker, but the log-probs they report feed the importance weights, and a sampler can
lie about them, sample from other weights, or make completions up. The trainer already
holds the policy the tokens should have come from (the proximal policy: its weights
before this step's update), so one forward pass under no_grad gives, per group, the
sum of |trainer - sampler| over the model's tokens, the sum of (sampler - trainer) (an
estimate of KL(sampler || trainer), since the tokens were drawn by the sampler), and
how many tokens are off by more than a tolerance. The broker keeps these per sampler
and quarantines one far beyond what honest samplers show.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from echorl.protocol import GroupAudit, ScoredGroup
from echorl.trainer.batch import batch_from_groups, token_logprobs


@torch.no_grad()
def audit_groups(
    model: PreTrainedModel,
    groups: list[ScoredGroup],
    pad_id: int,
    temperature: float = 1.0,
    tolerance: float = 2.0,
    chunk: int = 8,
) -> list[GroupAudit]:
    """One GroupAudit per group, `chunk` groups per forward pass (bounded memory)."""
    audits = []
    for i in range(0, len(groups), chunk):
        part = groups[i : i + chunk]
        g = len(part[0].completions)
        batch = batch_from_groups(part, torch.zeros(len(part), g), pad_id)
        logp, _ = token_logprobs(model, batch, temperature or 1.0)
        mask = batch.loss_mask.bool()
        delta = torch.where(mask, batch.behaviour_logp - logp, 0.0)  # sampler - trainer
        rows = torch.tensor([len(grp.completions) for grp in part]).cumsum(0).tolist()
        start = 0
        for grp, end in zip(part, rows):
            d, m = delta[start:end], mask[start:end]
            audits.append(
                GroupAudit(
                    job_id=grp.job_id,
                    tokens=int(m.sum()),
                    abs_delta=float(d.abs().sum()),
                    kl=float(d.sum()),
                    beyond=int(((d.abs() > tolerance) & m).sum()),
                )
            )
            start = end
    return audits
