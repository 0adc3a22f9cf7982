"""Metrics: append-only JSONL (one object per step) and PNG plots of it.

Keys are namespaced (`reward/mean`, `rollout/staleness_max`, `trainer/step_s`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402


class MetricsLog:
    """Append-only JSONL; each line is flushed so a crash loses at most the step in flight."""

    def __init__(self, path: Path, keep_through_step: int = 0):
        """Open `path` for appending, first dropping records of steps after `keep_through_step`
        (a resumed run rewrites what it logged after its checkpoint); 0 starts afresh."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if keep_through_step and path.is_file():
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= keep_through_step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _moving_average(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_reward_curve(records: list[dict], path: Path, title: str = "") -> Path:
    """Training reward per step (raw and smoothed) and held-out greedy accuracy."""
    steps = [r["step"] for r in records if "reward/mean" in r]
    reward = [r["reward/mean"] for r in records if "reward/mean" in r]
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, reward, color="tab:blue", alpha=0.3, label="train reward (mean)")
    ax.plot(
        steps, _moving_average(reward, 10), color="tab:blue", label="train reward (10-step avg)"
    )
    if evals:
        ax.plot(*zip(*evals), "o-", color="tab:orange", label="held-out greedy accuracy")
    ax.set_xlabel("RL step (policy version)")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
