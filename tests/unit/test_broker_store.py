import pytest

from echorl.broker.store import Admission, BrokerStore
from echorl.protocol import ProtocolError, RolloutGroup, SamplerInfo
from echorl.tasks import get_task

TASK = get_task("add")


def store(path, **kw):
    return BrokerStore(
        path / "broker.sqlite", "add", TASK.problem, run_seed=0, vocab_size=258, **kw
    )


def group(job_id, version=0, g=2, ids=(20, 21, 1)):
    return RolloutGroup.model_validate(
        {
            "job_id": job_id,
            "version": version,
            "completions": [
                {"token_ids": list(ids), "logprobs": [-0.5] * len(ids), "finished": True}
            ]
            * g,
        }
    )


def dump(s):
    return list(s.db.iterdump())


@pytest.fixture
def s(tmp_path):
    st = store(tmp_path)
    yield st
    st.close()


def sampler(s, name="s1", now=0.0):
    return s.register(SamplerInfo(name=name), now)


def test_lease_draws_new_jobs_from_a_persisted_cursor(tmp_path):
    s = store(tmp_path)
    a = sampler(s)
    jobs = s.lease(a, 3, group_size=2, now=0, lease_seconds=10)
    assert [j.job_id for j in jobs] == [0, 1, 2]
    assert all(TASK.problem(j.seed).prompt == j.prompt and j.group_size == 2 for j in jobs)
    s.close()
    s = store(tmp_path)  # a restarted broker continues the stream, no repeats
    more = s.lease(sampler(s), 2, group_size=2, now=1, lease_seconds=10)
    assert [j.job_id for j in more] == [3, 4]
    assert len({j.prompt for j in jobs + more}) == 5


def test_expired_leases_come_back_first_and_park_after_max_attempts(tmp_path):
    s = store(tmp_path, max_attempts=2)
    a = sampler(s)
    s.lease(a, 2, 2, now=0, lease_seconds=10)
    assert s.expire(now=5, sampler_timeout=100) == (0, 0)
    assert s.expire(now=11, sampler_timeout=100) == (2, 0)
    again = s.lease(a, 3, 2, now=11, lease_seconds=10)
    assert [j.job_id for j in again] == [0, 1, 2]
    s.expire(now=30, sampler_timeout=100)
    assert s.counts()["jobs"] == {"parked": 2, "queued": 1}


def test_a_lost_sampler_frees_its_leases(s):
    a, b = sampler(s, "a"), sampler(s, "b")
    s.lease(a, 2, 2, now=0, lease_seconds=1000)
    s.heartbeat(b, now=50)
    assert s.expire(now=60, sampler_timeout=30) == (2, 1)
    assert [j.job_id for j in s.lease(b, 2, 2, now=60, lease_seconds=10)] == [0, 1]
    with pytest.raises(ProtocolError, match="not registered and alive"):
        s.lease(a, 1, 2, now=61, lease_seconds=10)
    s.heartbeat(a, now=62)  # it comes back
    assert s.lease(a, 1, 2, now=62, lease_seconds=10)[0].job_id == 2


def test_a_leaving_sampler_returns_its_leases_at_once(s):
    a, b = sampler(s, "a"), sampler(s, "b")
    s.lease(a, 2, 2, now=0, lease_seconds=1000)
    s.lease(b, 1, 2, now=0, lease_seconds=1000)
    assert s.leave(a) == 2
    assert s.counts()["jobs"] == {"leased": 1, "queued": 2}
    assert [j.job_id for j in s.lease(b, 2, 2, now=1, lease_seconds=10)] == [0, 1]
    with pytest.raises(ProtocolError, match="not registered and alive"):
        s.lease(a, 1, 2, now=1, lease_seconds=10)
    with pytest.raises(ProtocolError, match="has left"):
        s.heartbeat(a, now=2)


def test_push_is_idempotent(s):
    a = sampler(s)
    s.set_latest_version(0)
    s.lease(a, 1, 2, now=0, lease_seconds=10)
    assert s.push(a, group(0), [1.0, 0.0], now=1) is True
    assert s.push(a, group(0), [1.0, 0.0], now=2) is False
    assert s.counts()["rollouts"] == {"ready": 1}
    assert s.counts()["jobs"] == {"done": 1}


@pytest.mark.parametrize(
    "make,reason",
    [
        (lambda s, a, b: s.push(b, group(0), [0, 0], 1), "not leased to sampler"),
        (lambda s, a, b: s.push(a, group(7), [0, 0], 1), "unknown job 7"),
        (lambda s, a, b: s.push(a, group(0, version=1), [0, 0], 1), "newer than the latest"),
        (lambda s, a, b: s.push(a, group(0, g=3), [0, 0, 0], 1), "leased with G = 2"),
        (lambda s, a, b: s.push(a, group(0, ids=(20, 258)), [0, 0], 1), "outside the vocabulary"),
        (lambda s, a, b: s.ack([0], step=0), "has no stored group"),
        (lambda s, a, b: s.set_latest_version(2), "not the next one"),
        (lambda s, a, b: s.heartbeat("nobody", 1), "unknown sampler"),
    ],
)
def test_refused_requests_change_nothing(s, make, reason):
    a, b = sampler(s, "a"), sampler(s, "b")
    s.set_latest_version(0)
    s.lease(a, 1, 2, now=0, lease_seconds=10)
    before = dump(s)
    with pytest.raises(ProtocolError, match=reason):
        make(s, a, b)
    assert dump(s) == before


def test_sync_jobs_need_the_required_version(s):
    a = sampler(s)
    s.set_latest_version(0)
    s.set_latest_version(1)
    s.lease(a, 1, 2, now=0, lease_seconds=10, required_version=1)
    with pytest.raises(ProtocolError, match="requires version 1"):
        s.push(a, group(0, version=0), [0, 0], 1)
    assert s.push(a, group(0, version=1), [0, 0], 1)


def fill(s, versions):
    a = sampler(s)
    for v in range(0, max(versions) + 1):
        s.set_latest_version(v)
    jobs = s.lease(a, len(versions), 2, now=0, lease_seconds=10)
    for j, v in zip(jobs, versions):
        s.push(a, group(j.job_id, version=v), [1.0, 0.0], now=1)


def test_sync_pull_takes_exactly_one_version(s):
    fill(s, [1, 2, 2, 1])
    groups, dropped = s.pull(10, now=2, lease_seconds=10, version=2)
    assert sorted(g.group.job_id for g in groups) == [1, 2]
    assert dropped == 2  # version 1 can never be consumed once the trainer is at step 2
    assert all(g.group.version == 2 and g.rewards == [1.0, 0.0] for g in groups)


def test_async_pull_drops_too_stale_groups_and_takes_the_freshest(s):
    fill(s, [0, 1, 3, 3, 4])
    groups, dropped = s.pull(2, now=2, lease_seconds=10, min_version=2)
    assert [g.group.version for g in groups] == [4, 3]
    assert dropped == 2
    assert s.counts()["rollouts"] == {"pulled": 2, "ready": 1, "stale": 2}


def test_async_pull_takes_groups_at_the_bound_before_fresher_ones(s):
    """A group of version step - max_staleness is usable now and never again: it goes first,
    so that nothing admitted is generated for nothing."""
    fill(s, [2, 4, 3, 2, 4])
    groups, _ = s.pull(3, now=2, lease_seconds=10, min_version=2)
    assert [g.group.version for g in groups] == [2, 2, 4]
    groups, dropped = s.pull(2, now=2, lease_seconds=10, min_version=3)
    assert [g.group.version for g in groups] == [3, 4] and dropped == 0


def test_pulled_groups_come_back_if_not_acked_and_are_consumed_once(s):
    fill(s, [0, 0, 0])
    first, _ = s.pull(3, now=2, lease_seconds=10, version=0)
    assert s.pull(3, now=3, lease_seconds=10, version=0)[0] == []  # leased to the trainer
    s.expire(now=20, sampler_timeout=1e9)  # the trainer died before acking
    again, _ = s.pull(3, now=20, lease_seconds=10, version=0)
    assert [g.group.job_id for g in again] == [g.group.job_id for g in first]
    assert s.ack([0, 1, 2], step=0) == 3
    assert s.ack([0, 1, 2], step=0) == 0  # re-ack is a no-op
    s.expire(now=100, sampler_timeout=1e9)
    assert s.pull(3, now=100, lease_seconds=10, version=0)[0] == []
    assert s.counts()["rollouts"] == {"consumed": 3}


def test_admission_keeps_out_only_what_the_bound_lets_the_trainer_consume(s):
    a = sampler(s)
    admit = Admission(batch=2, max_staleness=1, pin_version=False)
    assert s.lease(a, 9, 2, now=0, lease_seconds=10, admit=admit) == []  # no v0 yet
    s.set_latest_version(0)
    jobs = s.lease(a, 9, 2, now=0, lease_seconds=10, admit=admit)
    assert len(jobs) == 4  # (0 + 1 + 1) * B
    for j in jobs:
        s.push(a, group(j.job_id), [1.0, 0.0], now=1)
    pulled, _ = s.pull(2, now=2, lease_seconds=10, min_version=0)
    s.ack([g.group.job_id for g in pulled], step=0)
    assert s.lease(a, 9, 2, now=3, lease_seconds=10, admit=admit) == []  # consumed still count
    s.set_latest_version(1)
    assert len(s.lease(a, 9, 2, now=3, lease_seconds=10, admit=admit)) == 2


def test_sync_admission_pins_exactly_one_batch_to_the_latest_version(s):
    a, b = sampler(s, "a"), sampler(s, "b")
    admit = Admission(batch=3, max_staleness=0, pin_version=True)
    s.set_latest_version(0)
    first = s.lease(a, 2, 2, now=0, lease_seconds=10, admit=admit)
    second = s.lease(b, 2, 2, now=0, lease_seconds=10, admit=admit)
    assert [j.job_id for j in first + second] == [0, 1, 2]
    assert {j.required_version for j in first + second} == {0}


def test_a_retried_pull_gets_the_same_groups(s):
    fill(s, [0, 0, 0, 0])
    first, _ = s.pull(2, now=2, lease_seconds=10, version=0, request_id="r1")
    again, _ = s.pull(2, now=3, lease_seconds=10, version=0, request_id="r1")
    assert [g.group.job_id for g in again] == [g.group.job_id for g in first] == [0, 1]
    other, _ = s.pull(2, now=3, lease_seconds=10, version=0, request_id="r2")
    assert [g.group.job_id for g in other] == [2, 3]


def test_rewind_returns_what_the_dead_trainer_consumed_and_forgets_its_versions(s):
    fill(s, [0, 0, 1, 1, 2, 2])  # latest = 2; jobs 0..5
    a = sampler(s, "late")
    s.lease(a, 1, 2, now=0, lease_seconds=100)  # job 6, leased when the trainer dies
    for step, ids in ((0, [0, 1]), (1, [2, 3])):
        s.pull(2, now=1, lease_seconds=10, version=step)
        s.ack(ids, step)
    s.pull(2, now=1, lease_seconds=10, version=2)  # pulled, never acked
    # The checkpoint was taken after step 1 (consumed 0, 1); it has v1's weights.
    with pytest.raises(ProtocolError, match="not consumed at this broker"):
        s.rewind(1, {0, 1, 9}, keep_version=1)
    reply = s.rewind(1, {0, 1}, keep_version=1)
    assert reply == {"returned": 4, "regenerated": 2, "leases_returned": 1, "latest_version": 1}
    assert s.latest_version() == 1
    assert s.counts()["rollouts"] == {"consumed": 2, "ready": 2}
    assert s.counts()["jobs"] == {"done": 4, "queued": 3}  # jobs 4, 5 (v2) and 6 again
    with pytest.raises(ProtocolError, match="behind the checkpoint"):
        s.rewind(5, {0, 1}, keep_version=5)
