"""The co-located reference loop: generate, score, update, in turn, in one process.

This is what a hybrid engine (verl) does, and what every decoupled run is
measured against: for step s it samples B prompts x G completions with the
weights of version s, scores them, and makes version s + 1.

    echorl train --colocated --task add --model runs/demo/sft
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from transformers import PreTrainedModel

from echorl.config import RunConfig
from echorl.metrics import MetricsLog, plot_reward_curve, read_metrics, tracking
from echorl.models import load_policy
from echorl.models.lora import load_for_training, save_policy
from echorl.progress import steps
from echorl.protocol import ScoredGroup
from echorl.rollout.evaluate import EvalResult, evaluate
from echorl.rollout.generate import rollout
from echorl.rollout.hf import HFBackend
from echorl.rollout.verify import VerifierPool, run_pool
from echorl.seeding import derive_seed
from echorl.tasks import Task, get_task, take
from echorl.tasks.base import success
from echorl.trainer.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from echorl.trainer.flat import FlatStreak, Run
from echorl.trainer.update import build_optimizer, build_scheduler, update_policy


@dataclass
class RunResult:
    before: EvalResult | None  # held-out greedy accuracy at the start (None when resumed)
    after: EvalResult
    metrics_path: Path
    plot_path: Path
    policy_path: Path


def step_problems(task: Task, cfg: RunConfig, step: int):
    return take(task, cfg.train.batch_prompts, derive_seed(cfg.task.seed, "step", step))


def reward_metrics(groups: list[ScoredGroup]) -> dict[str, float]:
    rewards = torch.tensor([g.rewards for g in groups])  # (B, G)
    tokens = [len(c.token_ids) for g in groups for c in g.completions]
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item(),
        "reward/max": rewards.max().item(),
        "reward/accuracy": success(rewards).float().mean().item(),
        "rollout/groups_flat_frac": (rewards.std(dim=1) == 0).float().mean().item(),
        "rollout/completion_tokens_mean": sum(tokens) / len(tokens),
        **reward_parts(groups),
    }


def reward_parts(groups: list[ScoredGroup]) -> dict[str, float]:
    """A dataset task's reward functions, each one's mean over the batch (`rewards/<name>`)."""
    sums: dict[str, list[float]] = {}
    for g in groups:
        for name, (total, n) in (g.reward_parts or {}).items():
            kept = sums.setdefault(name, [0.0, 0])
            kept[0], kept[1] = kept[0] + total, kept[1] + n
    return {f"rewards/{name}": s / n for name, (s, n) in sums.items() if n}


def reference(model_dir: str | Path, cfg: RunConfig) -> PreTrainedModel | None:
    """The frozen policy the KL term pulls towards: the run's version 0 (also after a resume).
    None when the KL term is off."""
    if cfg.loss.kl_coef == 0:
        return None
    return load_policy(model_dir, cfg.model.device)[0].eval().requires_grad_(False)


def held_out(
    backend: HFBackend, task: Task, cfg: RunConfig, scorer: VerifierPool | None = None
) -> EvalResult:
    t = cfg.train
    return evaluate(
        backend, task, t.eval_prompts, cfg.task.seed, cfg.sampling, t.eval_samples, scorer=scorer
    )


def rl_step(
    backend: HFBackend,
    task: Task,
    cfg: RunConfig,
    step: int,
    opt,
    sched,
    ref_model,
    scorer: VerifierPool | None = None,
) -> dict:
    t0 = time.perf_counter()
    t = cfg.train

    def draw(problems, first=0):  # numbered from `first`: a refill's groups are new ones
        return rollout(
            backend,
            task,
            problems,
            backend.codec.encode_prompts([p.query for p in problems], cfg.sampling),
            t.group_size,
            cfg.sampling,
            seed=derive_seed(t.seed, "sample", step, *([first] if first else [])),
            version=step,
            format_reward=cfg.task.format_reward,
            job_ids=list(range(first, first + len(problems))),
            scorer=scorer,
        )

    groups, refills = draw(step_problems(task, cfg, step)), 0
    if t.dynamic_sampling:  # flat groups set aside, fresh prompts drawn in their place
        cap = round(t.dynamic_sampling_max * t.batch_prompts)
        while (flat := [g for g in groups if len(set(g.rewards)) == 1]) and refills < cap:
            n = min(len(flat), cap - refills)
            dropped = {g.job_id for g in flat[:n]}
            seed = derive_seed(cfg.task.seed, "refill", step, refills)
            fresh = draw(take(task, n, seed), t.batch_prompts + refills)
            groups = [g for g in groups if g.job_id not in dropped] + fresh
            refills += n
    t1 = time.perf_counter()
    metrics = update_policy(
        backend.model, backend.tokenizer.pad_token_id, opt, sched, groups, cfg, step, ref_model
    )
    t2 = time.perf_counter()
    tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
    return {
        "step": step,
        **reward_metrics(groups),
        **metrics,
        **({"rollout/refill_rate": refills / (refills + len(groups))} if refills else {}),
        "perf/gen_s": t1 - t0,
        "perf/gen_tokens_per_s": tokens / (t1 - t0),
        "trainer/step_s": t2 - t1,
        "perf/total_s": t2 - t0,
    }


def run_colocated(
    cfg: RunConfig, model_dir: str | Path, resume: bool = False, console: Console | None = None
) -> RunResult:
    console = console or Console()
    out = Path(cfg.train.out_dir)
    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)
    task = get_task(cfg.task.spec)
    ckpt = latest_checkpoint(out / "checkpoints") if resume else None
    model, tokenizer = load_for_training(
        model_dir, ckpt and ckpt / "policy", cfg.model.lora, cfg.model.device
    )
    ref_model = reference(model_dir, cfg)
    backend = HFBackend(model, tokenizer)
    with run_pool(cfg, backend.codec) as scorer:  # verifiers in a bounded worker process
        return _run(cfg, out, backend, task, ref_model, ckpt, scorer, console)


def _run(cfg, out, backend, task, ref_model, ckpt, scorer, console) -> RunResult:
    model, tokenizer = backend.model, backend.tokenizer
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim)
    start = load_trainer_state(ckpt, model, opt, sched).step if ckpt else 0
    log = MetricsLog(
        out / "metrics.jsonl", start, tensorboard=cfg.metrics.tensorboard, tracking=tracking(cfg)
    )
    before = None
    if start == 0:
        before = held_out(backend, task, cfg, scorer)
        log.write({"step": 0, **before.record()})
        console.print(f"held-out greedy accuracy before RL: {before.accuracy:.3f} (n={before.n})")
    flat = FlatStreak(
        cfg.launch.stall_timeout_s, run=Run.of(cfg)
    )  # raises NothingLearned: see its docstring
    with steps(console, f"RL {task.name}", cfg.train.steps, start) as bar:
        for step in range(start, cfg.train.steps):
            record = rl_step(backend, task, cfg, step, opt, sched, ref_model, scorer)
            done = step + 1
            if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done < cfg.train.steps:
                record |= held_out(backend, task, cfg, scorer).record()
            log.write(record | {"step": done})
            bar.update(
                done,
                f"reward {record['reward/mean']:.3f} {record['perf/gen_tokens_per_s']:.0f} tok/s",
            )
            if warning := flat.see(record):
                console.print(f"[yellow]step {done}: {escape(warning)}")
            if cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0:
                save_checkpoint(out / "checkpoints", done, model, tokenizer, opt, sched)
    after = held_out(backend, task, cfg, scorer)
    log.write({"step": cfg.train.steps, **after.record()})
    log.close()
    save_checkpoint(out / "checkpoints", cfg.train.steps, model, tokenizer, opt, sched)
    policy = save_policy(model, tokenizer, out / "policy")
    plot = plot_reward_curve(
        read_metrics(out / "metrics.jsonl"),
        out / "reward_curve.png",
        title=f"co-located GRPO on {task.name}",
    )
    return RunResult(before, after, out / "metrics.jsonl", plot, policy)
