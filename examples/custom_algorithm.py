"""Your own loss and advantage, by import path (no fork of echorl):

    echorl run -o loss.type=examples/custom_algorithm.py:reinforce \
               -o advantage.type=examples/custom_algorithm.py:rank

A loss is `fn(inputs, cfg) -> (loss, metrics)` over (N, T) token tensors (`LossInputs`:
logp with gradient, old_logp, behaviour_logp, advantages (N,), mask); an advantage is
`fn(rewards, cfg) -> advantages`, both shaped (groups, G). Only the trainer imports them.
"""

import torch

from echorl.trainer.losses import LossInputs


def reinforce(inp: LossInputs, cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE with the sampler-to-trainer importance weight, truncated at cfg.is_cap:
    l_t = -min(exp(logp_t - behaviour_t), C) * A, with the weight's gradient flowing
    through logp_t (its value detached from the cap)."""
    keep = inp.mask.bool()
    log_w = torch.where(keep, inp.logp - inp.behaviour_logp, 0.0)
    w = torch.exp(log_w)
    capped = w.clamp(max=cfg.is_cap)
    per_token = -(capped.detach() / w.detach()) * w * inp.advantages.unsqueeze(1)
    loss = inp.mean(per_token, cfg.aggregation)
    return loss, {"loss/policy": loss.item()}


def rank(rewards: torch.Tensor, cfg) -> torch.Tensor:
    """Rank-based advantages: each completion's rank in its group scaled to [-1, 1] (ties
    share a rank), so one outlier reward cannot dominate; a flat group gets 0."""
    below = (rewards.unsqueeze(2) > rewards.unsqueeze(1)).sum(2).float()
    above = (rewards.unsqueeze(2) < rewards.unsqueeze(1)).sum(2).float()
    g = rewards.shape[1]
    return (below - above) / (g - 1)
