"""The trainer's I/O process against a real broker: uploads land in order, a version with a
NaN is refused there (and the broker never sees it), and the metrics it writes for the
trainer are all on disk when it closes."""

import httpx
import pytest
import torch

from echorl.client import BrokerClient
from echorl.metrics import read_metrics
from echorl.trainer.brokerio import BrokerIO, NonFiniteWeights

from .conftest import TRAINER, as_


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


def test_a_batch_pulled_in_parts_holds_its_first_groups_and_trains_each_once(tmp_path):
    """The trainer pulls until it holds B groups. While it waits for the rest, every pull
    renews the groups it holds: before, their pull lease (here 1 s) ran out, they were
    offered again, and the batch held them twice (chaos, seed 9: a step trained [4, 4, 5, 5]).
    And a group offered again anyway (its lease ran out while the broker was down) is held
    once."""
    import threading
    import time

    from echorl.trainer.brokerio import collect

    from .conftest import free_port, group, lease, publish, register, start_broker, stop_broker

    run = ("-o", "broker.trainer_lease_seconds=1", "-o", "train.batch_prompts=4")
    run += ("-o", "broker.first_lease=1000000")
    proc, url = start_broker(tmp_path / "b", free_port(), *run)
    try:
        publish(url, 0, b"w")
        sid = register(url, "s")
        jobs = lease(url, sid, 4).json()["jobs"]
        assert len(jobs) == 4

        def push(batch):
            for job in batch:
                body = {"sampler_id": sid, "group": group(job)}
                r = httpx.post(f"{url}/v1/rollouts", json=body, headers=as_(sid))
                assert r.status_code == 200

        push(jobs[:2])
        late = threading.Timer(3.0, push, args=(jobs[2:],))  # three pull leases later
        late.start()
        with BrokerClient(url, TRAINER) as client:
            t0 = time.monotonic()
            groups, _ = collect(client, 4, 0, threading.Event(), wait_s=0.5)
            waited = time.monotonic() - t0
        late.join()
    finally:
        stop_broker(proc)
    assert waited > 2.5  # it held the first two while the leases would have run out
    assert sorted(g.job_id for g in groups) == sorted(j["job_id"] for j in jobs)
