"""echorl's co-located GRPO loop against TRL's GRPOTrainer, side by side, on one machine.

The same warmed-up tiny model, task, prompt stream (step by step), batch (B prompts x G
completions, at most the task's new tokens), learning rate, clip range, loss (token mean)
and advantages (group-normalised) for both; steps/s over the whole run (first step
included) and held-out greedy accuracy of both final policies under echorl's evaluator.
TRL runs in a virtual environment of its own (`.venv-trl`, made here when missing: torch
as installed here, then `trl` and echorl itself, for the task and the model folder).

    python bench/peer_trl.py                       # add, 100 steps, seeds 0 1 2
    python bench/peer_trl.py --steps 40 --seeds 0

Writes bench/results/peer_trl_PRESET.json and .png (both loops' reward per step), and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from echorl.config import load_config
from echorl.models import build_tiny_model, load_policy
from echorl.rollout.hf import HFBackend
from echorl.rollout.verify import run_pool
from echorl.tasks import get_task
from echorl.trainer.colocated import held_out, rl_step
from echorl.trainer.sft import warm_up
from echorl.trainer.update import build_optimizer, build_scheduler

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-trl"
OUT = ROOT / "bench" / "results"
console = Console()


def trl_python() -> Path:
    """TRL's interpreter, installing its environment first if need be (torch pinned to the
    version here, so pip never pulls another)."""
    python = VENV / "bin" / "python"
    if python.is_file():
        return python
    console.print(f"making {VENV} (torch {torch.__version__.split('+')[0]}, trl, echorl)")
    subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}"], check=True)
    subprocess.run([*pip, "trl", "-e", str(ROOT)], check=True)
    return python


def warm_model(task: str, preset: str, folder: Path) -> Path:
    """The demo's warm-up (supervised, on task demonstrations): both loops start from it."""
    if not (folder / "config.json").is_file():
        cfg = load_config(None, [f"task.name={task}", f"model.preset={preset}"])
        model, tok = build_tiny_model(cfg.model.preset, cfg.model.init_seed)
        warm_up(model, tok, get_task(task), cfg.sft)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


def overrides(task: str, seed: int, steps: int) -> list[str]:
    return [
        f"task.name={task}",
        f"task.seed={seed}",
        f"train.seed={seed}",
        f"train.steps={steps}",
        "train.eval_prompts=200",
    ]


def accuracy(folder: Path, cfg, threads: int) -> float:
    torch.set_num_threads(threads)
    backend = HFBackend(*load_policy(folder))
    with run_pool(cfg, backend.codec) as scorer:
        return held_out(backend, get_task(cfg.task.spec), cfg, scorer).accuracy


def run_echorl(model: Path, cfg, threads: int) -> dict:
    torch.set_num_threads(threads)
    backend = HFBackend(*load_policy(model))
    task = get_task(cfg.task.spec)
    opt = build_optimizer(backend.model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim)
    rewards = []
    with run_pool(cfg, backend.codec) as scorer:
        t0 = time.perf_counter()
        for step in range(cfg.train.steps):
            rewards.append(
                rl_step(backend, task, cfg, step, opt, sched, None, scorer)["reward/mean"]
            )
        wall = time.perf_counter() - t0
        after = held_out(backend, task, cfg, scorer).accuracy
    return {"wall_s": wall, "rewards": rewards, "accuracy": after}


def run_trl(python: Path, model: Path, cfg, threads: int, out: Path) -> dict:
    t = cfg.train
    cmd = [str(python), str(ROOT / "bench" / "trl_side.py"), "--model", str(model)]
    cmd += ["--out", str(out), "--task", cfg.task.name, "--steps", str(t.steps)]
    cmd += ["--batch", str(t.batch_prompts), "--group", str(t.group_size)]
    cmd += ["--max-new-tokens", str(get_task(cfg.task.spec).max_new_tokens)]
    cmd += ["--lr", str(cfg.optim.lr), "--threads", str(threads), "--seed", str(t.seed)]
    cmd += ["--task-seed", str(cfg.task.seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"TRL failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["accuracy"] = accuracy(out / "policy", cfg, threads)
    return result


def plot(runs: dict, path: Path, window: int = 10) -> None:
    """Each loop's train reward per step, mean over seeds, smoothed over `window` steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, colour in (("echorl", "tab:blue"), ("trl", "tab:orange")):
        curves = [r["rewards"] for (n, _), r in runs.items() if n == name]
        mean = [statistics.mean(step) for step in zip(*curves)]
        smooth = [statistics.mean(mean[max(0, i - window + 1) : i + 1]) for i in range(len(mean))]
        steps = range(1, len(mean) + 1)
        ax.plot(steps, mean, color=colour, alpha=0.25, linewidth=0.8)
        ax.plot(
            steps, smooth, color=colour, label=f"{name} ({len(curves)} seeds, {window}-step mean)"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("train reward (mean of B x G)")
    ax.set_title("co-located GRPO: echorl vs TRL GRPOTrainer, same model and prompts")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--task", default="add")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--preset", default="1m", help="the tiny model's size (warmed up once)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "peer_trl"))
    a = ap.parse_args()
    work = Path(a.work)
    python = trl_python()
    version = subprocess.run(
        [
            str(python),
            "-c",
            "import trl, transformers; print(trl.__version__, transformers.__version__)",
        ],
        capture_output=True,
        text=True,
    ).stdout.split()
    model = warm_model(a.task, a.preset, work / f"sft-{a.preset}")
    before = accuracy(model, load_config(None, overrides(a.task, a.seeds[0], a.steps)), a.threads)
    runs = {}
    for seed in a.seeds:
        cfg = load_config(None, overrides(a.task, seed, a.steps))
        console.print(f"seed {seed}: echorl ...")
        runs["echorl", seed] = run_echorl(model, cfg, a.threads)
        console.print(f"seed {seed}: TRL ...")
        runs["trl", seed] = run_trl(python, model, cfg, a.threads, work / f"trl-{seed}")
    table = Table(
        title=f"co-located GRPO, {a.preset} model, {a.task}, B=16 x G=8, {a.steps} steps, "
        f"{a.threads} threads"
    )
    for col in ("loop", "steps/s (mean)", "per seed", "held-out acc (mean)", "per seed"):
        table.add_column(col)
    summary = {}
    for name in ("echorl", "trl"):
        rates = [a.steps / runs[name, s]["wall_s"] for s in a.seeds]
        accs = [runs[name, s]["accuracy"] for s in a.seeds]
        summary[name] = {"steps_per_s": statistics.mean(rates), "accuracy": statistics.mean(accs)}
        table.add_row(
            name,
            f"{statistics.mean(rates):.2f}",
            " ".join(f"{r:.2f}" for r in rates),
            f"{statistics.mean(accs):.3f}",
            " ".join(f"{x:.3f}" for x in accs),
        )
    console.print(table)
    speedup = summary["echorl"]["steps_per_s"] / summary["trl"]["steps_per_s"]
    console.print(
        f"held-out accuracy before RL {before:.3f}; echorl runs {speedup:.2f}x TRL's steps/s"
    )
    OUT.mkdir(parents=True, exist_ok=True)
    plot(runs, OUT / f"peer_trl_{a.preset}.png")
    (OUT / f"peer_trl_{a.preset}.json").write_text(
        json.dumps(
            {
                "task": a.task,
                "preset": a.preset,
                "steps": a.steps,
                "seeds": a.seeds,
                "threads": a.threads,
                "trl": version[0] if version else None,
                "transformers_trl_env": version[1] if len(version) > 1 else None,
                "torch": torch.__version__,
                "machine": platform.machine(),
                "accuracy_before": before,
                "summary": summary,
                "speedup": speedup,
                "runs": {f"{k[0]}/{k[1]}": v for k, v in runs.items()},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
