"""BrokerClient against real broker processes: round trip, resumable downloads, retries,
and kill -9 of the broker under concurrent pushes."""

import os
import signal
import sqlite3
import threading
import time
import types

import pytest

from echorl.client import BrokerClient, BrokerRejected, BrokerUnavailable
from echorl.protocol import SamplerInfo, ScoredGroup
from tests.integration.conftest import (
    IDENTITY,
    SAMPLER,
    TRAINER,
    free_port,
    start_broker,
    stop_broker,
)
from tests.integration.conftest import group as group_body

pytestmark = pytest.mark.integration


def group(job, version=0):
    return ScoredGroup.model_validate(group_body(job, version))


def info(name):
    return SamplerInfo(name=name, **IDENTITY, cost_per_hour=0.3)


def test_client_round_trip_and_resumable_verified_download(broker, tmp_path):
    url, _ = broker
    blob = os.urandom(3 * (1 << 20) + 123)
    (tmp_path / "w.safetensors").write_bytes(blob)
    with BrokerClient(url, TRAINER) as trainer, BrokerClient(url, SAMPLER) as sampler:
        sid = sampler.register(info("c1"))  # from now on the client carries its credential
        assert sampler.latest() is None
        published = trainer.publish(0, tmp_path / "w.safetensors")
        assert sampler.latest() == published
        jobs = sampler.lease(sid, 3).jobs
        assert len(jobs) == 3
        assert sampler.push(sid, group(jobs[0])).stored
        assert not sampler.push(sid, group(jobs[0])).stored
        with pytest.raises(BrokerRejected) as e:
            sampler.pull(1, 0)
        assert e.value.status == 403
        pulled = trainer.pull(4, 0, wait_s=5)  # answered once the verifiers scored it
        assert pulled.groups[0].sampler == sid
        assert [g.job_id for g in pulled.groups] == [jobs[0].job_id]
        assert trainer.status().capacity is None  # no step reported yet
        sampler.heartbeat(sid, 0, fetch_s=0.25)  # v0 loaded in 0.25 s
        assert trainer.ack([jobs[0].job_id], 0, train_s=0.5, tokens=100) == 1
        status = trainer.status()
        capacity = status.capacity  # the broker's provisioning figures
        # Its speed as the broker measured it (the group's tokens over lease-to-push): a
        # sampler has no way to tell it.
        speed = status.samplers[0].tokens_per_s
        assert speed > 0 and capacity.swarm_tokens_per_s == speed
        assert capacity.needed_tokens_per_s == 200.0
        assert capacity.dissemination_s == 0.25 and capacity.keep == ["c1"]
        assert capacity.keep_cost_per_hour == 0.3

        dest = tmp_path / "dl.safetensors"
        (tmp_path / "dl.safetensors.part").write_bytes(blob[:1_000_000])  # an interrupted download
        assert sampler.download(published, dest).read_bytes() == blob
        (tmp_path / "dl2.safetensors.part").write_bytes(b"garbage" * 1000)  # a corrupt one
        assert sampler.download(published, tmp_path / "dl2.safetensors").read_bytes() == blob
        assert sampler.fetch(published) == blob  # the in-memory way, verified the same


def test_lease_and_pull_are_long_polls_answered_by_a_publish_and_a_push(broker, tmp_path):
    """A sampler waiting for admission gets jobs the moment the next version is out; a trainer
    waiting for groups gets them the moment they are pushed. Without the wake-up both calls
    would come back empty after their 10 s."""
    url, _ = broker  # sync, B = 16: one batch of jobs per published version
    (tmp_path / "w").write_bytes(b"v0")
    (tmp_path / "w1").write_bytes(b"v1")
    with BrokerClient(url, TRAINER) as trainer, BrokerClient(url, SAMPLER) as sampler:
        trainer.publish(0, tmp_path / "w")
        sid = sampler.register(info("poller"))
        assert len(sampler.lease(sid, 16).jobs) == 16
        assert sampler.lease(sid, 4, wait_s=0.2).jobs == []  # v0's batch is all out

        waiting = {}
        other = BrokerClient(url, SAMPLER)  # a second sampler (one holds at most B leased)
        other_id = other.register(info("poller2"))
        lease = threading.Thread(
            target=lambda: waiting.update(reply=other.lease(other_id, 4, wait_s=10.0))
        )
        lease.start()
        time.sleep(0.3)
        v1 = trainer.publish(1, tmp_path / "w1")
        lease.join()
        reply = waiting["reply"]
        assert [j.required_version for j in reply.jobs] == [1] * 4
        assert reply.latest == v1  # the digest comes with the jobs: no describe needed

        pull = threading.Thread(
            target=lambda: waiting.update(pulled=trainer.clone().pull(2, 1, wait_s=10.0))
        )
        pull.start()
        time.sleep(0.3)
        other.push_many(other_id, [group(j, version=1) for j in reply.jobs[:2]])
        pull.join()
        pulled = waiting["pulled"].groups
        # answered by the push, with what was scored by then (the verifier delivers each
        # group as it finishes)
        assert pulled and {g.job_id for g in pulled} <= {j.job_id for j in reply.jobs[:2]}


def test_client_retries_until_the_broker_comes_up(tmp_path):
    port = free_port()
    procs = []
    starter = threading.Timer(1.5, lambda: procs.append(start_broker(tmp_path / "b", port)[0]))
    starter.start()
    try:
        with BrokerClient(
            f"http://127.0.0.1:{port}", SAMPLER, retries=80, backoff=0.2, max_backoff=0.5
        ) as c:
            assert c.register(info("patient"))
    finally:
        starter.join()
        for p in procs:
            stop_broker(p)
    with (
        BrokerClient(f"http://127.0.0.1:{free_port()}", SAMPLER, retries=2, backoff=0.01) as c,
        pytest.raises(BrokerUnavailable),
    ):
        c.register(info("nobody"))


def test_kill_9_under_concurrent_pushes_loses_no_acknowledged_group(tmp_path):
    data, port = tmp_path / "b", free_port()
    # B large enough that admission never holds the pushers back.
    big = ("-o", "train.batch_prompts=10000")
    proc, url = start_broker(data, port, "-o", "broker.synchronous=FULL", *big)
    (tmp_path / "w").write_bytes(b"v0")
    BrokerClient(url, TRAINER).publish(0, tmp_path / "w")
    acked: list[int] = []
    leased: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()

    def worker(k):
        with BrokerClient(url, SAMPLER, retries=0) as c:
            sid = c.register(info(f"w{k}"))
            while not stop.is_set():
                try:
                    jobs = c.lease(sid, 2).jobs
                    with lock:
                        leased.extend(j.job_id for j in jobs)
                    for j in jobs:
                        if c.push(sid, group(j)).stored:
                            with lock:
                                acked.append(j.job_id)
                except BrokerUnavailable:
                    return  # the broker is gone

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    t0 = time.time()
    while len(acked) < 40:
        assert time.time() - t0 < 120, f"only {len(acked)} groups acknowledged"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stop.set()
    for t in threads:
        t.join(10)

    with sqlite3.connect(data / "broker.sqlite") as db:
        stored = [r[0] for r in db.execute("SELECT job_id FROM rollouts")]
    assert set(acked) <= set(stored), set(acked) - set(stored)
    assert len(stored) == len(set(stored))

    proc, url = start_broker(data, port, *big)  # restart on the same data dir
    try:
        with BrokerClient(url, SAMPLER) as c:
            sid = c.register(info("after"))
            fresh = [j.job_id for j in c.lease(sid, 5).jobs]
        assert min(fresh) > max(leased)  # the cursor continues; no job id is handed out twice
    finally:
        stop_broker(proc)


def test_a_sampler_slower_than_the_timeout_keeps_its_lease_by_beating(tmp_path):
    """A lease that takes longer than `broker.sampler_timeout` (a slow machine, long
    completions): the Heartbeat keeps the sampler alive and its push accepted; a sampler
    silent as long is lost, and its jobs go back to the queue."""
    from echorl.sampler.loop import Heartbeat

    proc, url = start_broker(tmp_path / "b", free_port(), "-o", "broker.sampler_timeout=1.5")
    try:
        with (
            BrokerClient(url, TRAINER) as trainer,
            BrokerClient(url, SAMPLER) as slow,
            BrokerClient(url, SAMPLER) as silent,
        ):
            (tmp_path / "w").write_bytes(b"weights")
            trainer.publish(0, tmp_path / "w")
            terms = slow.join(info("slow"))
            assert terms.heartbeat_s == 0.5 and terms.max_body_bytes == 100_000
            quiet = silent.register(info("silent"))
            job = slow.lease(terms.sampler_id, 1).jobs[0]
            other = silent.lease(quiet, 1).jobs[0]
            beating = types.SimpleNamespace(version=0, sha256=None, name="slow")
            with Heartbeat(slow, terms.sampler_id, terms.heartbeat_s, beating):
                time.sleep(4.0)  # "generating", 2.7x the timeout
            assert slow.push(terms.sampler_id, group(job)).stored
            with pytest.raises(BrokerRejected):  # lost: its lease went back to the queue
                silent.push(quiet, group(other))
            states = {s.name: s.state for s in trainer.status().samplers}
            assert states == {"slow": "alive", "silent": "lost"}, states
    finally:
        stop_broker(proc)


def test_a_lease_too_large_for_one_push_goes_in_several(tmp_path):
    """Long completions make a lease's groups larger than `broker.max_body_bytes`: the
    sampler splits them into pushes that fit, and drops (loudly) a group that never can."""
    from echorl.sampler.loop import split_pushes

    limits = ("-o", "broker.max_body_bytes=8192", "-o", "sampling.max_new_tokens=3000")
    proc, url = start_broker(tmp_path / "b", free_port(), *limits)
    try:
        with BrokerClient(url, TRAINER) as trainer, BrokerClient(url, SAMPLER) as sampler:
            (tmp_path / "w").write_bytes(b"weights")
            trainer.publish(0, tmp_path / "w")
            terms = sampler.join(info("long"))
            jobs = sampler.lease(terms.sampler_id, 5).jobs
            groups = [
                ScoredGroup.model_validate(group_body(j, ids=[26] * n))
                for j, n in zip(jobs, (120, 120, 120, 120, 3000))
            ]
            with pytest.raises(BrokerRejected) as e:  # as one push: refused whole
                sampler.push_many(terms.sampler_id, groups)
            assert e.value.status == 413
            parts, too_big = split_pushes(groups, terms.max_body_bytes)
            assert [len(p) for p in parts] == [3, 1] and [g for g, _ in too_big] == groups[4:]
            stored = [r.stored for p in parts for r in sampler.push_many(terms.sampler_id, p)]
            assert stored == [True] * 4
    finally:
        stop_broker(proc)
