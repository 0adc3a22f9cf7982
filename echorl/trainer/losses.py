"""Policy losses. Each is `fn(inputs, cfg) -> (loss, metrics)` over token tensors (N, T).

Three log-prob tensors meet here:

- `logp`: the current policy, with gradient;
- `old_logp`: the proximal policy the PPO ratio is taken against (the trainer's
  weights before this batch's updates);
- `behaviour_logp`: what the sampler reported for the tokens it generated.

On one co-located machine `old_logp` and `behaviour_logp` agree up to numerics;
on a decoupled swarm they differ (other weights, other kernels, bf16), and the
truncated importance weight corrects for it (Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"; the decoupled PPO
objective of Hilton et al. 2021, arXiv 2110.00641, also used by AReaL).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from echorl.config import LossConfig
from echorl.userpath import load_callable


@dataclass
class LossInputs:
    logp: torch.Tensor  # (N, T) current policy, requires grad
    old_logp: torch.Tensor  # (N, T) proximal policy
    behaviour_logp: torch.Tensor  # (N, T) sampler's log-probs
    advantages: torch.Tensor  # (N,) one per sequence
    mask: torch.Tensor  # (N, T) 1 on completion tokens; prompt and padding are 0
    ref_logp: torch.Tensor | None = None  # (N, T) frozen reference, for the KL term
    # When these rows are one rank's share of a minibatch: the whole minibatch's completion
    # tokens and rows with a token, the denominators of its means (None: these rows alone).
    tokens: float | None = None
    rows: float | None = None

    def mean(self, x: torch.Tensor, aggregation: str = "token_mean") -> torch.Tensor:
        return masked_mean(x, self.mask.to(x.dtype), aggregation, self.tokens, self.rows)


def masked_mean(
    x: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str = "token_mean",
    tokens: float | None = None,
    rows: float | None = None,
) -> torch.Tensor:
    """token_mean: sum(x*m) / sum(m) over everything; seq_mean: per-row mean, then mean of rows
    (rows with no tokens are skipped). `tokens` / `rows` replace the denominators when these
    rows are a share of a larger batch, so that the shares' means add up to the whole's."""
    if aggregation == "token_mean":
        return (x * mask).sum() / (mask.sum().clamp(min=1) if tokens is None else max(tokens, 1))
    per_row_tokens = mask.sum(dim=1)
    has = per_row_tokens > 0
    total = (x * mask).sum(dim=1)[has] / per_row_tokens[has]
    return total.sum() / (has.sum().clamp(min=1) if rows is None else max(rows, 1))


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate k3 = exp(ref - logp) - (ref - logp) - 1 >= 0
    (Schulman, "Approximating KL divergence", 2020)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def with_kl_ref(
    inp: LossInputs, cfg: LossConfig, per_token: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """`per_token` plus kl_coef x k3 KL to the frozen reference (when on), and its metric."""
    if cfg.kl_coef <= 0.0 or inp.ref_logp is None:
        return per_token, {}
    kl = k3_kl(inp.logp, torch.where(inp.mask.bool(), inp.ref_logp, inp.logp.detach()))
    return per_token + cfg.kl_coef * kl, {"loss/kl_ref": inp.mean(kl.detach()).item()}


def ppo_clip_loss(inp: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip with clip-higher and a truncated importance weight.

        r_t   = exp(logp_t - old_t)
        w_t   = min(exp(old_t - behaviour_t), C)                  (no gradient)
        l_t   = -w_t * min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)
              + beta * k3(logp_t, ref_t)                          (when kl_coef > 0)
        loss  = aggregate(l_t over completion tokens)

    Asymmetric bounds are DAPO's clip-higher (Yu et al. 2025, arXiv 2503.14476).
    When sampler and trainer agree, w_t = 1 and this is plain PPO/GRPO.
    """
    keep = inp.mask.bool()
    # Zero outside the mask first, so padding garbage can never turn into inf * 0 = nan.
    log_ratio = torch.where(keep, inp.logp - inp.old_logp, 0.0)
    log_is = torch.where(keep, inp.old_logp - inp.behaviour_logp, 0.0).detach()
    ratio = torch.exp(log_ratio)
    is_weight = torch.exp(log_is).clamp(max=cfg.is_cap)
    adv = inp.advantages.to(inp.logp.dtype).unsqueeze(1)  # (N, 1)
    surr = ratio * adv
    surr_clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
    per_token = -is_weight * torch.minimum(surr, surr_clipped)
    per_token, metrics = with_kl_ref(inp, cfg, per_token)
    loss = inp.mean(per_token, cfg.aggregation)
    with torch.no_grad():
        metrics |= {
            "loss/policy": loss.item(),
            "loss/clip_frac": inp.mean((surr_clipped < surr).float()).item(),
            "loss/approx_kl_old": inp.mean(k3_kl(inp.logp, inp.old_logp)).item(),
            "loss/is_weight_mean": inp.mean(is_weight).item(),
            "loss/is_clip_frac": inp.mean((torch.exp(log_is) > cfg.is_cap).float()).item(),
        }
    return loss, metrics


def gspo_loss(inp: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): the ratio and its clipping are a sequence's,
    the geometric mean of its tokens' ratios, so one odd token cannot clip a whole answer's
    signal (nor pass through unclipped): the token-level form, whose value is the sequence's
    and whose gradient reaches every token,

        s_i   = exp(mean_t(logp_t - old_t))                       (a sequence's ratio)
        s_i,t = sg(s_i) * exp(logp_t - sg(logp_t))                (= s_i; gradient per token)
        w_i   = min(exp(mean_t(old_t - behaviour_t)), C)          (no gradient)
        l_i,t = -w_i * min(s_i,t * A_i, clip(s_i,t, 1 - seq_clip_low, 1 + seq_clip_high) * A_i)
        loss  = mean over sequences of the mean over their tokens

    Sequence ratios sit near 1, so the bounds are small (the paper's 3e-4 and 4e-4)."""
    keep = inp.mask.bool()
    m = inp.mask.to(inp.logp.dtype)
    n = m.sum(dim=1).clamp(min=1)
    log_ratio = torch.where(keep, inp.logp - inp.old_logp, 0.0)
    seq_log_ratio = (log_ratio * m).sum(dim=1) / n  # (N,)
    log_is = torch.where(keep, inp.old_logp - inp.behaviour_logp, 0.0).detach()
    seq_is = torch.exp((log_is * m).sum(dim=1) / n).clamp(max=cfg.is_cap)  # (N,)
    token_log = torch.where(keep, inp.logp - inp.logp.detach(), 0.0)
    ratio = torch.exp(seq_log_ratio.detach().unsqueeze(1) + token_log)  # (N, T)
    adv = inp.advantages.to(inp.logp.dtype).unsqueeze(1)
    surr = ratio * adv
    surr_clipped = ratio.clamp(1.0 - cfg.seq_clip_low, 1.0 + cfg.seq_clip_high) * adv
    per_token = -seq_is.unsqueeze(1) * torch.minimum(surr, surr_clipped)
    per_token, metrics = with_kl_ref(inp, cfg, per_token)
    loss = inp.mean(per_token, "seq_mean")
    with torch.no_grad():
        rows = (m.sum(dim=1) > 0).to(m.dtype).unsqueeze(1)  # a sequence counts once
        clipped = (surr_clipped < surr).to(m.dtype)[:, :1] * rows
        metrics |= {
            "loss/policy": loss.item(),
            "loss/clip_frac": (clipped.sum() / rows.sum().clamp(min=1)).item(),
            "loss/approx_kl_old": inp.mean(k3_kl(inp.logp, inp.old_logp)).item(),
            "loss/is_weight_mean": (
                (seq_is.unsqueeze(1) * rows).sum() / rows.sum().clamp(min=1)
            ).item(),
            "loss/seq_ratio_mean": (
                (torch.exp(seq_log_ratio).unsqueeze(1) * rows).sum() / rows.sum().clamp(min=1)
            ).item(),
        }
    return loss, metrics


def cispo_loss(inp: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): never drop a token's gradient; clip the
    importance weight instead, with no gradient through it, and weigh the log-prob:

        r_t   = exp(logp_t - old_t)
        w_t   = min(exp(old_t - behaviour_t), C)                  (no gradient)
        l_t   = -w_t * sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A * logp_t
        loss  = aggregate(l_t over completion tokens)

    PPO's clip zeroes the gradient of a token whose ratio left the band (often the rare,
    decisive ones); here every token keeps its gradient, its weight bounded."""
    keep = inp.mask.bool()
    log_ratio = torch.where(keep, inp.logp - inp.old_logp, 0.0).detach()
    log_is = torch.where(keep, inp.old_logp - inp.behaviour_logp, 0.0).detach()
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    is_weight = torch.exp(log_is).clamp(max=cfg.is_cap)
    adv = inp.advantages.to(inp.logp.dtype).unsqueeze(1)
    logp = torch.where(keep, inp.logp, 0.0)
    per_token = -is_weight * weight * adv * logp
    per_token, metrics = with_kl_ref(inp, cfg, per_token)
    loss = inp.mean(per_token, cfg.aggregation)
    with torch.no_grad():
        metrics |= {
            "loss/policy": loss.item(),
            "loss/clip_frac": inp.mean((weight != ratio).float()).item(),
            "loss/approx_kl_old": inp.mean(k3_kl(inp.logp, inp.old_logp)).item(),
            "loss/is_weight_mean": inp.mean(is_weight).item(),
            "loss/is_clip_frac": inp.mean((torch.exp(log_is) > cfg.is_cap).float()).item(),
        }
    return loss, metrics


LossFn = Callable[[LossInputs, LossConfig], tuple[torch.Tensor, dict[str, float]]]
LOSSES: dict[str, LossFn] = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss}


def loss_fn(name: str) -> LossFn:
    """A built-in loss, or your own by import path (`file.py:name`): ValueError says why not."""
    return LOSSES.get(name) or load_callable(name, "loss.type")
