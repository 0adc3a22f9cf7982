"""Group-relative advantages: one scalar per completion from the rewards of its group.

All functions take rewards shaped (n_groups, G) and return the same shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from echorl.config import AdvantageConfig
from echorl.userpath import load_callable


def grpo_advantages(rewards: torch.Tensor, cfg: AdvantageConfig) -> torch.Tensor:
    """GRPO (Shao et al. 2024, arXiv 2402.03300): A_i = (r_i - mean(r)) / (std(r) + eps).

    std is the sample standard deviation (n - 1 in the denominator); a group
    whose rewards are all equal gets zero advantage.
    """
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return (rewards - mean) / (std + cfg.eps)


def drgrpo_advantages(rewards: torch.Tensor, cfg: AdvantageConfig) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): A_i = r_i - mean(r), no std scaling."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def rloo_advantages(rewards: torch.Tensor, cfg: AdvantageConfig) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740): A_i = r_i - mean_{j != i} r_j
    = G / (G - 1) * (r_i - mean(r))."""
    g = rewards.shape[1]
    assert g >= 2, f"RLOO needs at least 2 completions per group, got {g}"
    return (rewards - rewards.mean(dim=1, keepdim=True)) * (g / (g - 1))


AdvantageFn = Callable[[torch.Tensor, AdvantageConfig], torch.Tensor]
ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
}


def advantage_fn(name: str) -> AdvantageFn:
    """A built-in advantage, or your own by import path: ValueError says why not."""
    return ADVANTAGES.get(name) or load_callable(name, "advantage.type")


def compute_advantages(rewards: torch.Tensor, cfg: AdvantageConfig) -> torch.Tensor:
    assert rewards.dim() == 2, f"rewards must be (n_groups, G), got shape {tuple(rewards.shape)}"
    out = advantage_fn(cfg.type)(rewards, cfg)
    if not isinstance(out, torch.Tensor) or out.shape != rewards.shape:
        raise ValueError(
            f"advantage {cfg.type} returned {getattr(out, 'shape', type(out).__name__)}, "
            f"not a tensor shaped like the rewards {tuple(rewards.shape)}"
        )
    return out
