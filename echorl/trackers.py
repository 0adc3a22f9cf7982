"""Experiment trackers beside metrics.jsonl: Weights & Biases and MLflow (`metrics.wandb`,
`metrics.mlflow`). Each gets the run's config once, every step's numbers, and a summary (the
last value of each) when the log closes. A resumed run goes on in the same tracker run: its
id is kept in `OUT/trackers.json`.

    [metrics]
    wandb = true          # offline by default: `wandb sync OUT/wandb/offline-run-*` uploads
    mlflow = true         # OUT/mlruns, or mlflow_uri = "http://mlflow:5000"
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path


def open_trackers(settings: dict, out: Path, config: dict) -> list:
    """The trackers `settings` (a MetricsConfig's dump) turn on, opened for the run in `out`."""
    ids_file = out / "trackers.json"
    ids = json.loads(ids_file.read_text()) if ids_file.is_file() else {}
    trackers = []
    if settings.get("wandb"):
        trackers.append(WandbTracker(settings, out, config, ids))
    if settings.get("mlflow"):
        trackers.append(MlflowTracker(settings, out, config, ids))
    if trackers:
        ids_file.write_text(json.dumps(ids))
    return trackers


def numbers(record: dict) -> dict[str, float]:
    """The numeric entries of a metrics record, but its step."""
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and k != "step"
    }


def flat(config: dict, prefix: str = "") -> dict[str, str]:
    """`{"train": {"steps": 4}}` -> `{"train.steps": "4"}`: a config as tracker parameters."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out |= flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, type(None))) else str(v)
    return out


STEP = "trainer/step"


class WandbTracker:
    def __init__(self, settings: dict, out: Path, config: dict, ids: dict):
        try:
            import wandb
        except ImportError:
            raise RuntimeError("metrics.wandb needs wandb (pip install echorl[trackers])") from None
        ids.setdefault("wandb", uuid.uuid4().hex[:16])
        self.run = wandb.init(
            project=settings["project"],
            name=settings.get("run_name") or out.name,
            id=ids["wandb"],
            resume="allow",
            dir=str(out),
            mode=settings["wandb_mode"],
            config=config,
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        # Every number is drawn against the trainer's step, not W&B's own counter: a resumed
        # run logs again the steps after its checkpoint, which W&B's counter (past them
        # already) would drop.
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values | {STEP: step}, commit=True)  # a row each, written now

    def finish(self, summary: dict[str, float]) -> None:
        self.run.summary.update(summary)
        self.run.finish()


class MlflowTracker:
    def __init__(self, settings: dict, out: Path, config: dict, ids: dict):
        # MLflow 3 keeps a folder store only when asked: a local run's is its own folder.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise RuntimeError(
                "metrics.mlflow needs mlflow (pip install echorl[trackers])"
            ) from None
        uri = settings.get("mlflow_uri") or (out / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        if "mlflow" in ids:
            self.run_id = ids["mlflow"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = settings["project"]
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        run = self.client.create_run(exp_id, run_name=settings.get("run_name") or out.name)
        self.run_id = ids["mlflow"] = run.info.run_id
        params = [Param(k, v[:6000]) for k, v in flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow's bound per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def finish(self, summary: dict[str, float]) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")
        self.client.set_terminated(self.run_id)
