import json

import pydantic
import pytest

from echorl.broker.store import Admission, BrokerStore, Probation
from echorl.broker.swarm import Quarantine
from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import (
    Forbidden,
    GroupAudit,
    NotFound,
    ProtocolError,
    SamplerInfo,
    ScoredGroup,
    TooMany,
    Unprocessable,
)
from echorl.tasks import get_task

TASK = get_task("add")
CODEC = RunTokenizer.builtin()
CLAIMS = 9.0  # what the sampler claims; the broker's rewards are what its verifier says


def push(s, sampler_id, g, rewards, now):
    """Push `g`, then give the broker's verdict `rewards` (the verifier pool's part): True if
    stored, False if already stored."""
    seed = s.push(sampler_id, g, now)
    if seed is None:
        return False
    assert s.scored([(g.job_id, now, list(rewards), None)])[:2] == (1, 0)
    return True


def store(path, **kw):
    kw = {"run_seed": 0, "vocab_size": 258} | kw
    return BrokerStore(path / "broker.sqlite", "add", TASK.problem, CODEC.encode, **kw)


def job_prompt(s, job_id):
    """The prompt ids the job was leased with ([1] for a job the store never made)."""
    row = s.db.execute("SELECT prompt_ids FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
    return json.loads(row[0]) if row else [1]


def group(s, job_id, version=0, g=2, ids=(20, 21, 1), prompt_ids=None):
    return ScoredGroup.model_validate(
        {
            "job_id": job_id,
            "version": version,
            "prompt_ids": job_prompt(s, job_id) if prompt_ids is None else prompt_ids,
            "completions": [
                {"token_ids": list(ids), "logprobs": [-0.5] * len(ids), "finished": True}
            ]
            * g,
            "rewards": [CLAIMS] * g,
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
    return s.register(SamplerInfo(name=name, tokenizer=CODEC.fingerprint, task="add"), now)


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
    assert push(s, a, group(s, 0), [1.0, 0.0], now=1) is True
    assert push(s, a, group(s, 0), [1.0, 0.0], now=2) is False
    assert s.counts()["rollouts"] == {"ready": 1}
    assert s.counts()["jobs"] == {"done": 1}


@pytest.mark.parametrize(
    "make,error,reason",
    [
        (
            lambda s, a, b: push(s, b, group(s, 0), [0, 0], 1),
            ProtocolError,
            "not leased to sampler",
        ),
        (lambda s, a, b: push(s, a, group(s, 7), [0, 0], 1), NotFound, "unknown job 7"),
        (
            lambda s, a, b: push(s, a, group(s, 0, version=1), [0, 0], 1),
            ProtocolError,
            "newer than the latest",
        ),
        (
            lambda s, a, b: push(s, a, group(s, 0, g=3), [0, 0, 0], 1),
            ProtocolError,
            "leased with G = 2",
        ),
        (
            lambda s, a, b: push(s, a, group(s, 0, ids=(20, 258)), [0, 0], 1),
            Unprocessable,
            "outside the vocabulary",
        ),
        (
            lambda s, a, b: push(s, a, group(s, 0, prompt_ids=job_prompt(s, 0) + [20]), [0, 0], 1),
            ProtocolError,
            "prompt_ids are not the job's prompt",
        ),
        (
            lambda s, a, b: push(s, a, group(s, 0, prompt_ids=job_prompt(s, 1)), [0, 0], 1),
            ProtocolError,
            "prompt_ids are not the job's prompt",
        ),
        (lambda s, a, b: s.ack([0], step=0), NotFound, "has no stored group"),
        (lambda s, a, b: s.set_latest_version(2), ProtocolError, "not the next one"),
        (lambda s, a, b: s.heartbeat("nobody", 1), NotFound, "unknown sampler"),
        (lambda s, a, b: s.leave("nobody"), NotFound, "unknown sampler"),
    ],
)
def test_refused_requests_change_nothing(s, make, error, reason):
    a, b = sampler(s, "a"), sampler(s, "b")
    s.set_latest_version(0)
    s.lease(a, 2, 2, now=0, lease_seconds=10)
    assert job_prompt(s, 0) != job_prompt(s, 1)
    before = dump(s)
    with pytest.raises(error, match=reason) as caught:
        make(s, a, b)
    assert type(caught.value) is error
    assert dump(s) == before


def test_jobs_carry_the_prompt_encoded_once_by_the_broker(s):
    a = sampler(s)
    jobs = s.lease(a, 3, 2, now=0, lease_seconds=10)
    for j in jobs:
        assert j.prompt_ids == CODEC.encode(j.prompt) == job_prompt(s, j.job_id)
        assert CODEC.decode(j.prompt_ids) == TASK.problem(j.seed).prompt
    problem, ids = s.first_job()
    assert (problem.prompt, ids) == (jobs[0].prompt, jobs[0].prompt_ids)
    s.leave(a)  # a returned job is leased again with the ids it was made with
    again = s.lease(sampler(s, "b"), 1, 2, now=1, lease_seconds=10)
    assert again[0].prompt_ids == jobs[0].prompt_ids


def test_first_job_refuses_a_prompt_the_vocabulary_cannot_hold(tmp_path):
    s = store(tmp_path)
    _, ids = s.first_job()
    s.close()
    top = max(ids)
    s = store(tmp_path, vocab_size=top + 1)  # just holds it
    assert s.first_job()[1] == ids
    s.close()
    s = store(tmp_path, vocab_size=top)
    with pytest.raises(ValueError, match=f"encodes to id {top} >= vocab size {top}"):
        s.first_job()
    s.close()
    empty = BrokerStore(tmp_path / "e.sqlite", "add", TASK.problem, lambda text: [])
    with pytest.raises(ValueError, match="encodes to no tokens"):
        empty.first_job()
    empty.close()


def test_push_many_stores_each_group_or_says_why_not(s):
    a = sampler(s)
    s.set_latest_version(0)
    s.lease(a, 3, 2, now=0, lease_seconds=10)
    items = [
        group(s, 0),
        group(s, 1, prompt_ids=job_prompt(s, 2)),
        group(s, 2),
        group(s, 0),  # already stored, by the first item
    ]
    results = s.push_many(a, items, now=1)
    seeds = [j[0] for j in s.db.execute("SELECT seed FROM jobs ORDER BY job_id")]
    assert results[0] == seeds[0] and results[2] == seeds[2] and results[3] is None
    assert "prompt_ids are not the job's prompt" in results[1]
    assert s.counts()["rollouts"] == {"scoring": 2}
    assert s.counts()["jobs"] == {"done": 2, "leased": 1}
    # the verdicts: one scored, one refused (its job is queued again, an attempt counted)
    assert s.scored([(0, 1, [1.0, 0.0], None), (2, 1, None, None), (2, 1, [1.0, 1.0], None)]) == (
        1,
        1,
        1,
    )
    assert s.counts()["rollouts"] == {"ready": 1}
    assert s.counts()["jobs"] == {"done": 1, "leased": 1, "queued": 1}
    assert s.scoring() == []


def test_a_verdict_for_a_group_that_is_gone_changes_nothing(s):
    a = sampler(s)
    s.set_latest_version(0)
    s.lease(a, 1, 2, now=0, lease_seconds=10)
    s.push(a, group(s, 0), now=5)
    ((job, created, _, stored),) = s.scoring()
    assert (job, created, stored.rewards) == (0, 5, [CLAIMS, CLAIMS])
    assert s.scored([(0, 4, [1.0, 1.0], None)]) == (0, 0, 0)  # an older push's verdict
    assert s.scored([(0, 5, [1.0, 0.0], None)]) == (1, 0, 1)  # its sampler's first
    (pulled,), _ = s.pull(1, now=6, lease_seconds=10, min_version=0)
    assert pulled.rewards == [1.0, 0.0]  # the broker's, never the claims


def test_sync_jobs_need_the_required_version(s):
    a = sampler(s)
    s.set_latest_version(0)
    s.set_latest_version(1)
    s.lease(a, 1, 2, now=0, lease_seconds=10, required_version=1)
    with pytest.raises(ProtocolError, match="requires version 1"):
        push(s, a, group(s, 0, version=0), [0, 0], 1)
    assert push(s, a, group(s, 0, version=1), [0, 0], 1)


def fill(s, versions):
    a = sampler(s)
    for v in range(0, max(versions) + 1):
        s.set_latest_version(v)
    jobs = s.lease(a, len(versions), 2, now=0, lease_seconds=10)
    for j, v in zip(jobs, versions):
        push(s, a, group(s, j.job_id, version=v), [1.0, 0.0], now=1)


def test_sync_pull_takes_exactly_one_version(s):
    fill(s, [1, 2, 2, 1])
    groups, dropped = s.pull(10, now=2, lease_seconds=10, version=2)
    assert sorted(g.job_id for g in groups) == [1, 2]
    assert dropped == 2  # version 1 can never be consumed once the trainer is at step 2
    # Pulled groups carry the broker's rewards, never the sampler's claims (CLAIMS each).
    assert all(g.version == 2 and g.rewards == [1.0, 0.0] for g in groups)
    assert all(
        isinstance(g, ScoredGroup) and g.prompt_ids == job_prompt(s, g.job_id) for g in groups
    )


def test_async_pull_drops_too_stale_groups_and_takes_the_freshest(s):
    fill(s, [0, 1, 3, 3, 4])
    groups, dropped = s.pull(2, now=2, lease_seconds=10, min_version=2)
    assert [g.version for g in groups] == [4, 3]
    assert dropped == 2
    assert s.counts()["rollouts"] == {"pulled": 2, "ready": 1, "stale": 2}


def test_async_pull_takes_groups_at_the_bound_before_fresher_ones(s):
    """A group of version step - max_staleness is usable now and never again: it goes first,
    so that nothing admitted is generated for nothing."""
    fill(s, [2, 4, 3, 2, 4])
    groups, _ = s.pull(3, now=2, lease_seconds=10, min_version=2)
    assert [g.version for g in groups] == [2, 2, 4]
    groups, dropped = s.pull(2, now=2, lease_seconds=10, min_version=3)
    assert [g.version for g in groups] == [3, 4] and dropped == 0


def test_pulled_groups_come_back_if_not_acked_and_are_consumed_once(s):
    fill(s, [0, 0, 0])
    first, _ = s.pull(3, now=2, lease_seconds=10, version=0)
    assert s.pull(3, now=3, lease_seconds=10, version=0)[0] == []  # leased to the trainer
    s.expire(now=20, sampler_timeout=1e9)  # the trainer died before acking
    again, _ = s.pull(3, now=20, lease_seconds=10, version=0)
    assert [g.job_id for g in again] == [g.job_id for g in first]
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
        push(s, a, group(s, j.job_id), [1.0, 0.0], now=1)
    pulled, _ = s.pull(2, now=2, lease_seconds=10, min_version=0)
    s.ack([g.job_id for g in pulled], step=0)
    s.ack([g.job_id for g in pulled], step=0)  # a retried ack counts nothing twice
    assert consumed_counter(s) == 2
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


def test_sync_overprovision_leases_spare_jobs_and_the_next_version_cancels_the_rest(s):
    """Straggler-tolerant sync: B + spare jobs of a version are out at once; the trainer
    takes the first B groups; publishing the next version queues the jobs still leased for
    the old one (no attempt, no penalty) and drops its unpulled groups as wasted."""
    fast, slow = sampler(s, "fast"), sampler(s, "slow")
    admit = Admission(batch=2, max_staleness=0, pin_version=True, spare=2)
    s.set_latest_version(0)
    mine = s.lease(fast, 3, 2, now=0, lease_seconds=10, admit=admit)
    theirs = s.lease(slow, 3, 2, now=0, lease_seconds=10, admit=admit)
    assert [len(mine), len(theirs)] == [3, 1]  # B + spare = 4, all pinned to v0
    for j in mine:
        push(s, fast, group(s, j.job_id, ids=(20, 21, 22, 1)), [1.0, 0.0], now=1)
    pulled, _ = s.pull(2, now=2, lease_seconds=10, version=0)
    assert s.ack([g.job_id for g in pulled], step=0) == 2
    assert s.set_latest_version(1, cancel_older=True) == (1, 1)  # slow's job; fast's third
    assert s.wasted() == {"cancelled_jobs": 1, "wasted_groups": 1, "wasted_tokens": 8}
    assert s.wasted_tokens == 8 and s.counts()["wasted"]["wasted_groups"] == 1
    with pytest.raises(ProtocolError, match="not leased"):  # the straggler's late group
        push(s, slow, group(s, theirs[0].job_id), [0, 0], now=3)
    row = s.db.execute(
        "SELECT state, attempts, lease_owner FROM jobs WHERE job_id = ?", (theirs[0].job_id,)
    ).fetchone()
    assert row == ("queued", 0, None)
    again = s.lease(slow, 4, 2, now=3, lease_seconds=10, admit=admit)
    assert again[0].job_id == theirs[0].job_id  # queued first: the problem is not lost
    assert {j.required_version for j in again} == {1} and len(again) == 4  # not barred
    assert s.set_latest_version(2) == (0, 0)  # async: nothing is cancelled


@pytest.mark.parametrize(
    "n, speed, fastest, share",
    [
        (8, 100.0, 100.0, 8),
        (8, 60.0, 100.0, 8),
        (8, 25.0, 100.0, 2),
        (8, 1.0, 100.0, 1),
        (8, None, 100.0, 8),
        (8, 50.0, None, 8),
    ],
)
def test_a_slow_sampler_leases_its_share_of_what_it_asks(n, speed, fastest, share):
    from echorl.broker.store import fair_share

    assert fair_share(n, speed, fastest) == share


@pytest.mark.parametrize(
    "spans, speed",
    [
        ([(0.0, 2.0, 100)], 50.0),
        ([(0.0, 2.0, 100), (0.0, 2.0, 100)], 100.0),  # one lease of two jobs: its time once
        ([(0.0, 2.0, 100), (1.0, 3.0, 100)], 200 / 3),  # overlapping leases (pipelined)
        ([(0.0, 1.0, 100), (5.0, 6.0, 100)], 100.0),  # idle between leases is not counted
        ([(0.0, 0.0, 100)], None),  # too short to time
        ([], None),
    ],
)
def test_a_samplers_speed_is_its_tokens_over_its_busy_time(spans, speed):
    from echorl.broker.store import delivered_speed

    assert delivered_speed(spans) == (None if speed is None else pytest.approx(speed))


def test_leases_by_speed_follow_the_measured_tokens_per_second(s):
    """The broker times each sampler's groups itself: 6 tokens 0.01 s after the lease is
    600 tokens/s, after 0.04 s 150 (a quarter of the fastest: a quarter of the ask)."""
    s.set_latest_version(0)
    fast, slow = sampler(s, "fast"), sampler(s, "slow")
    for who, took in ((fast, 0.01), (slow, 0.04)):
        (job,) = s.lease(who, 1, 2, now=0, lease_seconds=10)
        push(s, who, group(s, job.job_id), [1.0, 0.0], now=took)
    speeds = dict(s.db.execute("SELECT name, tokens_per_s FROM samplers"))
    assert speeds == {"fast": pytest.approx(600.0), "slow": pytest.approx(150.0)}
    assert len(s.lease(fast, 8, 2, now=0, lease_seconds=10, by_speed=True)) == 8
    assert len(s.lease(slow, 8, 2, now=0, lease_seconds=10, by_speed=True)) == 2
    assert len(s.lease(slow, 8, 2, now=0, lease_seconds=10)) == 8  # off: as asked
    # Against a given yardstick (activation's fastest working sampler): 150 of 300, all 8.
    assert len(s.lease(slow, 8, 2, now=0, lease_seconds=10, by_speed=True, fastest=300.0)) == 8


def test_a_samplers_speed_leaves_out_leases_that_began_with_a_download(s):
    """A lease whose group was generated on another version than the sampler's last
    delivered group timed that version's download too: once the sampler has STEADY_GROUPS
    groups made on the version it last delivered, its speed is theirs alone (before, a
    sampler that fetched each version for a few jobs looked several times slower than it
    generates). The version it tells it holds does not count: told, it could pick which of
    its leases time it."""
    from echorl.broker.store import STEADY_GROUPS

    s.set_latest_version(0)
    a = sampler(s, "a")
    s.heartbeat(a, 0.0, version_held=0)
    t = 0.0
    for k in range(STEADY_GROUPS + 2):  # its first group follows none: not steady either
        if k == STEADY_GROUPS // 2:  # a new version: this lease downloads it (1 s) first
            s.set_latest_version(1)
            (job,) = s.lease(a, 1, 2, now=t, lease_seconds=10)
            push(s, a, group(s, job.job_id, version=1), [1.0, 0.0], now=t + 1.01)
            s.heartbeat(a, t + 1.01, version_held=1)
            t += 2
            assert speed_of(s, "a") < 300  # too few steady groups yet: every group counts
            continue
        held = s.latest_version()
        (job,) = s.lease(a, 1, 2, now=t, lease_seconds=10)
        push(s, a, group(s, job.job_id, version=held), [1.0, 0.0], now=t + 0.01)
        t += 2
    assert speed_of(s, "a") == pytest.approx(600.0)


def speed_of(s, name):
    return dict(s.db.execute("SELECT name, tokens_per_s FROM samplers"))[name]


def test_a_retried_pull_gets_the_same_groups(s):
    fill(s, [0, 0, 0, 0])
    first, _ = s.pull(2, now=2, lease_seconds=10, version=0, request_id="r1")
    again, _ = s.pull(2, now=3, lease_seconds=10, version=0, request_id="r1")
    assert [g.job_id for g in again] == [g.job_id for g in first] == [0, 1]
    other, _ = s.pull(2, now=3, lease_seconds=10, version=0, request_id="r2")
    assert [g.job_id for g in other] == [2, 3]


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
    assert consumed_counter(s) == 2  # what admission counts, without a scan
    # Each sampler's account forgets the consumption the rewind undid.
    accounts = {r["id"]: (r["consumed"], r["consumed_tokens"]) for r in s.samplers()}
    rows = s.db.execute(
        "SELECT sampler_id, COUNT(*), SUM(tokens) FROM rollouts WHERE state = 'consumed' "
        "GROUP BY sampler_id"
    ).fetchall()
    assert {sid: accounts[sid] for sid, _, _ in rows} == {sid: (n, t) for sid, n, t in rows}
    assert sum(n for n, _ in accounts.values()) == 2
    with pytest.raises(ProtocolError, match="behind the checkpoint"):
        s.rewind(5, {0, 1}, keep_version=5)


def consumed_counter(s):
    counted = s.db.execute("SELECT value FROM meta WHERE key = 'consumed'").fetchone()[0]
    scanned = s.db.execute("SELECT COUNT(*) FROM rollouts WHERE state = 'consumed'").fetchone()
    assert counted == scanned[0]
    return counted


def test_a_job_whose_problem_cannot_be_made_is_parked_and_the_lease_goes_on(tmp_path):
    """A user task that raises for some seeds (or a prompt the vocabulary cannot hold) parks
    that job with the reason; it never wedges the cursor (every lease would fail on it)."""

    def problem(seed):
        if seed % 3 == 0:
            raise RuntimeError("row missing")
        return TASK.problem(seed)

    st = BrokerStore(tmp_path / "b.sqlite", "add", problem, CODEC.encode, vocab_size=258)
    st.set_latest_version(0)
    me = sampler(st)
    jobs = st.lease(me, 12, 2, now=0.0, lease_seconds=10)
    parked = st.db.execute("SELECT job_id, prompt FROM jobs WHERE state = 'parked'").fetchall()
    assert parked and all("row missing" in prompt for _, prompt in parked)
    assert len(jobs) + len(parked) == 12  # the cursor moved past both
    assert all(j.prompt_ids for j in jobs)
    assert st.lease(me, 4, 2, now=0.0, lease_seconds=10)  # and the next lease works
    st.close()


def test_a_data_dir_serves_one_run(tmp_path):
    """The run's identity is recorded at first start; another tokenizer, task or prompt format
    on the same data dir is refused, naming what differs."""
    identity = {"task": "add", "tokenizer": CODEC.fingerprint, "prompts": "plain"}
    st = store(tmp_path)
    st.check_run(identity)
    st.check_run(identity)  # the same run again (a restart, a resume)
    with pytest.raises(ValueError, match="belongs to a run with prompts 'plain', not 'chat'"):
        st.check_run(identity | {"prompts": "chat"})
    with pytest.raises(ValueError, match="tokenizer"):
        st.check_run(identity | {"tokenizer": "0" * 64})
    st.close()


def test_registration_is_capped_and_revoked_or_departed_credentials_are_forgotten(s):
    info = SamplerInfo(name="x", tokenizer=CODEC.fingerprint, task="add")
    a = s.register(info, 0.0, secret="ha", max_alive=2)
    b = s.register(info, 0.0, secret="hb", max_alive=2)
    with pytest.raises(TooMany, match="2 samplers"):
        s.register(info, 0.0, secret="hc", max_alive=2)
    assert s.secrets() == {"ha": a, "hb": b}
    s.set_latest_version(0)
    s.lease(a, 2, 2, now=0, lease_seconds=10)
    assert s.revoke(a) == 2  # its leases go back at once
    s.leave(b)
    assert s.secrets() == {}
    assert s.counts()["jobs"] == {"queued": 2}
    with pytest.raises(ProtocolError, match="has revoked"):
        s.heartbeat(a, 1.0)
    s.leave(a)  # leaving after a revocation changes nothing: revoked stays revoked
    assert dict(s.db.execute("SELECT id, state FROM samplers")) == {a: "revoked", b: "left"}
    assert s.register(info, 0.0, secret="hc", max_alive=2)  # room again


def test_one_sampler_holds_at_most_max_held_and_an_expired_one_waits_a_lease_period(s):
    a, b = sampler(s, "a"), sampler(s, "b")
    s.set_latest_version(0)
    assert len(s.lease(a, 100, 2, now=0, lease_seconds=10, max_held=3)) == 3
    assert s.lease(a, 100, 2, now=1, lease_seconds=10, max_held=3) == []
    s.expire(now=11, sampler_timeout=1e9, bar_s=10)  # a never pushed: its leases run out
    assert s.lease(a, 1, 2, now=12, lease_seconds=10, max_held=3) == []  # barred until 21
    assert [j.job_id for j in s.lease(b, 3, 2, now=12, lease_seconds=10, max_held=3)] == [0, 1, 2]
    assert len(s.lease(a, 1, 2, now=22, lease_seconds=10, max_held=3)) == 1


POLICY = Quarantine(min_tokens=20, max_mean_abs=0.5, max_kl=0.05, max_beyond=0.1, decay=0.9)


def audit(job_id, tokens, abs_per_token, kl_per_token=0.0, beyond=0):
    return GroupAudit(
        job_id=job_id,
        tokens=tokens,
        abs_delta=abs_per_token * tokens,
        kl=kl_per_token * tokens,
        beyond=beyond,
    )


@pytest.mark.parametrize(
    ("figures", "why"),
    [
        ((1.5, -1.2, 0), "lower than the trainer's"),
        ((0.08, 0.07, 0), "0.070 per token higher"),
        ((0.3, 0.0, 3), "far from the trainer's"),
        ((0.9, 0.0, 0), "differ from the trainer's by 0.900"),
    ],
)
def test_the_audit_quarantines_a_sampler_far_off_and_drops_its_groups(s, figures, why):
    honest, liar = sampler(s, "honest"), sampler(s, "liar")
    s.set_latest_version(0)
    mine = s.lease(honest, 2, 2, now=0, lease_seconds=100)
    theirs = s.lease(liar, 4, 2, now=0, lease_seconds=100)
    for sid, jobs in ((honest, mine), (liar, theirs[:2])):
        for j in jobs:
            push(s, sid, group(s, j.job_id), [1.0, 0.0], now=1)
    trained, _ = s.pull(4, now=1, lease_seconds=100, min_version=0)
    s.ack([g.job_id for g in trained], step=0)  # what the trainer audits
    push(s, liar, group(s, theirs[2].job_id), [1.0, 0.0], now=1)  # ready, not yet trained
    abs_, kl, beyond = figures
    first = [audit(mine[0].job_id, 10, 0.02), audit(theirs[0].job_id, 10, abs_, kl, beyond)]
    assert s.audit(first, POLICY, step=0) == []  # 10 audited tokens each: below min_tokens
    second = [audit(mine[1].job_id, 10, 0.02), audit(theirs[1].job_id, 10, abs_, kl, beyond)]
    ((sid, reason),) = s.audit(second, POLICY, step=0)
    assert sid == liar and why in reason
    states = dict(s.db.execute("SELECT id, state FROM samplers"))
    assert states == {honest: "alive", liar: "quarantined"}
    # its unconsumed group and its lease go back to the queue; what was audited stays
    left = {r[0] for r in s.db.execute("SELECT job_id FROM rollouts WHERE sampler_id = ?", (liar,))}
    assert left == {theirs[0].job_id, theirs[1].job_id}
    queued = {r[0] for r in s.db.execute("SELECT job_id FROM jobs WHERE state = 'queued'")}
    assert queued == {theirs[2].job_id, theirs[3].job_id}
    with pytest.raises(Forbidden, match="is quarantined: .*log-probs"):
        s.lease(liar, 1, 2, now=2, lease_seconds=100)
    with pytest.raises(Forbidden, match="quarantined"):
        s.heartbeat(liar, 2.0)
    listed = {r["id"]: r for r in s.samplers()}
    assert listed[liar]["reason"] == reason and listed[liar]["audited_tokens"] == 20
    assert listed[honest]["logprob_mean_abs"] == pytest.approx(0.02)


def test_older_groups_are_judged_against_honest_peers_of_their_version(s):
    """The trainer has moved on since version 0: every honest group of it is off by as much
    (0.2 per token here), which is no evidence against anyone; one off by more is."""
    ids = [sampler(s, name) for name in ("a", "b", "c", "d")]
    s.set_latest_version(0)
    jobs = {sid: s.lease(sid, 2, 2, now=0, lease_seconds=100) for sid in ids}
    for sid, leased in jobs.items():
        for j in leased:
            push(s, sid, group(s, j.job_id), [1.0, 0.0], now=1)
    report = [
        audit(j.job_id, 40, 0.2 if sid != ids[3] else 1.5, 0.1 if sid != ids[3] else 1.3)
        for sid, leased in jobs.items()
        for j in leased
    ]
    quarantined = s.audit(report, POLICY, step=3)  # version 0, trained at step 3
    assert [sid for sid, _ in quarantined] == [ids[3]]
    assert dict(s.db.execute("SELECT name, state FROM samplers"))["a"] == "alive"
    # Fewer than three groups of an older version: no evidence either way.
    more = s.lease(ids[0], 2, 2, now=2, lease_seconds=100)
    for j in more:
        push(s, ids[0], group(s, j.job_id), [1.0, 0.0], now=2)
    assert s.audit([audit(j.job_id, 40, 1.5, 1.3) for j in more], POLICY, step=3) == []
    assert dict(s.db.execute("SELECT name, state FROM samplers"))["a"] == "alive"


def honest_among_liars(s, names, version):
    """One honest sampler and three liars with the same lie, two groups each of `version`;
    their audits, as if scored under newer weights."""
    ids = [sampler(s, name) for name in names]
    s.set_latest_version(version)
    jobs = {sid: s.lease(sid, 2, 2, now=version, lease_seconds=100) for sid in ids}
    for sid, leased in jobs.items():
        for j in leased:
            push(s, sid, group(s, j.job_id), [1.0, 0.0], now=version + 1)
    honest = ids[0]
    report = [
        audit(j.job_id, 40, 0.01 if sid == honest else 0.8, 0.0 if sid == honest else -0.7)
        for sid, leased in jobs.items()
        for j in leased
    ]
    return ids, report


def test_exact_audits_of_older_groups_are_judged_against_zero_not_a_liar_majority(s):
    """Three liars with the same lie are most of a version's groups: scored under newer
    weights (inexact), their median is every group's baseline and the honest one looks off;
    scored under the version's own weights (exact), each is judged against 0."""
    ids, report = honest_among_liars(s, ("honest", "l1", "l2", "l3"), version=0)
    inexact = s.audit(report, POLICY, step=3)  # the broker cannot tell: the majority wins
    assert ids[0] in [sid for sid, _ in inexact]
    ids, report = honest_among_liars(s, ("honest2", "m1", "m2", "m3"), version=1)
    exact = s.audit([a.model_copy(update={"exact": True}) for a in report], POLICY, step=4)
    assert sorted(sid for sid, _ in exact) == sorted(ids[1:])
    assert dict(s.db.execute("SELECT name, state FROM samplers"))["honest2"] == "alive"


def audited_tokens(s):
    return dict(s.db.execute("SELECT name, audit_total FROM samplers"))


def test_auditors_lease_consumed_groups_the_trainer_left_one_final_version_at_a_time(s):
    """Ack opens a consumed group for the auditors unless the trainer's report (sent before
    the ack) audited it; a version is leased once its groups can no longer be consumed,
    oldest first; a report counts each group once; a version whose weights are gone is
    missed, never leased."""
    fill(s, [0, 0, 1, 1, 2, 2])
    trained, _ = s.pull(6, now=2, lease_seconds=10, min_version=0)
    s.audit([audit(0, 10, 0.01)], POLICY, step=2)  # the trainer's own pass covered job 0
    s.ack([g.job_id for g in trained], step=2)
    assert s.counts()["audits"] == {"done": 1, "open": 5}
    stored = {0, 1, 2}
    # final_below = latest - max_staleness: version 2 may still be consumed, so it waits
    v, groups = s.lease_audits(10, now=3, lease_seconds=10, final_below=2, stored=stored)
    assert v == 0 and [json.loads(g)["job_id"] for g in groups] == [1]
    assert json.loads(groups[0])["rewards"] == [1.0, 0.0]  # as served: the broker's rewards
    v, groups = s.lease_audits(1, now=3, lease_seconds=10, final_below=2, stored=stored)
    assert v == 1 and len(groups) == 1  # at most n
    assert s.referenced_versions() == {0, 1}  # leased: their weights stay downloadable
    v, groups = s.lease_audits(10, now=4, lease_seconds=10, final_below=2, stored=stored)
    assert v == 1 and len(groups) == 1
    assert s.lease_audits(10, now=5, lease_seconds=10, final_below=2, stored=stored) == (None, [])
    # an auditor that died: its lease runs out and the groups are leased again
    v, groups = s.lease_audits(10, now=14, lease_seconds=10, final_below=2, stored=stored)
    assert v == 0 and [json.loads(g)["job_id"] for g in groups] == [1]
    exact = [audit(1, 30, 0.02).model_copy(update={"exact": True})]
    before = audited_tokens(s)["s1"]
    s.audit(exact, POLICY, step=3)
    s.audit(exact, POLICY, step=3)  # sent again (its answer was lost): counted once
    assert audited_tokens(s)["s1"] == before + 30
    assert s.counts()["audits"] == {"done": 2, "leased": 2, "open": 2}
    # version 1's weights are gone before its expired leases are taken again: missed; and
    # version 2 is final once version 2 + max_staleness + 1 is out
    v, groups = s.lease_audits(10, now=30, lease_seconds=10, final_below=3, stored={2})
    assert v == 2 and [json.loads(g)["job_id"] for g in groups] == [4, 5]
    assert s.counts()["audits"] == {"done": 2, "leased": 2, "missed": 2}


def test_left_and_lost_samplers_are_forgotten_after_the_retention(s):
    left, lost, bad, alive = (sampler(s, n, now=0.0) for n in ("left", "lost", "bad", "alive"))
    s.leave(left)
    s.expire(now=100.0, sampler_timeout=50.0)  # all silent since 0: lost
    s.heartbeat(alive, now=100.0)
    s.revoke(bad)
    assert s.sampler_counts() == {"alive": 1, "left": 1, "lost": 1, "revoked": 1}
    assert s.prune(now=500.0, retention_s=600.0) == []
    assert sorted(s.prune(now=700.0, retention_s=600.0)) == sorted([left, lost])
    assert s.sampler_counts() == {"alive": 1, "revoked": 1}  # the revoked one stays on record
    assert [r["id"] for r in s.samplers(limit=1)] == [alive]  # alive first


def test_a_newcomer_holds_few_jobs_beyond_the_budget_and_more_once_it_delivers(s):
    admit = Admission(batch=4, max_staleness=0, pin_version=True)
    probation = Probation(first=1, newcomers=2)
    s.set_latest_version(0)
    a, b, c = (sampler(s, n) for n in "abc")

    def lease(who, n=100, now=0.0):
        return s.lease(who, n, 2, now, 10, admit=admit, probation=probation)

    (job,) = lease(a)
    assert lease(a) == []  # one job until it delivers
    assert len(lease(b)) == 1 and lease(c) == []  # newcomers hold 2 together
    push(s, a, group(s, job.job_id), [1.0, 0.0], now=1.0)  # delivered: extra no more
    got = lease(a)
    assert len(got) == 2  # first lease + 1 delivered, from the budget (4 - 1 ready)
    assert len(lease(c)) == 1  # a's delivered job freed a newcomer's place
    # An expired lease starts a's probation over (and bars it one lease period).
    s.expire(now=20.0, sampler_timeout=1e9, bar_s=10.0)
    assert lease(a, now=25.0) == [] and len(lease(a, now=31.0)) == 1


def test_only_an_audited_sampler_leases_from_the_budget_and_a_lapse_costs_half(s):
    """With the audit on, a delivered group is no proof (a junk group is a group): a sampler
    leases from the trainer's budget only once the trainer has audited `proven_tokens` of
    its tokens; until then its jobs are extra, beyond the budget. A lapse then bars it a
    lease period and halves what its leases grew by, and it stays proven (before: a
    newcomer again, competing with every sybil for the newcomers' few jobs)."""
    admit = Admission(batch=8, max_staleness=0, pin_version=True)
    probation = Probation(first=1, newcomers=2, proven_tokens=50)
    policy = Quarantine(min_tokens=50, max_mean_abs=0.5, max_kl=0.05, max_beyond=0.1, decay=1.0)
    clean = {"tokens": 30, "abs_delta": 0.0, "kl": 0.0, "beyond": 0.0}
    s.set_latest_version(0)
    a = sampler(s, "a")

    def lease(n=100, now=0.0):
        jobs = s.lease(a, n, 2, now, 10, admit=admit, probation=probation)
        ids = ",".join(str(j.job_id) for j in jobs) or "-1"
        extra = s._tx(
            lambda c: c.execute(f"SELECT SUM(extra) FROM jobs WHERE job_id IN ({ids})").fetchone()
        )[0]
        return [j.job_id for j in jobs], extra or 0

    def deliver(job_id, audited, now):
        push(s, a, group(s, job_id), [1.0, 0.0], now=now)
        if audited:
            s.audit([GroupAudit(job_id=job_id, **clean)], policy, step=0)

    (first,), extra = lease()
    assert extra == 1  # a newcomer's job: beyond the budget
    deliver(first, audited=True, now=1.0)  # delivered 1, 30 tokens audited of 50
    jobs, extra = lease()
    assert len(jobs) == 2 and extra == 2  # first + delivered, still the newcomers' (2 of 2)
    deliver(jobs[0], audited=True, now=2.0)  # 60 audited tokens: proven
    deliver(jobs[1], audited=False, now=2.0)
    jobs, extra = lease()
    assert len(jobs) == 4 and extra == 0  # first + delivered (3), from the budget
    s.expire(now=20.0, sampler_timeout=1e9, bar_s=10.0)  # one lapse: its 4 jobs ran out
    assert lease(now=25.0) == ([], 0)  # barred a lease period
    jobs, extra = lease(now=31.0)
    assert len(jobs) == 2 and extra == 0  # first + delivered // 2, still from the budget


def test_an_unproven_identitys_speed_shrinks_nobodys_lease(s):
    """With leases by speed, a fresh identity claiming 1e9 tokens/s made every honest
    sampler 'slower than half the fastest': a 16-job ask became 1. Speeds are now measured
    by the broker, and the fastest is taken among proven samplers only: an unproven
    identity that delivers a group at once shrinks no one's lease."""
    probation = Probation(first=1000, newcomers=1000, proven_tokens=10)
    policy = Quarantine(min_tokens=10, max_mean_abs=0.5, max_kl=0.05, max_beyond=0.1, decay=1.0)
    s.set_latest_version(0)
    a, liar = sampler(s, "a"), sampler(s, "liar")
    (job,) = s.lease(a, 1, 2, 0.0, 10)
    push(s, a, group(s, job.job_id), [1.0, 0.0], now=1.0)
    clean = {"tokens": 10, "abs_delta": 0.0, "kl": 0.0, "beyond": 0.0}
    s.audit([GroupAudit(job_id=job.job_id, **clean)], policy, step=0)  # a is proven
    (quick,) = s.lease(liar, 1, 2, 2.0, 10, probation=probation)
    push(s, liar, group(s, quick.job_id), [0.0, 0.0], now=2.0 + 1e-3)  # 6,000 tokens/s
    got = s.lease(a, 16, 2, 3.0, 10, probation=probation, by_speed=True)
    assert len(got) == 16


def test_an_operators_audit_adds_up_across_its_identities(s):
    """Two identities of one operator, each below min_tokens on its own: together over, the
    operator is quarantined with both, and registers no third."""
    s.add_operator("mallory", "f" * 64, now=0.0)
    info = SamplerInfo(name="m", tokenizer=CODEC.fingerprint, task="add")
    ids = [s.register(info, 0.0, operator="mallory") for _ in range(2)]
    honest = sampler(s, "honest")
    s.set_latest_version(0)
    policy = Quarantine(min_tokens=100, max_mean_abs=0.5, max_kl=0.05, max_beyond=0.1, decay=1.0)
    audits = []
    for who in (*ids, honest):
        (j,) = s.lease(who, 1, 2, 0, 10)
        push(s, who, group(s, j.job_id), [1.0, 0.0], now=1.0)
        bad = who != honest
        audits.append(
            GroupAudit(job_id=j.job_id, tokens=60, abs_delta=60.0 * bad, kl=60.0 * bad, beyond=0.0)
        )
    quarantined = dict(s.audit(audits, policy, step=0))  # 60 tokens each: none alone
    assert set(quarantined) == set(ids) and "operator mallory" in quarantined[ids[0]]
    with pytest.raises(Forbidden, match="operator mallory is quarantined"):
        s.register(info, 2.0, operator="mallory")
    assert dict(s.sampler_counts()) == {"quarantined": 2, "alive": 1}


def test_the_status_names_a_held_back_samplers_operator_and_what_it_lacks():
    from echorl.broker.standing import Standing

    standing = Standing(proven_tokens=128)
    standing.observe([("m1", "mallory", 1, 16.0), ("s1", "", 0, 0.0), ("a1", "alice", 9, 200.0)])
    assert standing.describe("m1", 16.0) == "newcomer of operator mallory: 16 of 128 tokens audited"
    assert standing.describe("s1", 0.0) == "newcomer: 0 of 128 tokens audited"  # shared token
    assert standing.describe("a1", 200.0) == "proven" and standing.trusted("a1")


def test_a_job_the_trainer_waits_for_never_goes_to_a_newcomer_when_it_comes_back(s):
    """A proven sampler's lease runs out: its jobs go back to the queue. Newcomers leased
    them first (queued before fresh), each then holding a job of the trainer's batch a whole
    lease period. Now a newcomer gets only extra jobs; the returned ones wait for a proven
    sampler."""
    probation = Probation(first=1000, newcomers=4, proven_tokens=10)
    policy = Quarantine(min_tokens=10, max_mean_abs=0.5, max_kl=0.05, max_beyond=0.1, decay=1.0)
    admit = Admission(batch=2, max_staleness=0, pin_version=True)
    s.set_latest_version(0)
    a = sampler(s, "a")
    (job,) = s.lease(a, 1, 2, 0.0, 10, admit=admit)
    push(s, a, group(s, job.job_id), [1.0, 0.0], now=1.0)
    clean = {"tokens": 10, "abs_delta": 0.0, "kl": 0.0, "beyond": 0.0}
    s.audit([GroupAudit(job_id=job.job_id, **clean)], policy, step=0)  # a is proven
    (held,) = s.lease(a, 1, 2, 2.0, 10, admit=admit, probation=probation)
    assert s.expire(now=13.0, sampler_timeout=100, bar_s=10) == (1, 0)  # a's lapse
    newcomer = sampler(s, "sybil", now=13.0)
    got = s.lease(newcomer, 4, 2, 13.0, 10, admit=admit, probation=probation)
    assert got and held.job_id not in [j.job_id for j in got]
    extra = "SELECT extra FROM jobs WHERE job_id = ?"
    assert all(s.db.execute(extra, (j.job_id,)).fetchone() == (1,) for j in got)
    (again,) = s.lease(a, 1, 2, 24.0, 10, admit=admit, probation=probation)  # bar over
    assert again.job_id == held.job_id


@pytest.mark.parametrize("pin", [True, False], ids=["sync", "async"])
def test_dynamic_sampling_sets_flat_groups_aside_and_refills_their_place(tmp_path, pin):
    """DAPO's dynamic sampling at the broker: a flat group (every reward equal) is set aside
    as scored, never served, and its place in the budget goes to a fresh prompt's job, until
    the version's `refill_flat` is spent; after that flat groups are served as any."""
    s = store(tmp_path, refill_flat=2)
    a = sampler(s, "a")
    admit = Admission(batch=2, max_staleness=0, pin_version=pin)
    s.set_latest_version(0)
    first = s.lease(a, 9, 2, now=0, lease_seconds=10, admit=admit)
    assert [j.job_id for j in first] == [0, 1]
    s.push(a, group(s, 0), now=1)
    s.push(a, group(s, 1), now=1)
    assert s.scored([(0, 1, [1.0, 0.0], None), (1, 1, [1.0, 1.0], None)]) == (1, 0, 1)
    assert s.flat_refilled == 1 and s.counts()["rollouts"] == {"ready": 1, "flat": 1}
    refill = s.lease(a, 9, 2, now=2, lease_seconds=10, admit=admit)
    assert [j.job_id for j in refill] == [2]  # a fresh prompt in the flat one's place
    s.push(a, group(s, 2), now=3)
    assert s.scored([(2, 3, [0.0, 0.0], None)])[:2] == (0, 0)  # flat again: the 2nd set aside
    (third,) = s.lease(a, 9, 2, now=4, lease_seconds=10, admit=admit)
    s.push(a, group(s, third.job_id), now=5)
    assert s.scored([(third.job_id, 5, [0.0, 0.0], None)])[:2] == (1, 0)  # the cap: served
    pulled, _ = s.pull(9, now=6, lease_seconds=10, version=0 if pin else None)
    assert sorted(g.job_id for g in pulled) == [0, third.job_id]
    assert s.lease(a, 9, 2, now=7, lease_seconds=10, admit=admit) == []  # B out: no more
    again = store(tmp_path, refill_flat=2)  # restarted: the count is kept
    assert again.flat_refilled == 2


def test_without_dynamic_sampling_flat_groups_are_served(s):
    a = sampler(s, "a")
    s.set_latest_version(0)
    (j,) = s.lease(a, 1, 2, now=0, lease_seconds=10)
    push(s, a, group(s, j.job_id), [1.0, 1.0], now=1)
    assert s.flat_refilled == 0 and s.counts()["rollouts"] == {"ready": 1}


def test_each_samplers_account_matches_the_broker_rows(tmp_path):
    """Pushed, consumed, stale, refused, flat, cancelled and lapsed, counted as they happen,
    agree with the rows they count."""
    s = store(tmp_path, refill_flat=1)
    a, b = sampler(s, "a"), sampler(s, "b")
    admit = Admission(batch=2, max_staleness=0, pin_version=True, spare=2)
    s.set_latest_version(0)
    mine = s.lease(a, 3, 2, now=0, lease_seconds=10, admit=admit)
    theirs = s.lease(b, 3, 2, now=0, lease_seconds=10, admit=admit)
    assert [len(mine), len(theirs)] == [3, 1]
    s.push(a, group(s, mine[0].job_id), now=1)
    s.push(a, group(s, mine[1].job_id), now=1)
    s.push(a, group(s, mine[2].job_id), now=1)
    s.scored([(mine[0].job_id, 1, [1.0, 0.0], None), (mine[1].job_id, 1, None, None)])
    s.scored([(mine[2].job_id, 1, [1.0, 1.0], None)])  # flat: set aside
    (refused,) = s.push_many(a, [group(s, theirs[0].job_id)], now=1)  # not a's job
    assert "not leased to sampler" in refused
    pulled, _ = s.pull(2, now=2, lease_seconds=10, version=0)
    s.ack([g.job_id for g in pulled], step=0)
    s.set_latest_version(1, cancel_older=True)  # b's job taken back
    (late,) = s.lease(a, 1, 2, now=3, lease_seconds=1, admit=admit)
    s.expire(now=10, sampler_timeout=60)  # a lets it lapse
    rows = {r["name"]: r for r in s.samplers()}
    consumed = s.db.execute("SELECT COUNT(*) FROM rollouts WHERE state = 'consumed'").fetchone()[0]
    assert (rows["a"]["pushed"], rows["a"]["consumed"], consumed) == (3, 1, 1)
    assert rows["a"]["refused"] == 2  # the verifier's refusal, and the push of b's job
    assert rows["a"]["flat"] == 1 and rows["a"]["lapsed"] == 1 and rows["a"]["leased"] == 0
    assert rows["a"]["pushed_tokens"] == 3 * 2 * 3 and rows["a"]["consumed_tokens"] == 2 * 3
    assert rows["b"]["cancelled"] == 1 and rows["b"]["pushed"] == 0
    assert late.job_id in [
        r[0] for r in s.db.execute("SELECT job_id FROM jobs WHERE state = 'queued'")
    ]


def test_a_priced_samplers_cost_per_consumed_token(s):
    """What a priced sampler cost while registered, and per million tokens consumed of it."""
    info = SamplerInfo(name="p", tokenizer=CODEC.fingerprint, task="add", cost_per_hour=2.0)
    priced, free = s.register(info, 0.0), sampler(s, "free")
    s.set_latest_version(0)
    (j,) = s.lease(priced, 1, 2, now=0, lease_seconds=100)
    push(s, priced, group(s, j.job_id), [1.0, 0.0], now=1)
    pulled, _ = s.pull(1, now=2, lease_seconds=10, version=0)
    s.ack([g.job_id for g in pulled], step=0)
    s.heartbeat(priced, 1800.0)
    rows = {r["name"]: r for r in s.samplers()}
    assert rows["p"]["spent"] == pytest.approx(1.0)  # half an hour at 2.0 an hour
    assert rows["p"]["cost_per_mtoken"] == pytest.approx(1.0 * 1e6 / (2 * 3))  # 2 x 3 tokens
    assert rows["free"]["spent"] is None and rows["free"]["cost_per_mtoken"] is None
    assert free


def test_a_silent_sampler_holding_a_lease_is_released_in_seconds(tmp_path):
    """`lease_silence_s`: a sampler that holds a lease and stops beating (killed) has its jobs
    back in the queue after that long, not its lease period; counted as a lapse, and it is
    shown lost at once (a beat makes it alive again). A silent sampler holding nothing is
    lost only at sampler_timeout."""
    s = store(tmp_path)
    a, b = sampler(s, "a", now=0), sampler(s, "b", now=0)
    sampler(s, "c", now=0)  # silent, holding nothing
    (job,) = s.lease(a, 1, 2, now=0, lease_seconds=120)
    s.heartbeat(b, 5.0)
    assert s.expire(now=5.0, sampler_timeout=60, bar_s=120, lease_silence_s=6) == (0, 0)
    assert s.expire(now=7.0, sampler_timeout=60, bar_s=120, lease_silence_s=6) == (1, 1)
    state = s.db.execute("SELECT state FROM jobs WHERE job_id = ?", (job.job_id,)).fetchone()
    assert state == ("queued",)
    rows = {r["name"]: r for r in s.samplers()}
    assert rows["a"]["state"] == "lost" and rows["a"]["lapsed"] == 1
    assert rows["c"]["state"] == "alive"  # silent too, but it holds nothing: lost at 60 s
    s.heartbeat(a, 7.5)
    assert {r["name"]: r["state"] for r in s.samplers()}["a"] == "alive"
    assert s.lease(b, 1, 2, now=7.0, lease_seconds=120)[0].job_id == job.job_id
    assert s.lost_by_name("b", 8.0) == 1  # its supervisor saw it die: released at once
    assert {r["name"]: r["state"] for r in s.samplers()}["b"] == "lost"


def test_the_trainers_token_logprobs_are_kept_for_the_last_groups_only_and_checked(s, monkeypatch):
    """An audit may carry the trainer's log-prob of each token of a group (the dashboard's
    drill-down): kept when there is one per token of each completion, refused with the
    lengths otherwise (422; nothing of the report applied); only the last TOKENS_KEPT kept."""
    from echorl.broker import swarm

    monkeypatch.setattr(swarm, "TOKENS_KEPT", 2)
    a = sampler(s, "a")
    s.set_latest_version(0)
    jobs = s.lease(a, 4, 2, now=0, lease_seconds=100)
    for j in jobs:
        push(s, a, group(s, j.job_id), [1.0, 0.0], now=1)
    short = audit(jobs[0].job_id, 6, 0.0).model_copy(update={"logprobs": [[-0.1, -0.2]] * 2})
    with pytest.raises(Unprocessable, match=r"\[2, 2\] tokens; the group's have \[3, 3\]"):
        s.audit([audit(jobs[1].job_id, 6, 0.0), short], POLICY, step=0)
    assert s.db.execute("SELECT COUNT(*) FROM audits").fetchone() == (0,)  # nothing applied
    rows = [[-0.5, -0.25, 0.0], [-1.0, -0.5, 0.0]]
    for j in jobs:
        s.audit([audit(j.job_id, 6, 0.0).model_copy(update={"logprobs": rows})], POLICY, step=0)
    kept = [r[0] for r in s.db.execute("SELECT job_id FROM trainer_logprobs ORDER BY job_id")]
    assert kept == [jobs[2].job_id, jobs[3].job_id]
    assert json.loads(s.group_detail(jobs[3].job_id)["trainer_logprobs"]) == rows
    assert s.group_detail(jobs[0].job_id)["trainer_logprobs"] is None
    assert [g["trainer_logprobs"] for g in s.recent_groups(a, 10)].count(True) == 2
    bad = audit(jobs[0].job_id, 6, 0.0).model_dump() | {"logprobs": [rows[0], [0.5, 0, 0]]}
    with pytest.raises(pydantic.ValidationError, match=r"logprobs\[1\]: log-probs must be"):
        GroupAudit.model_validate(bad)
