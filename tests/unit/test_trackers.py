"""W&B (offline) and MLflow (a local store) get the run's config, every step and a summary,
read back from their own files; a resumed log goes on in the same tracker run."""

import json

import pytest

from echorl.config import load_config
from echorl.metrics import MetricsLog, read_metrics, tracking

RECORDS = [
    {"step": s, "reward/mean": 0.1 * s, "rewards/correct": s / 4, "note": "x"} for s in (1, 2, 3)
]


def wandb_records(out) -> list:
    """Every record of the offline run's transaction log (W&B's `.wandb` file: a LevelDB-style
    log of 32 KiB blocks, each record a 7-byte header (crc, length, kind) and a protobuf)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    data, block, pos, parts, records = path.read_bytes(), 32768, 7, [], []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (kind == 0 and length == 0):  # a block's zero padding
            pos += left
            continue
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def items(update) -> dict:
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in update}


def test_wandb_offline_gets_config_steps_and_summary(tmp_path):
    pytest.importorskip("wandb")
    secret = "s3cr3t" * 4
    cfg = load_config(
        None,
        ["metrics.wandb=true", "train.steps=3", "metrics.run_name=mine"]
        + [f"broker.trainer_token={secret}", f"broker.viewer_token={secret}"],
    )
    log = MetricsLog(tmp_path / "metrics.jsonl", tracking=tracking(cfg))
    for r in RECORDS:
        log.write(r)
    log.close()
    records = wandb_records(tmp_path)
    history = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["trainer/step"], h["reward/mean"], h["rewards/correct"]) for h in history] == [
        (1, 0.1, 0.25),
        (2, 0.2, 0.5),
        (3, pytest.approx(0.3), 0.75),
    ]
    # Drawn against the trainer's step, not W&B's counter: a resumed run logs the steps after
    # its checkpoint again, which the counter (past them already) would drop.
    assert [h["_step"] for h in history] == [0, 1, 2]
    metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "trainer/step" for m in metrics)
    assert all("note" not in h for h in history)  # numbers only
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"][:1]
    assert run.display_name == "mine"
    config = items(run.config.update)
    assert config["train"]["steps"] == 3 and config["metrics"]["wandb"] is True
    assert config["broker"]["trainer_token"] is None and config["broker"]["viewer_token"] is None
    assert (
        secret.encode()
        not in next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
    )
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary |= items(r.summary.update)
    assert summary["reward/mean"] == pytest.approx(0.3) and summary["rewards/correct"] == 0.75
    assert read_metrics(tmp_path / "metrics.jsonl") == RECORDS  # the JSONL as ever


def test_mlflow_gets_params_steps_and_summary_and_a_resume_continues(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    cfg = load_config(None, ["metrics.mlflow=true", "metrics.tensorboard=false", "train.steps=3"])
    log = MetricsLog(tmp_path / "metrics.jsonl", tracking=tracking(cfg))
    for r in RECORDS[:2]:
        log.write(r)
    log.close()
    resumed = MetricsLog(tmp_path / "metrics.jsonl", keep_through_step=2, tracking=tracking(cfg))
    resumed.write(RECORDS[2])
    resumed.close()
    assert not (tmp_path / "tb").exists()  # metrics.tensorboard = false
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert run.data.params["train.steps"] == "3" and run.data.params["task.name"] == "add"
    history = client.get_metric_history(run_id, "reward/mean")
    assert sorted((m.step, round(m.value, 6)) for m in history) == [(1, 0.1), (2, 0.2), (3, 0.3)]
    (experiment,) = [e for e in client.search_experiments() if e.name == "echorl"]
    assert len(client.search_runs([experiment.experiment_id])) == 1  # one run, resumed
    summary = json.loads(
        (
            tmp_path / "mlruns" / experiment.experiment_id / run_id / "artifacts" / "summary.json"
        ).read_text()
    )
    assert summary["reward/mean"] == pytest.approx(0.3)
