"""Benchmark of the co-located reference loop: generation tokens/s and train step time.

For each tiny-model preset and thread count it runs a few warm RL steps
(B prompts x G completions of a fixed length) and reports medians.

    python bench/reference_loop.py                       # 1m/10m/50m x 1/2 threads
    python bench/reference_loop.py --presets 1m --steps 3

Writes bench/results/reference_loop.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from echorl.config import RunConfig, SamplingConfig
from echorl.models import build_tiny_model
from echorl.rollout.generate import rollout
from echorl.rollout.hf import HFBackend
from echorl.tasks import get_task, take
from echorl.trainer.update import build_optimizer, build_scheduler, groups_to_batch, train_on_batch


def bench_one(
    preset: str, threads: int, steps: int, batch: int, group: int, new_tokens: int
) -> dict:
    torch.set_num_threads(threads)
    model, tok = build_tiny_model(preset)
    backend = HFBackend(model, tok)
    task = get_task("add")
    cfg = RunConfig.model_validate(
        {"train": {"batch_prompts": batch, "group_size": group}, "advantage": {"type": "drgrpo"}}
    )
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim)
    # A random model rarely emits eos, so completions run (nearly) to the task's max_new_tokens.
    params = SamplingConfig(temperature=1.0)
    gen_tps, train_s = [], []
    for step in range(steps + 1):  # step 0 warms up and is not counted
        problems = take(task, batch, seed=step)
        t0 = time.perf_counter()
        ids = backend.codec.encode_prompts([p.prompt for p in problems], params)
        groups = rollout(backend, task, problems, ids, group, params, seed=step)
        t1 = time.perf_counter()
        flip = [float((i + step) % 2) for i in range(group)]  # every group informative
        groups = [g.model_copy(update={"rewards": flip}) for g in groups]
        train_on_batch(model, opt, sched, groups_to_batch(groups, tok.pad_token_id, cfg), cfg)
        t2 = time.perf_counter()
        if step:
            gen_tps.append(sum(len(c.token_ids) for g in groups for c in g.completions) / (t1 - t0))
            train_s.append(t2 - t1)
    return {
        "preset": preset,
        "threads": threads,
        "params": sum(p.numel() for p in model.parameters()),
        "batch": batch * group,
        "new_tokens": new_tokens,
        "gen_tokens_per_s": statistics.median(gen_tps),
        "train_step_s": statistics.median(train_s),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["1m", "10m", "50m"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "reference_loop.json"
    )
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    rows = [
        bench_one(p, t, args.steps, args.batch, args.group, get_task("add").max_new_tokens)
        for p in args.presets
        for t in args.threads
    ]
    table = Table(title=f"reference loop, B={args.batch} x G={args.group}, task add")
    for col in ("preset", "params", "threads", "gen tokens/s", "train step s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["preset"],
            f"{r['params'] / 1e6:.1f}M",
            str(r["threads"]),
            f"{r['gen_tokens_per_s']:.0f}",
            f"{r['train_step_s']:.3f}",
        )
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.machine(),
        "cpus": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
