"""Trust and load at a real broker process: verifiers that never return, samplers that act as
others, hoard leases, flood registrations or send what no sampler generates, operators'
terminals fed escape sequences, and uploads that race or break off. Each is refused or
contained with a reason, and changes nothing it should not."""

import contextlib
import hashlib
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from echorl.models.tokenizer import RunTokenizer
from tests.integration.conftest import (
    IDENTITY,
    PROBATION,
    SAMPLER,
    TRAINER,
    as_,
    audited,
    free_port,
    group,
    lease,
    publish,
    query,
    register,
    start_broker,
    stop_broker,
    wait_until,
)

pytestmark = pytest.mark.integration

CODEC = RunTokenizer.builtin()
HOSTILE = f"{Path(__file__).parents[1] / 'fixtures' / 'hostile_task.py'}:Hostile"


def answer(job, *texts, sid):
    """A push body: the job's group with one completion per text."""
    comps = []
    for text in texts:
        ids = CODEC.encode(text)
        comps.append({"token_ids": ids, "logprobs": [-0.5] * len(ids), "finished": True})
    g = group(job) | {"completions": comps, "rewards": [1.0] * len(comps)}
    return {"sampler_id": sid, "group": g}


def test_a_verifier_that_never_returns_stalls_nothing(tmp_path):
    """Completions whose verifier sleeps forever or spins the CPU are scored 0 after the time
    limit in a worker process; meanwhile /healthz and another sampler's pushes answer at their
    normal latency, and the failures are counted per task and kind."""
    proc, url = start_broker(
        tmp_path / "b",
        free_port(),
        "-o",
        f"task.name={HOSTILE}",
        "-o",
        "verify.time_limit_s=2",
        "-o",
        "train.batch_prompts=4",
    )
    try:
        hostile = {"task": "hostile"}
        publish(url, 0, b"w")
        a, b = register(url, "a", **hostile), register(url, "b", **hostile)
        (job_a,) = lease(url, a).json()["jobs"]
        jobs_b = lease(url, b, 3).json()["jobs"]
        latencies, pushes = [], []
        r = httpx.post(
            f"{url}/v1/rollouts", json=answer(job_a, "sleep", "spin", sid=a), headers=as_(a)
        )
        assert r.status_code == 200 and r.json() == {"stored": True}
        t_end = time.monotonic() + 3.0
        while time.monotonic() < t_end:  # both verifier calls are stuck all this time
            t0 = time.perf_counter()
            assert httpx.get(f"{url}/healthz", timeout=5).status_code == 200
            latencies.append(time.perf_counter() - t0)
            if jobs_b:
                job = jobs_b.pop()
                a_, b_ = job["prompt"][:-1].split("+")
                t0 = time.perf_counter()
                body = answer(job, str(int(a_) + int(b_)), "x", sid=b)
                assert (
                    httpx.post(f"{url}/v1/rollouts", json=body, headers=as_(b)).status_code == 200
                )
                pushes.append(time.perf_counter() - t0)
            time.sleep(0.02)
        p99 = statistics.quantiles(latencies, n=100)[98]
        print(f"healthz p99 {p99 * 1000:.1f} ms over {len(latencies)}; pushes {pushes}")
        # Nothing waits for the stuck verifier (that would be its 2 s time limit): a bound well
        # under it, and over the odd scheduling hiccup of 2 cores, one spun by the verifier
        # (a CI run measured p99 0.11 s once, where 0.1 s was asked).
        assert p99 < 0.25 and max(pushes) < 0.5
        status = wait_until(
            lambda: (
                (s := httpx.get(f"{url}/v1/status", headers=as_(TRAINER)).json())["verifier"].get(
                    "timeout"
                )
                == 2
                and s
            ),
            timeout=60,
            what="both stuck calls given up",
        )
        assert status["verifier"]["timeout"] == 2
        pulled = httpx.post(
            f"{url}/v1/batches/pull",
            json={"n": 4, "step": 0, "wait_s": 5},
            headers=as_(TRAINER),
        ).json()["groups"]
        rewards = {g["job_id"]: g["rewards"] for g in pulled}
        assert rewards[job_a["job_id"]] == [0.0, 0.0]  # scored 0, never hung
        assert all(r == [1.0, 0.0] for j, r in rewards.items() if j != job_a["job_id"])
        metrics = httpx.get(f"{url}/metrics").text
        assert 'broker_verifier_failures_total{kind="timeout",task="hostile"} 2.0' in metrics
    finally:
        stop_broker(proc)


def hostile_broker(tmp_path, *overrides):
    """A broker of the hostile task, async, version 0 published. Returns (process, url)."""
    proc, url = start_broker(
        tmp_path / "b",
        free_port(),
        "-o",
        f"task.name={HOSTILE}",
        "-o",
        "broker.mode=async",
        *overrides,
    )
    publish(url, 0, b"w")
    return proc, url


def hostile_pile(tmp_path, *overrides):
    """A hostile-task broker (async, B = 8, G = 2, two verifier workers) whose verifier is
    stuck: sampler `h`, having delivered three right groups (proving the workers up, and
    earning the leases a newcomer's probation withholds), has pushed four groups of
    pathological answers ("spin", "sleep": eight calls that each hang for the time limit).
    Returns (process, url, another sampler, a job leased to it)."""
    proc, url = hostile_broker(tmp_path, "-o", "train.batch_prompts=8", *overrides)
    h, o = register(url, "h", task="hostile"), register(url, "o", task="hostile")
    for _ in range(3):
        (job,) = lease(url, h).json()["jobs"]
        push(url, right(job, h), h)
        assert pull_until(url, job["job_id"], 60) < 60
    pile = lease(url, h, 4).json()["jobs"]
    assert len(pile) == 4
    for job in pile:
        push(url, answer(job, "spin", "sleep", sid=h), h)
    (job,) = lease(url, o).json()["jobs"]
    time.sleep(0.5)  # both workers on the pile's first groups, the rest queued
    return proc, url, o, job


def right(job, sid):
    """A push body whose first answer is right (the hostile task's problems are sums)."""
    a, b = job["prompt"][:-1].split("+")
    return answer(job, str(int(a) + int(b)), "x", sid=sid)


def push(url, body, sid):
    r = httpx.post(f"{url}/v1/rollouts", json=body, headers=as_(sid))
    assert r.status_code == 200 and r.json() == {"stored": True}, r.text


def pull_until(url, job_id, timeout):
    """Pull as the trainer until `job_id` comes; returns the seconds it took (or `timeout`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        body = {"n": 4, "step": 0, "wait_s": 1}
        groups = httpx.post(f"{url}/v1/batches/pull", json=body, headers=as_(TRAINER)).json()
        if any(g["job_id"] == job_id for g in groups["groups"]):
            break
    return time.monotonic() - t0


def test_an_honest_group_is_not_held_behind_another_samplers_stuck_ones(tmp_path):
    """Issue 24.3: B x G answers that hang the verifier (default time limit, 5 s each) in
    flight from one sampler hold another sampler's group back by one time limit at most: the
    pool serves its submitters in turn, one's stuck group never queues in front of another's,
    and a worker killed for its time is replaced by a spare at once. (It was 103 s.)"""
    proc, url, o, job = hostile_pile(tmp_path)
    try:
        push(url, right(job, o), o)
        took = pull_until(url, job["job_id"], 90)
        print(f"the honest group was pulled {took:.1f} s after its push")
        assert took < 10
    finally:
        stop_broker(proc)


def test_sixteen_sybils_with_one_stuck_group_each_do_not_hold_a_proven_group_back(tmp_path):
    """Verifier turns were per identity: 16 fresh identities, one group each of answers
    that hang the verifier (5 s each), stood 16 turns in front of an honest group (40 s).
    Now a proven sampler's group (the trainer audited its tokens) is scored ahead of every
    unproven identity's, and all identities of the shared token share one turn: the honest
    group reaches the trainer's pull within 10 s."""
    took = proven_group_delay(tmp_path, 16)
    print(f"the proven sampler's group was pulled {took:.1f} s after its push")
    assert took < 10


def proven_group_delay(tmp_path, n_sybils) -> float:
    """Seconds from a proven sampler's push to the trainer's pull of its group, with
    `n_sybils` fresh identities' stuck groups (one each) pushed before it (also
    bench/trust.py's)."""
    proc, url = hostile_broker(
        tmp_path,
        *("-o", "train.batch_prompts=32"),
        *("-o", "quarantine.min_tokens=2"),
        *PROBATION,  # a swarm the operator does not trust wholesale (the default)
    )
    try:
        honest = register(url, "honest", task="hostile")
        (job,) = lease(url, honest).json()["jobs"]
        push(url, right(job, honest), honest)
        assert pull_until(url, job["job_id"], 60) < 60  # the workers are up
        audited(url, job["job_id"], 4)
        sybils = [register(url, f"sybil{k}", task="hostile") for k in range(n_sybils)]
        for sid in sybils:
            (stuck,) = lease(url, sid).json()["jobs"]
            push(url, answer(stuck, "spin", "sleep", sid=sid), sid)
        (job,) = lease(url, honest).json()["jobs"]
        time.sleep(0.5)  # both workers on sybils' groups, the rest queued
        push(url, right(job, honest), honest)
        return pull_until(url, job["job_id"], 90)
    finally:
        stop_broker(proc)


def test_sigterm_ends_a_broker_whose_verifier_calls_are_stuck(tmp_path):
    """Closing the pool kills its workers at once: it waits for no stuck call's time limit."""
    proc, url, _, _ = hostile_pile(tmp_path, "-o", "verify.time_limit_s=60")
    t0 = time.monotonic()
    proc.terminate()
    try:
        code = proc.wait(60)
    finally:
        proc.kill()
    took = time.monotonic() - t0
    out = proc.stdout.read()
    print(f"SIGTERM to exit: {took:.2f} s")
    assert code in (0, -15) and "Traceback" not in out, out
    assert took < 5


def test_a_verifier_that_raises_is_counted_and_its_error_shown(tmp_path):
    """A verifier's exception scores 0 and is counted as kind `error`, in the status and the
    metrics, with the first one's last line in the status and its traceback in the log, once."""
    proc, url = start_broker(tmp_path / "b", free_port(), "-o", f"task.name={HOSTILE}")
    try:
        publish(url, 0, b"w")
        sid = register(url, "s", task="hostile")
        (job,) = lease(url, sid).json()["jobs"]
        push(url, answer(job, "raise", "raise", sid=sid), sid)
        assert pull_until(url, job["job_id"], 60) < 60
        status = httpx.get(f"{url}/v1/status", headers=as_(TRAINER)).json()
        assert status["verifier"]["error"] == 2
        assert status["verifier_error"] == "ZeroDivisionError: division by zero"
        metrics = httpx.get(f"{url}/metrics").text
        assert 'broker_verifier_failures_total{kind="error",task="hostile"} 2.0' in metrics
    finally:
        proc.terminate()
        out = proc.communicate(timeout=10)[0]
    assert out.count("the verifier raised") == 1 and "return 1 / 0" in out, out


def test_a_sampler_can_act_only_as_itself_and_a_revoked_one_not_at_all(broker):
    url, data = broker
    publish(url, 0, b"w")
    a, b = register(url, "a"), register(url, "b")
    (job,) = lease(url, a).json()["jobs"]
    mine = answer(job, "1", "2", sid=a)
    as_b = as_(b)
    cases = [  # b's credential, acting as a
        httpx.post(f"{url}/v1/rollouts", json=mine, headers=as_b),
        httpx.post(
            f"{url}/v1/rollouts/batch",
            json={"sampler_id": a, "groups": [mine["group"]]},
            headers=as_b,
        ),
        httpx.post(f"{url}/v1/jobs/lease", json={"sampler_id": a, "n": 1}, headers=as_b),
        httpx.post(f"{url}/v1/samplers/{a}/heartbeat", json={}, headers=as_b),
        httpx.post(f"{url}/v1/samplers/{a}/leave", headers=as_b),
        httpx.post(f"{url}/v1/samplers/{a}/revoke", headers=as_b),
        httpx.get(f"{url}/v1/status", headers=as_b),  # the admin's: it lists every id
        httpx.post(f"{url}/v1/samplers", json={"name": "c", **IDENTITY}, headers=as_b),
        httpx.post(f"{url}/v1/batches/pull", json={"n": 1, "step": 0}, headers=as_b),
        # the enrolment token registers and reads the run, nothing else
        httpx.post(f"{url}/v1/jobs/lease", json={"sampler_id": a, "n": 1}, headers=as_(SAMPLER)),
        httpx.get(f"{url}/v1/weights/latest", headers=as_(SAMPLER)),
    ]
    # Everything but when each was last seen and the refusals its account counts.
    columns = [c for (_, c, *_) in query(data, "PRAGMA table_info(samplers)")]
    samplers = (
        f"SELECT {', '.join(c for c in columns if c not in ('last_seen', 'refused'))} FROM samplers"
    )
    before = query(data, samplers), query(data, "SELECT * FROM jobs")
    for r in cases:
        assert r.status_code == 403, (r.request.method, r.request.url, r.text)
        assert r.json()["detail"]
    # b in its own name, for a's job: a conflict, not impersonation
    theirs = answer(job, "1", "2", sid=b)
    r = httpx.post(f"{url}/v1/rollouts", json=theirs, headers=as_b)
    assert r.status_code == 409 and "not leased to sampler" in r.text
    for headers in ({}, {"Authorization": "Bearer " + "z" * 43}):
        assert (
            httpx.post(f"{url}/v1/jobs/lease", json={"sampler_id": a}, headers=headers).status_code
            == 401
        )
    after = query(data, samplers), query(data, "SELECT * FROM jobs")
    assert after == before
    refused = dict(query(data, "SELECT id, refused FROM samplers"))
    assert refused == {a: 0, b: 1}  # b's conflict is in its account; impersonation in no one's

    # The admin revokes a from the command line: its lease goes back, its credential is dead.
    env = os.environ | {"ECHORL_TOKEN": TRAINER}
    cli = [sys.executable, "-m", "echorl.cli", "samplers", "revoke", a, "--broker", url]
    out = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "1 leased jobs returned" in out.stdout, out.stdout + out.stderr
    refused = lease(url, a)
    assert refused.status_code == 401 and "revoked" in refused.text
    assert httpx.post(f"{url}/v1/rollouts", json=mine, headers=as_(a)).status_code == 401
    states = dict(query(data, "SELECT id, state FROM samplers"))
    assert states == {a: "revoked", b: "alive"}
    assert query(data, "SELECT state FROM jobs WHERE job_id = ?", job["job_id"]) == [("queued",)]
    bad = subprocess.run(
        [*cli[:-3], "nobody", "--broker", url], env=env, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 1 and "unknown sampler" in bad.stdout


def test_sampler_text_reaches_the_operator_as_plain_text(broker):
    url, _ = broker
    evil = "\x1b[2J\x1b]8;;http://evil.example\x07click\x1b]8;;\x07\nrow2 [bold red]x[/]"
    sid = register(url, "s", hardware=evil)
    listed = httpx.get(f"{url}/v1/status", headers=as_(TRAINER)).json()["samplers"]
    hardware = next(s["hardware"] for s in listed if s["id"] == sid)
    assert "\x1b" not in hardware and "\n" not in hardware and "\x07" not in hardware
    assert "click" in hardware and "[bold red]" in hardware
    env = os.environ | {"ECHORL_TOKEN": TRAINER, "COLUMNS": "400", "TERM": "dumb"}
    out = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "status", "--broker", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout
    assert "[bold red]x[/]" in out.stdout  # shown as text, not rendered as markup
    assert long_name_refused(url)


def long_name_refused(url) -> bool:
    r = httpx.post(
        f"{url}/v1/samplers",
        json={"name": "a" * 65, **IDENTITY, "hardware": "x" * 201},
        headers=as_(SAMPLER),
    )
    return r.status_code == 422


def test_registration_floods_and_lease_hoarders_are_bounded(tmp_path):
    proc, url = start_broker(
        tmp_path / "b",
        free_port(),
        "-o",
        "broker.max_samplers=3",
        "-o",
        "broker.mode=async",
        "-o",
        "train.batch_prompts=4",
    )
    try:
        publish(url, 0, b"w")
        ids = [register(url, f"s{k}") for k in range(3)]
        flood = httpx.post(
            f"{url}/v1/samplers", json={"name": "s3", **IDENTITY}, headers=as_(SAMPLER)
        )
        assert flood.status_code == 429 and "max_samplers" in flood.text
        hoarder, honest = ids[0], ids[1]
        assert len(lease(url, hoarder, 1024).json()["jobs"]) == 4  # B, not the 8 admitted
        assert lease(url, hoarder, 1024).json()["jobs"] == []
        assert len(lease(url, honest, 1024).json()["jobs"]) == 4  # what is left for the others
        # A sampler that leaves frees its place.
        httpx.post(f"{url}/v1/samplers/{ids[2]}/leave", headers=as_(ids[2]))
        assert register(url, "s4")
    finally:
        stop_broker(proc)


def test_oversized_absurd_and_unauthenticated_bodies_are_refused(broker):
    url, data = broker
    publish(url, 0, b"w")
    sid = register(url, "s")
    (job,) = lease(url, sid).json()["jobs"]
    too_long = answer(job, "1" * 9, "2", sid=sid)  # add generates at most 8 tokens
    r = httpx.post(f"{url}/v1/rollouts", json=too_long, headers=as_(sid))
    assert r.status_code == 422 and "at most 8" in r.text
    batch = {"sampler_id": sid, "groups": [too_long["group"]]}
    (result,) = httpx.post(f"{url}/v1/rollouts/batch", json=batch, headers=as_(sid)).json()[
        "results"
    ]
    assert result["stored"] is False and "at most 8" in result["refused"]
    absurd = answer(job, "1", "2", sid=sid)
    absurd["group"]["completions"][0]["logprobs"] = [-1e30]
    r = httpx.post(f"{url}/v1/rollouts", json=absurd, headers=as_(sid))
    assert r.status_code == 422 and ">= -100" in r.text

    def chunked(n, size=1 << 16):  # no Content-Length: the limit is counted as bytes arrive
        for _ in range(n):
            yield b"x" * size

    # The test broker's max_body_bytes is 100 kB; 8 MB are sent in 64 kB chunks.
    r = httpx.post(f"{url}/v1/rollouts", content=chunked(128), headers=as_(sid))
    assert r.status_code == 413 and "exceeds the limit" in r.text
    r = httpx.post(f"{url}/v1/rollouts", content=chunked(128))
    assert r.status_code == 401
    assert query(data, "SELECT COUNT(*) FROM rollouts") == [(0,)]
    assert query(data, "SELECT state FROM jobs") == [("leased",)]


def test_concurrent_uploads_of_one_version_never_mix(broker):
    url, data = broker
    blobs = [bytes([k]) * (1 << 20) for k in (1, 2)]
    answers = [None, None]

    def upload(k):
        def slow():
            for i in range(0, len(blobs[k]), 1 << 16):
                time.sleep(0.01)
                yield blobs[k][i : i + (1 << 16)]

        headers = as_(TRAINER) | {"X-Sha256": hashlib.sha256(blobs[k]).hexdigest()}
        answers[k] = httpx.put(f"{url}/v1/weights/0", content=slow(), headers=headers, timeout=60)

    threads = [threading.Thread(target=upload, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(a.status_code for a in answers)
    assert codes == [200, 409], [a.text for a in answers]
    winner = blobs[[a.status_code for a in answers].index(200)]
    served = httpx.get(f"{url}/v1/weights/0", headers=as_(TRAINER))
    assert served.content == winner
    assert served.headers["x-sha256"] == hashlib.sha256(winner).hexdigest()
    assert not list((data / "weights").glob(".upload-*"))


def test_a_broker_killed_mid_upload_serves_no_partial_version(tmp_path):
    data = tmp_path / "b"
    proc, url = start_broker(data, free_port())
    blob = os.urandom(4 << 20)

    def slow():
        for i in range(0, len(blob), 1 << 16):
            time.sleep(0.005)
            yield blob[i : i + (1 << 16)]

    headers = as_(TRAINER) | {"X-Sha256": hashlib.sha256(blob).hexdigest()}
    t = threading.Thread(
        target=lambda: _ignore(
            lambda: httpx.put(f"{url}/v1/weights/0", content=slow(), headers=headers)
        )
    )
    t.start()
    wait_until(lambda: list((data / "weights").glob(".upload-*")), timeout=30, what="upload")
    proc.kill()
    proc.wait()
    t.join()
    proc, url = start_broker(data, free_port())
    try:
        assert httpx.get(f"{url}/v1/weights/latest", headers=as_(TRAINER)).status_code == 404
        assert not list((data / "weights").glob(".upload-*"))
        assert publish(url, 0, blob).status_code == 200  # the trainer publishes it again
        assert httpx.get(f"{url}/v1/weights/0", headers=as_(TRAINER)).content == blob
    finally:
        stop_broker(proc)


def _ignore(fn):
    with contextlib.suppress(httpx.HTTPError):  # the broker dies under it, on purpose
        fn()


def test_a_push_on_a_slow_link_holds_no_slot(tmp_path):
    """With one push slot, a sampler uploading its push slowly does not hold it: another
    sampler's push is stored meanwhile, and the slow one is stored once it has arrived."""
    proc, url = start_broker(tmp_path / "b", free_port(), "-o", "broker.push_slots=1")
    try:
        publish(url, 0, b"w")
        slow_id, quick_id = register(url, "slow"), register(url, "quick")
        (slow_job,) = lease(url, slow_id).json()["jobs"]
        (quick_job,) = lease(url, quick_id).json()["jobs"]
        body = httpx.Request("POST", "/", json=answer(slow_job, "1", "2", sid=slow_id)).content
        uploading = threading.Event()
        sent_all = threading.Event()
        replies = {}

        def trickle():  # the body in 8 pieces, 0.4 s apart
            for i in range(0, len(body), len(body) // 8 + 1):
                uploading.set()
                yield body[i : i + len(body) // 8 + 1]
                time.sleep(0.4)
            sent_all.set()

        def push_slowly():
            headers = as_(slow_id) | {"Content-Type": "application/json"}
            replies["slow"] = httpx.post(
                f"{url}/v1/rollouts", content=trickle(), headers=headers, timeout=60
            )

        t = threading.Thread(target=push_slowly)
        t.start()
        uploading.wait(10)
        quick = answer(quick_job, "3", "4", sid=quick_id)
        r = httpx.post(f"{url}/v1/rollouts", json=quick, headers=as_(quick_id), timeout=60)
        assert r.status_code == 200 and r.json()["stored"]
        assert not sent_all.is_set()  # stored while the slow push was still arriving
        t.join(60)
        assert replies["slow"].status_code == 200 and replies["slow"].json()["stored"]
        wait_until(lambda: query(tmp_path / "b", "SELECT COUNT(*) FROM rollouts") == [(2,)])
    finally:
        stop_broker(proc)
