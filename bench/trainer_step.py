"""The trainer's step time on one device: the policy alone, and the same policy as a one-rank
FSDP2 world (the torchrun path: NCCL on a GPU, gloo on the CPU).

    torchrun --nproc-per-node 1 bench/trainer_step.py --device cuda --preset 50m
    torchrun --nproc-per-node 1 bench/trainer_step.py --device cpu --preset 1m --steps 3

Each step is `update_policy` (the decoupled trainer's) on B x G scored completions of random
tokens (prompts of 8-16 tokens, completions of `--new-tokens`, one epoch of one minibatch,
as the default config), after `--warmup` steps. Prints a table and writes
bench/results/trainer_step_DEVICE.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from echorl.config import load_config
from echorl.models.tiny import build_tiny_model
from echorl.testing import random_groups
from echorl.trainer.distributed import SOLO, join_world, wrap
from echorl.trainer.update import build_optimizer, build_scheduler, update_policy

OUT = Path(__file__).resolve().parent / "results"
console = Console(width=120)


def time_steps(model, world, wrapped, cfg, args) -> list[float]:
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim)
    vocab = model.config.vocab_size
    times = []
    for step in range(args.warmup + args.steps):
        n = args.new_tokens
        groups = random_groups(step, args.batch, args.group, vocab, completion=(n, n))
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        update_policy(model, 0, opt, sched, groups, cfg, step, world=world, wrapped=wrapped)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="50m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    cfg = load_config(None, [f"train.batch_prompts={args.batch}", f"train.group_size={args.group}"])
    world = join_world("fsdp2", args.device)  # under torchrun: a world of one rank
    rows = []
    for name, w in (("plain", SOLO), (f"fsdp2, {world.size} rank", world)):
        if name != "plain" and not world.started:
            console.print("not under torchrun: the FSDP2 row is skipped")
            continue
        model = build_tiny_model(args.preset, seed=0)[0].to(args.device)
        wrapped = wrap(model, w)
        times = time_steps(model, w, wrapped, cfg, args)
        rows.append(
            {
                "trainer": name,
                "step_s_median": statistics.median(times),
                "step_s_min": min(times),
                "tokens_per_s": args.batch
                * args.group
                * args.new_tokens
                / statistics.median(times),
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30
                if args.device.startswith("cuda")
                else None,
            }
        )
        console.print(rows[-1])
        del model, wrapped
    if world.leader:
        table = Table(
            title=f"trainer step, {args.preset}, {args.batch} x {args.group} x {args.new_tokens} "
            f"tokens, {args.device}"
        )
        for col in ("trainer", "step s (median)", "step s (min)", "tokens/s"):
            table.add_column(col)
        for r in rows:
            table.add_row(
                r["trainer"],
                f"{r['step_s_median']:.3f}",
                f"{r['step_s_min']:.3f}",
                f"{r['tokens_per_s']:.0f}",
            )
        console.print(table)
        OUT.mkdir(parents=True, exist_ok=True)
        gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
        path = OUT / f"trainer_step_{args.device.split(':')[0]}.json"
        path.write_text(
            json.dumps(
                {"args": vars(args), "torch": torch.__version__, "gpu": gpu, "rows": rows},
                indent=1,
            )
        )
    world.close()


if __name__ == "__main__":
    main()
