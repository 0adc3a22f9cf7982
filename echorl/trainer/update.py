"""One policy update: from scored groups to optimiser steps.

    groups -> advantages -> Batch -> old log-probs -> (epochs x minibatches) loss/backward/step

`update_policy` is the whole trainer-side step, shared by the co-located loop
and the decoupled trainer; it knows nothing of where the groups came from.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from echorl.config import OptimConfig, RunConfig
from echorl.protocol import ScoredGroup
from echorl.seeding import derive_seed
from echorl.trainer.advantages import compute_advantages
from echorl.trainer.batch import Batch, batch_from_groups, token_logprobs
from echorl.trainer.distributed import SOLO, World, full_grad_norm
from echorl.trainer.losses import LossInputs, loss_fn


def build_optimizer(model: PreTrainedModel, cfg: OptimConfig) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
    # fused: one kernel for every tensor's update (CPU and CUDA), not one loop per tensor
    fused = all(p.device.type in ("cpu", "cuda") for p in trainable)
    return torch.optim.AdamW(
        trainable,
        fused=fused,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        weight_decay=cfg.weight_decay,
    )


def build_scheduler(
    opt: torch.optim.Optimizer, cfg: OptimConfig
) -> torch.optim.lr_scheduler.LRScheduler:
    warm = cfg.warmup_steps
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) if warm else 1.0
    )


def groups_to_batch(
    groups: list[ScoredGroup], pad_id: int, cfg: RunConfig, device: torch.device | str = "cpu"
) -> Batch:
    """The groups' rows, padded, with their advantages, on `device` (the policy's)."""
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float32)  # (n_groups, G)
    return batch_from_groups(groups, compute_advantages(rewards, cfg.advantage), pad_id).to(device)


def world_logprobs(
    model: PreTrainedModel, batch: Batch, temperature: float, world: World = SOLO
) -> torch.Tensor:
    """`token_logprobs` of the whole batch (no gradient), each rank computing its share of
    the rows; every rank gets all of them."""
    if world.size == 1:
        return token_logprobs(model, batch, temperature)[0]
    mine, stand_in = world.rows(torch.arange(len(batch)))
    part = token_logprobs(model, batch.rows(mine), temperature, share_prompts=not world.sharded)[0]
    out = torch.zeros_like(batch.behaviour_logp)
    if not stand_in:
        out[mine] = part
    return world.sum(out)


def train_on_batch(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    scheduler,
    batch: Batch,
    cfg: RunConfig,
    ref_model: PreTrainedModel | None = None,
    seed: int = 0,
    audit: Callable[[torch.Tensor], None] | None = None,
    world: World = SOLO,
    wrapped: torch.nn.Module | None = None,
) -> dict[str, float]:
    """PPO epochs over `batch`; returns metrics averaged over the optimiser steps.
    `audit` is given this policy's log-probs of the batch before any update (the proximal
    pass when there is one, else a forward pass of its own).

    With one epoch of one minibatch the proximal policy is the policy of the update's own
    forward pass, before its step: its detached log-probs are the old ones, and no
    separate pass is made (as TRL does with one iteration).

    In a torchrun `world` every rank holds the whole batch, trains through `wrapped` (DDP or
    FSDP2 around `model`) on its share of each minibatch's rows, and returns the same
    metrics (trainer/distributed.py)."""
    wrapped = wrapped or model
    temperature = cfg.sampling.temperature or 1.0
    one_pass = cfg.train.ppo_epochs == 1 and cfg.train.minibatches == 1
    with torch.no_grad():
        # Without a proximal policy the behaviour log-probs are the old policy: ratio to the
        # sampler, IS weight exp(0) = 1, and one forward pass saved.
        old_logp = batch.behaviour_logp
        if cfg.loss.proximal and not one_pass:
            old_logp = world_logprobs(model, batch, temperature, world)
        if audit is not None and not (cfg.loss.proximal and one_pass):
            audit(
                old_logp if cfg.loss.proximal else world_logprobs(model, batch, temperature, world)
            )
        ref_logp = (
            world_logprobs(ref_model, batch, temperature, world) if ref_model is not None else None
        )
    if cfg.loss.proximal and one_pass:  # filled from the update's own pass
        old_logp = torch.zeros_like(batch.behaviour_logp)
    policy_loss = loss_fn(cfg.loss.type)
    gen = torch.Generator().manual_seed(seed)
    sums: dict[str, float] = defaultdict(float)
    steps = skipped = 0
    wrapped.train()
    for _ in range(cfg.train.ppo_epochs):
        order = torch.randperm(len(batch), generator=gen)
        for idx in order.chunk(cfg.train.minibatches):
            mine, stand_in = world.rows(idx)
            mb = batch.rows(mine)
            if stand_in:  # passes like everyone's, no loss
                mb = replace(mb, loss_mask=torch.zeros_like(mb.loss_mask))
            whole = batch.loss_mask[idx]
            logp, entropy = token_logprobs(
                wrapped, mb, temperature, with_entropy=True, share_prompts=not world.sharded
            )
            if cfg.loss.proximal and one_pass and not stand_in:  # this pass is the proximal one
                old_logp[mine] = logp.detach()
            inputs = LossInputs(
                logp,
                old_logp[mine],
                mb.behaviour_logp,
                mb.advantages,
                mb.loss_mask,
                None if ref_logp is None else ref_logp[mine],
                tokens=float(whole.sum()) if world.size > 1 else None,
                rows=float((whole.sum(1) > 0).sum()) if world.size > 1 else None,
            )
            loss, metrics = policy_loss(inputs, cfg.loss)
            metrics["policy/entropy"] = inputs.mean(entropy).item()
            optimizer.zero_grad(set_to_none=True)
            (loss * world.size).backward()  # DDP and FSDP2 average the ranks' gradients
            grad_norm = full_grad_norm(
                torch.nn.utils.clip_grad_norm_(
                    wrapped.parameters(), cfg.optim.grad_clip, foreach=True
                )
            )
            if world.size > 1:  # each rank's share of every mean, added up
                keys = sorted(metrics)
                total = world.sum(torch.tensor([metrics[k] for k in keys], dtype=torch.float64))
                metrics = dict(zip(keys, total.tolist()))
            if not (math.isfinite(metrics["loss/policy"]) and torch.isfinite(grad_norm)):
                # A non-finite loss or gradient never reaches the weights: this minibatch is
                # skipped and counted (its groups' samplers are named by the caller).
                optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            optimizer.step()
            scheduler.step()
            metrics["optim/grad_norm"] = grad_norm.item()
            for k, v in metrics.items():
                sums[k] += v
            steps += 1
    wrapped.eval()
    if cfg.loss.proximal and one_pass:
        world.sum(old_logp)
        if audit is not None:  # after backward: the audit may swap older weights in, which
            audit(old_logp)  # the autograd graph must not see
    out = {k: v / steps for k, v in sums.items()} if steps else {}
    out["optim/nonfinite_skipped"] = float(skipped)
    out["optim/lr"] = scheduler.get_last_lr()[0]
    mask = batch.loss_mask.bool()
    if cfg.loss.proximal:
        # KL(behaviour || trainer) before the update: how far the sampler's policy was from ours.
        out["rollout/kl_behaviour_old"] = (batch.behaviour_logp - old_logp)[mask].mean().item()
    return out


def left_out(group: ScoredGroup, cfg: RunConfig) -> bool:
    """A flat group (every reward equal: no advantage) under `train.drop_flat_groups`."""
    return cfg.train.drop_flat_groups and len(set(group.rewards)) == 1


def update_policy(
    model: PreTrainedModel,
    pad_id: int,
    optimizer: torch.optim.Optimizer,
    scheduler,
    groups: list[ScoredGroup],
    cfg: RunConfig,
    step: int,
    ref_model: PreTrainedModel | None = None,
    audit: Callable[[list[ScoredGroup], Batch, torch.Tensor], None] | None = None,
    world: World = SOLO,
    wrapped: torch.nn.Module | None = None,
) -> dict[str, float]:
    """The trainer's step on scored groups, shared by the co-located and the decoupled loop
    (and, with `world` and `wrapped`, by every rank of a torchrun trainer).

    Flat groups (all rewards equal) are left out when `train.drop_flat_groups`; a step with
    nothing left makes no optimiser step and reports `optim/skipped = 1`. `audit(groups,
    batch, logp)` sees the groups trained on with this policy's log-probs of them before
    the update (the decoupled trainer checks the samplers' with it); for the flat groups,
    which no pass covers, `logp` is None."""
    informative = [g for g in groups if not left_out(g, cfg)]
    flat = [g for g in groups if left_out(g, cfg)]
    device = next(model.parameters()).device
    audit_s = 0.0  # the audit's own time: its passes over flat groups and stale versions

    def timed_audit(groups, batch, logp):
        nonlocal audit_s
        t0 = time.perf_counter()
        audit(groups, batch, logp)
        audit_s += time.perf_counter() - t0

    if audit is not None and flat:  # not trained on, but audited all the same
        with torch.no_grad():
            timed_audit(flat, groups_to_batch(flat, pad_id, cfg, device), None)
    if not informative:
        metrics = {"optim/skipped": 1.0}
    else:
        batch = groups_to_batch(informative, pad_id, cfg, device)
        metrics = train_on_batch(
            model,
            optimizer,
            scheduler,
            batch,
            cfg,
            ref_model,
            seed=derive_seed(cfg.train.seed, "shuffle", step),
            audit=None if audit is None else lambda logp: timed_audit(informative, batch, logp),
            world=world,
            wrapped=wrapped,
        ) | {"optim/skipped": 0.0}
    if audit is not None:
        metrics["trainer/audit_s"] = audit_s
    return metrics
