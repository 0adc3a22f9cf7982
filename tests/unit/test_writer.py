"""The store writer: calls that queue up are committed together, each still all or nothing,
and the trainer's lane is served first."""

import threading
import time

import pytest

from echorl.broker.writer import Writer
from echorl.protocol import ProtocolError
from tests.unit.test_broker_store import group, sampler, store


@pytest.fixture
def s(tmp_path):
    st = store(tmp_path)
    yield st
    st.close()


def test_queued_calls_commit_together_and_a_refusal_undoes_only_itself(s):
    a = sampler(s)
    s.set_latest_version(0)
    jobs = s.lease(a, 3, 2, now=0, lease_seconds=100)
    commits = []
    s.db.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    groups = [group(s, j.job_id) for j in jobs]  # read before the writer holds the store
    bad = groups[0].model_copy(update={"job_id": 999})
    writer = Writer(s)
    gate = threading.Event()
    writer.samplers.submit(gate.wait)  # holds the writer while the pushes queue up
    futures = [writer.samplers.submit(s.push, a, g, 1.0) for g in groups]
    refused = writer.samplers.submit(s.push, a, bad, 1.0)
    gate.set()
    seeds = [f.result(10) for f in futures]
    with pytest.raises(ProtocolError, match="unknown job 999"):
        refused.result(10)
    writer.close()
    s.db.set_trace_callback(None)
    assert seeds == [j.seed for j in jobs]
    assert s.counts()["rollouts"] == {"scoring": 3}
    assert len(commits) <= 2  # the gate's batch and the pushes' (not one per push)


def test_the_trainer_lane_goes_before_queued_sampler_calls(s):
    writer = Writer(s)
    order = []
    gate = threading.Event()
    writer.samplers.submit(gate.wait)
    sampler_calls = [
        writer.samplers.submit(lambda k=k: (time.sleep(0.01), order.append(f"s{k}")))
        for k in range(40)
    ]
    time.sleep(0.05)  # the gate's batch is running: everything else waits in the queue
    trainer_call = writer.trainer.submit(lambda: order.append("trainer"))
    gate.set()
    trainer_call.result(10)
    for f in sampler_calls:
        f.result(10)
    writer.close()
    assert order.index("trainer") <= 1, order  # at most one sampler call before it
