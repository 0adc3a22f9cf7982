"""The trainer's I/O process against a real broker: uploads land in order, a version with a
NaN is refused there (and the broker never sees it), and the metrics it writes for the
trainer are all on disk when it closes."""

import pytest
import torch

from echorl.client import BrokerClient
from echorl.metrics import read_metrics
from echorl.trainer.brokerio import BrokerIO, NonFiniteWeights

from .conftest import TRAINER


def test_uploads_refuses_a_nan_version_and_writes_the_metrics(broker, tmp_path):
    url, _ = broker
    client = BrokerClient(url, TRAINER)
    io = BrokerIO(client, spill=tmp_path)
    weights = {"w": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.bfloat16)}
    io.publish(weights, {"format": "pt"}, 0)
    io.wait()
    assert client.latest().version == 0 and io.last_bytes > 0
    broken = dict(weights, b=torch.tensor([1.0, float("inf")], dtype=torch.bfloat16))
    io.publish(broken, {"format": "pt"}, 1)
    with pytest.raises(NonFiniteWeights, match="version 1 has non-finite values in 1 tensors"):
        io.wait()
    assert client.latest().version == 0  # never stored, never served
    io.publish(weights, {"format": "pt"}, 1)  # the helper goes on after a refusal
    io.wait()
    assert client.latest().version == 1
    metrics = tmp_path / "run" / "metrics.jsonl"
    io.open_log(metrics)
    for step in range(1, 4):
        io.log(
            {"step": step, "reward/mean": step / 10, "loss/policy": float("nan")}, f"step {step}"
        )
    io.close()
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["loss/policy"] is None
    assert list((metrics.parent / "tb").glob("events.out.tfevents.*"))
    client.close()
