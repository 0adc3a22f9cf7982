"""Metrics: append-only JSONL (one object per step), TensorBoard when installed, W&B and
MLflow when asked (echorl/trackers.py), PNG plots.

Keys are namespaced (`reward/mean`, `rollout/staleness_max`, `trainer/step_s`).
TensorBoard event files go next to the JSONL (`tb/`) when the optional
`tensorboard` package is installed (`pip install echorl[tb]`). Writing needs
neither torch nor matplotlib (the decoupled trainer logs from its I/O process).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


def tracking(cfg) -> tuple[dict, dict]:
    """What MetricsLog needs of a RunConfig for its trackers: their settings, the config
    (without its tokens: a tracker's server is no place for them)."""
    config = cfg.model_dump(mode="json")
    config["broker"] |= dict.fromkeys(TOKENS)
    return cfg.metrics.model_dump(), config


TOKENS = ("trainer_token", "sampler_token", "viewer_token")  # never written out nor sent


class MetricsLog:
    """Append-only JSONL; each line is flushed so a crash loses at most the step in flight."""

    def __init__(
        self,
        path: Path,
        keep_through_step: int = 0,
        tensorboard: bool = False,
        tracking: tuple[dict, dict] | None = None,
    ):
        """Open `path` for appending, first dropping records of steps after `keep_through_step`
        (a resumed run rewrites what it logged after its checkpoint); 0 starts afresh.
        `tensorboard`: also write event files to `path.parent / "tb"`, if tensorboard is installed.
        `tracking`: (a MetricsConfig's dump, the run's config) for W&B and MLflow."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if keep_through_step and path.is_file():
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= keep_through_step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self.file = path.open("a")
        self.tb = _event_writer(path.parent / "tb") if tensorboard else None
        self.trackers, self.last = [], {}
        if tracking is not None:
            from echorl.trackers import open_trackers

            self.tb = self.tb if tracking[0].get("tensorboard", True) else None
            self.trackers = open_trackers(tracking[0], path.parent, tracking[1])

    def write(self, record: dict) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        if self.trackers:
            from echorl.trackers import numbers

            values = numbers(clean)
            self.last |= values
            for tracker in self.trackers:
                tracker.log(record.get("step", 0), values)
        if self.tb is not None:
            from tensorboard.compat.proto import event_pb2, summary_pb2

            values = [
                summary_pb2.Summary.Value(tag=k, simple_value=v)
                for k, v in clean.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"
            ]
            # One event per step holding every scalar; the writer flushes on its own clock.
            self.tb.add_event(
                event_pb2.Event(
                    wall_time=time.time(),
                    step=record.get("step", 0),
                    summary=summary_pb2.Summary(value=values),
                )
            )

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        for tracker in self.trackers:  # the summary: each number's last value
            tracker.finish(self.last)
        self.trackers = []


def _event_writer(folder: Path):
    try:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:  # the optional extra is not installed: JSONL only
        return None
    return EventFileWriter(str(folder))


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsTail:
    """Follows a metrics file as it grows: each `read()` returns the records appended since
    the last one (whole lines only), so watching a long run costs nothing per refresh.
    A file rewritten shorter (a resumed run drops what it logged after its checkpoint) is
    read again from the start, and `restarted` says so."""

    def __init__(self, path: Path):
        self.path, self.offset, self.restarted = path, 0, False

    def read(self) -> list[dict]:
        self.restarted = False
        if not self.path.is_file():
            return []
        if self.path.stat().st_size < self.offset:
            self.offset, self.restarted = 0, True
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits
        self.offset += len(whole)
        return [json.loads(line) for line in whole.splitlines() if line.strip()]


def _moving_average(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot_reward_curve(records: list[dict], path: Path, title: str = "") -> Path:
    """Training reward per step (raw and smoothed), held-out greedy accuracy and, when
    logged, held-out sampled pass@1."""
    plt = _pyplot()
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
    sampled = [(r["step"], r["eval/pass1"]) for r in records if "eval/pass1" in r]
    if sampled:
        ax.plot(*zip(*sampled), "s--", color="tab:green", label="held-out pass@1 (sampled)")
    ax.set_xlabel("RL step (policy version)")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    return _save(fig, path)


def plot_run(records: list[dict], out: Path, title: str = "") -> list[Path]:
    """The decoupled run's report: reward vs step and vs wall-clock, staleness per step."""
    plt = _pyplot()
    train = [r for r in records if "reward/mean" in r]
    paths = [plot_reward_curve(records, out / "reward_curve.png", title=f"{title}: reward")]
    if not train or "time" not in train[0]:
        return paths
    t0 = min(r["time"] - r.get("trainer/idle_s", 0) - r.get("trainer/step_s", 0) for r in train)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    wall = [r["time"] - t0 for r in train]
    reward = [r["reward/mean"] for r in train]
    ax.plot(wall, reward, color="tab:blue", alpha=0.3, label="train reward (mean)")
    ax.plot(wall, _moving_average(reward, 10), color="tab:blue", label="10-step avg")
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"{title}: reward vs wall-clock")
    paths.append(_save(fig, out / "reward_vs_time.png"))
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=120)
    steps = [r["step"] for r in train]
    hists = [r.get("rollout/staleness_hist", [len(train)]) for r in train]
    depth = max(len(h) for h in hists)
    bottom = [0] * len(train)
    for k in range(depth):
        counts = [h[k] if k < len(h) else 0 for h in hists]
        ax.bar(steps, counts, bottom=bottom, width=1.0, label=f"staleness {k}")
        bottom = [b + c for b, c in zip(bottom, counts)]
    ax.set_xlabel("trainer step")
    ax.set_ylabel("groups in the batch")
    ax.legend(loc="upper right", fontsize="small")
    ax.set_title(f"{title}: staleness of consumed groups")
    paths.append(_save(fig, out / "staleness.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    _pyplot().close(fig)
    return path
