"""An outside tester's attacks on a real broker process (issue 24): each was a reproduction
that worked against the broker before its fix; each test asserts the numbers that show it no
longer does."""

import contextlib
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from echorl.launch.local import write_access
from echorl.models import save_tiny_model
from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import ScoredGroup
from echorl.trainer.batch import batch_from_groups
from tests.integration.conftest import (
    CREDENTIALS,
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
    start_sampler,
    start_trainer,
    status_cli,
    stop_broker,
    wait_until,
)

pytestmark = pytest.mark.integration

CODEC = RunTokenizer.builtin()
PAD, EOS = 0, 1


def right_answer(job) -> str:
    a, b = job["prompt"][:-1].split("+")
    return str(int(a) + int(b))


def push_both_ways(url, sid, body) -> str:
    """Push `body` alone (asserting 422) and in a batch (asserting it refused); the reason."""
    r = httpx.post(f"{url}/v1/rollouts", json={"sampler_id": sid, "group": body}, headers=as_(sid))
    assert r.status_code == 422, r.text
    batch = {"sampler_id": sid, "groups": [body]}
    r2 = httpx.post(f"{url}/v1/rollouts/batch", json=batch, headers=as_(sid))
    (result,) = r2.json()["results"]
    assert r2.status_code == 200 and not result["stored"]
    assert result["refused"] in r.text
    return result["refused"]


def test_a_stop_token_before_the_end_of_a_completion_is_refused(broker):
    """Generation ends at its first eos, so no honest sampler sends a completion with one
    before its end: `[eos] + answer + [eos]` was scored 1 (the decode drops the eos) while
    the loss trained the eos first, and `answer + eos + "9" + eos` charged a right answer 0.
    Both refused (422, alone or in a batch), nothing stored, the job still the sampler's; so
    is a pad anywhere in it (a special token the decode drops, which no backend emits)."""
    url, data = broker
    publish(url, 0, b"w")
    sid = register(url, "eos-launderer")
    (job,) = lease(url, sid).json()["jobs"]
    answer = CODEC.encode(right_answer(job))
    for ids, early in [
        ([EOS, *answer, EOS], 0),
        ([*answer, EOS, *CODEC.encode("9"), EOS], len(answer)),
    ]:
        c = {"token_ids": ids, "logprobs": [-0.01] * len(ids), "finished": True}
        body = group(job) | {
            "completions": [group(job)["completions"][0], c],
            "rewards": [0.0, 1.0],
        }
        why = push_both_ways(url, sid, body)
        assert f"completions[1]: stop token {EOS} at position {early} of {len(ids)}" in why, why
    for ids, at in [([PAD, *answer, EOS], 0), ([*answer, PAD, EOS], len(answer))]:
        c = {"token_ids": ids, "logprobs": [-0.01] * len(ids), "finished": True}
        body = group(job) | {"completions": [group(job)["completions"][0], c]}
        why = push_both_ways(url, sid, body)
        assert f"completions[1]: token {PAD} at position {at} of {len(ids)} is a special" in why
    assert query(data, "SELECT COUNT(*) FROM rollouts") == [(0,)]
    assert query(data, "SELECT state FROM jobs WHERE job_id = ?", job["job_id"]) == [("leased",)]
    honest = group(job, ids=[*answer, EOS], rewards=(1.0, 1.0))
    r = httpx.post(
        f"{url}/v1/rollouts", json={"sampler_id": sid, "group": honest}, headers=as_(sid)
    )
    assert r.status_code == 200 and r.json() == {"stored": True}


def test_a_stop_token_before_the_end_of_a_model_turn_is_refused(tmp_path):
    """Multi-turn: a model turn ends at eos or at its action's newline, so neither comes
    before a turn's end (a Sokoban first turn starting with eos was accepted and rewarded),
    and a pad comes nowhere in a model turn."""
    data = tmp_path / "b"
    proc, url = start_broker(data, free_port(), "-o", "task.name=sokoban")
    try:
        publish(url, 0, b"w")
        sid = register(url, "turn-launderer", task="sokoban")
        (job,) = lease(url, sid).json()["jobs"]
        newline = CODEC.encode("\n")[-1]
        move = CODEC.encode("right\n")
        cases = [([EOS, *move], (0, EOS)), ([*move, *move], (len(move) - 1, newline))]
        cases += [([*move[:2], PAD, *move[2:]], (2, PAD))]  # a special token: never emitted
        for ids, early in cases:
            c = {
                "token_ids": ids,
                "logprobs": [-0.1] * len(ids),
                "finished": False,
                "turns": [{"start": 0, "end": len(ids), "version": 0}],
            }
            body = group(job) | {"completions": [c, c], "rewards": [1.0, 1.0]}
            why = push_both_ways(url, sid, body)
            position, token = early
            rule = "stop token" if token != PAD else "token"
            assert f"turn 0: {rule} {token} at position {position} of {len(ids)}" in why, why
        assert query(data, "SELECT COUNT(*) FROM rollouts") == [(0,)]
    finally:
        stop_broker(proc)


def test_reward_laundering_through_turns_is_refused(broker):
    """A single-turn task's completion that marks the right answer as environment tokens
    behind a lone eos (the model's only token) is refused, whole push or in a batch, and
    changes nothing; a group that is accepted trains on exactly the tokens it was scored on."""
    url, data = broker
    publish(url, 0, b"w")
    sid = register(url, "launderer")
    (job,) = lease(url, sid).json()["jobs"]
    answer = CODEC.encode(right_answer(job))
    laundered = {
        "token_ids": [EOS, *answer],
        "logprobs": [-0.01] * (1 + len(answer)),
        "finished": True,
        "turns": [{"start": 0, "end": 1, "version": 0}],  # the model said only eos
    }
    body = group(job) | {"completions": [laundered, laundered], "rewards": [1.0, 1.0]}

    r = httpx.post(f"{url}/v1/rollouts", json={"sampler_id": sid, "group": body}, headers=as_(sid))
    assert r.status_code == 422 and "turns on a single-turn task" in r.text, r.text
    r = httpx.post(
        f"{url}/v1/rollouts/batch", json={"sampler_id": sid, "groups": [body]}, headers=as_(sid)
    )
    assert r.status_code == 200
    (result,) = r.json()["results"]
    assert not result["stored"] and "turns on a single-turn task" in result["refused"]
    assert query(data, "SELECT COUNT(*) FROM rollouts") == [(0,)]
    assert query(data, "SELECT state FROM jobs WHERE job_id = ?", job["job_id"]) == [("leased",)]

    # The honest answer to the same job: stored, scored and pulled; every token the verifier
    # read is a token the loss (and the audit, which uses the same mask) trains on.
    ids = [*answer, EOS]
    honest = {"token_ids": ids, "logprobs": [-0.5] * len(ids), "finished": True}
    body |= {"completions": [honest, honest], "rewards": [1.0, 1.0]}
    r = httpx.post(f"{url}/v1/rollouts", json={"sampler_id": sid, "group": body}, headers=as_(sid))
    assert r.status_code == 200 and r.json() == {"stored": True}

    def pulled():
        reply = httpx.post(
            f"{url}/v1/batches/pull", json={"n": 1, "step": 0, "wait_s": 2}, headers=as_(TRAINER)
        )
        return reply.json()["groups"]

    (g,) = wait_until(pulled, timeout=60, what="the honest group scored")
    g = ScoredGroup.model_validate(g)
    assert g.rewards == [1.0, 1.0]
    batch = batch_from_groups([g], torch.zeros(1, 2), pad_id=0)
    assert (
        batch.loss_mask.sum().item() == sum(len(c.token_ids) for c in g.completions) == 2 * len(ids)
    )


def sybil(url, stop, held, identities, n=1024, junk=None):
    """Fresh identities from the shared enrolment token, as fast as the broker lets them
    register, each leasing all it can and never pushing; with `junk` (a list), each first
    delivers one group of wrong answers (what a delivered group proved before) and appends
    its job id there."""
    with contextlib.suppress(httpx.TransportError):  # the broker stopped
        while not stop.is_set():
            for _ in range(5):
                r = httpx.post(
                    f"{url}/v1/samplers",
                    json={"name": f"sybil{len(identities)}", **IDENTITY},
                    headers=as_(SAMPLER),
                )
                if r.status_code == 200:
                    CREDENTIALS[r.json()["sampler_id"]] = r.json()["credential"]
                    identities.append(r.json()["sampler_id"])
                    if junk is not None:
                        deliver_junk(url, identities[-1], junk, stop)
            for sid in identities[-5:]:  # the older ones are barred: their leases ran out
                got = lease(url, sid, n)
                if got.status_code == 200:
                    held.update(j["job_id"] for j in got.json()["jobs"])
            stop.wait(1.0)  # as often as a sampler would ask


def deliver_junk(url, sid, junk, stop):
    """One leased job's group of wrong answers ("0"), pushed by `sid` (its job id to `junk`)."""
    while not stop.is_set():
        reply = lease(url, sid, 1)
        if reply.status_code == 200 and reply.json()["jobs"]:
            (job,) = reply.json()["jobs"]
            version = job["required_version"]
            if version is None:
                version = reply.json()["latest_version"]
            body = group(job, version=version, ids=(*CODEC.encode("0"), EOS))
            r = httpx.post(
                f"{url}/v1/rollouts", json={"sampler_id": sid, "group": body}, headers=as_(sid)
            )
            if r.status_code == 200:
                junk.append(job["job_id"])
            return
        stop.wait(0.2)


@pytest.mark.long  # ~35 s each: a run beside sybils, and one without
@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
@pytest.mark.parametrize("first", ["nothing", "one junk group"])
def test_a_sybil_hoarder_cannot_stall_the_trainer(tmp_path, mode, first):
    """Fresh identities that lease everything and never push, or that first deliver one
    group of wrong answers: the trainer's step rate with them is at least 80% of its rate
    without (before: a sync run made no step in four lease periods; with one junk group
    each, 9-17% sync, 27% async), because an identity the trainer has not audited enough
    (`quarantine.min_tokens`) holds one job, and all such together hold
    `broker.newcomer_jobs` beyond the trainer's budget."""
    got = hoard_run(tmp_path, mode, first == "one junk group")
    print(f"{mode}: {got['honest']:.2f} steps/s honest, {got['attacked']:.2f} under sybils")
    assert got["identities"] >= 20 and got["held"]  # the attack ran, its identities held jobs
    if first == "one junk group":
        assert got["junk"] >= 10  # delivered, scored: before, each then leased from the budget
    assert got["attacked"] >= 0.8 * got["honest"]


@pytest.mark.long  # ~40 s
def test_a_proven_sampler_with_one_lapse_keeps_its_rate_beside_sybils(tmp_path):
    """The swarm's one honest sampler, proven, lets one lease run out (stopped with SIGSTOP
    past its deadline) while sybils hoard. Before, the lapse reset it to probation, where it
    competed with the sybils for the one newcomer job: 10% (sync) of its rate. Now a lapse
    halves what its deliveries earned and bars it one lease period; it stays proven: once
    the bar is over, none of its jobs are a newcomer's, and the trainer (fed by it alone)
    makes at least a third of its rate before, three times the rate the old rule left it
    (on this 2-core test bed the ratio wanders, sybils and all: 55% to 162% in 13 runs)."""
    got = hoard_run(tmp_path, "sync", junk_first=True, lapse=True, honest=1)
    print(f"{got['honest']:.2f} steps/s before, {got['attacked']:.2f} after its lapse")
    print(f"{got['lapsed']} leases of it ran out in the timed steps")
    leased, as_newcomer = got["after_bar"]
    assert leased >= 20 and as_newcomer == 0, got["after_bar"]
    assert got["attacked"] >= got["honest"] / 3


def hoard_run(tmp_path, mode, junk_first, lapse=False, honest=2) -> dict:
    """A run (`honest` samplers, B = 4) whose step rate is timed over 15 steps, then over 20
    steps while fresh identities hoard (each first delivering one junk group if
    `junk_first`). Returns steps/s `honest` and `attacked`, and the attack's `identities`,
    jobs `held` and `junk` groups delivered (also bench/trust.py's). With `lapse`, honest0
    (proven by then) is stopped (SIGSTOP) while it holds a lease until the lease has run
    out, then let go on; the 20 steps are timed from the end of its bar."""
    model = save_tiny_model(tmp_path / "v0", "1m", seed=0)
    run = ["-o", f"broker.mode={mode}", "-o", "train.batch_prompts=4", "-o", "train.group_size=2"]
    run += ["-o", "sampling.max_new_tokens=8", "-o", "train.drop_flat_groups=false"]
    run += ["-o", "train.eval_prompts=4", "-o", "train.eval_every=0"]
    lease_s = 3
    proc, url = start_broker(
        tmp_path / "b",
        free_port(),
        *run,
        "-o",
        f"broker.lease_seconds={lease_s}",
        *PROBATION,
        "-o",
        "broker.registrations_per_minute=120",
    )
    out = tmp_path / "out"
    samplers = [start_sampler(url, model, f"honest{k}", *run) for k in range(honest)]
    trainer = start_trainer(url, model, out, *run, "-o", "train.steps=1000")
    stop, held, identities, junk = threading.Event(), set(), [], []
    attack = threading.Thread(
        target=sybil,
        args=(url, stop, held, identities),
        kwargs={"junk": junk if junk_first else None},
        daemon=True,
    )
    times = {}

    def reached(k):
        path = out / "metrics.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            with contextlib.suppress(ValueError):  # the line being written
                r = json.loads(line)
                if "time" in r:  # a training step (evaluations have records of their own)
                    times.setdefault(r["step"], r["time"])
        return k in times

    try:
        wait_until(lambda: reached(20), timeout=240, what="20 honest steps")
        attack.start()
        t_attack = time.monotonic()
        wait_until(lambda: len(identities) >= 20, timeout=60, what="20 sybil identities")
        time.sleep(max(0.0, t_attack + 2 * lease_s - time.monotonic()))  # hoarded leases ran out
        if lapse:  # stopped while it holds a lease: the lease runs out unpushed
            holds = (
                "SELECT COUNT(*) FROM jobs j JOIN samplers s ON s.id = j.lease_owner "
                "WHERE j.state = 'leased' AND s.name = 'honest0'"
            )
            barred = "SELECT barred_until FROM samplers WHERE name = 'honest0'"
            # Stopped first, then asked whether it holds a lease: a fast sampler pushed its
            # lease between a look and a SIGSTOP every time (CI: 10 tries, "no lapse").
            for attempt in range(400):
                os.kill(samplers[0].pid, signal.SIGSTOP)
                try:
                    if query(tmp_path / "b", holds)[0][0] == 0:
                        continue
                    # A push it had sent before the stop may still land: then again.
                    with contextlib.suppress(AssertionError):
                        wait_until(lambda: query(tmp_path / "b", barred)[0][0] > 0, 3 * lease_s)
                        break
                finally:
                    os.kill(samplers[0].pid, signal.SIGCONT)
                    time.sleep(0.005 * (attempt % 7))  # let it run a little, a varied while
            bar_end = query(tmp_path / "b", barred)[0][0]
            assert bar_end > 0, "no lapse"
            # Barred one lease period from when the broker saw the lapse; then back at work:
            # timed from 5 steps after its first group delivered after the bar.
            again = (
                "SELECT COUNT(*) FROM rollouts r JOIN samplers s ON s.id = r.sampler_id "
                f"WHERE s.name = 'honest0' AND r.created_at > {bar_end}"
            )
            wait_until(lambda: query(tmp_path / "b", again)[0][0] > 0, 60, "honest0 back")
            back = max(times) if reached(-1) or times else 0
            wait_until(lambda: reached(back + 5), timeout=60, what="5 steps since")
        s0 = max(times) if reached(-1) or times else 0
        lapses = "SELECT SUM(lapsed) FROM samplers WHERE name LIKE 'honest%'"
        lapsed = query(tmp_path / "b", lapses)[0][0]
        wait_until(lambda: reached(s0 + 20), timeout=120, what="20 steps under attack")
        lapsed = query(tmp_path / "b", lapses)[0][0] - lapsed
        # honest0's jobs leased after its (first) bar, and those leased as a newcomer's
        after_bar = None
        if lapse:
            after_bar = query(
                tmp_path / "b",
                "SELECT COUNT(*), COALESCE(SUM(j.extra), 0) FROM jobs j JOIN samplers s "
                f"ON s.id = j.lease_owner WHERE s.name = 'honest0' AND j.leased_at > {bar_end}",
            )[0]
    finally:
        stop.set()
        for p in [*samplers, trainer]:
            p.terminate()
            p.communicate(timeout=60)  # read: a full pipe would block its writes
        stop_broker(proc)

    return {
        "honest": 15 / (times[20] - times[5]),
        "attacked": 20 / (times[s0 + 20] - times[s0]),
        "identities": len(identities),
        "held": len(held),
        "junk": len(junk),
        "lapsed": lapsed,  # the honest samplers' leases that ran out in the timed steps
        "after_bar": after_bar,  # (honest0's jobs leased after its bar, as a newcomer's)
    }


def test_register_and_leave_floods_leave_status_quick_and_short(tmp_path):
    """5,000 identities that register and leave (before: status took 62 s and printed 4,222
    lines): the status call stays under a second, lists the most relevant samplers and counts
    the rest; `echorl status --run` finds the broker and token in a run's folder."""
    proc, url = start_broker(tmp_path / "b", free_port(), "-o", "broker.registrations_per_minute=0")
    try:
        with httpx.Client(base_url=url) as http:
            honest = register(url, "honest")
            for k in range(5000):
                r = http.post(
                    "/v1/samplers", json={"name": f"flood{k}", **IDENTITY}, headers=as_(SAMPLER)
                )
                sid, credential = r.json()["sampler_id"], r.json()["credential"]
                leave = http.post(
                    f"/v1/samplers/{sid}/leave", headers={"Authorization": f"Bearer {credential}"}
                )
                assert leave.status_code == 200
            t0 = time.perf_counter()
            status = http.get("/v1/status", headers=as_(TRAINER)).json()
            took = time.perf_counter() - t0
        print(f"status over 5,001 samplers: {took * 1000:.0f} ms")
        assert took < 1.0
        assert status["sampler_counts"] == {"alive": 1, "left": 5000}
        assert status["samplers"][0]["id"] == honest and len(status["samplers"]) == 100

        run = tmp_path / "run"
        run.mkdir()
        env = {"ECHORL_TRAINER_TOKEN": TRAINER, "ECHORL_SAMPLER_TOKEN": SAMPLER}
        write_access(run, url, env)
        assert (run / "access.json").stat().st_mode & 0o777 == 0o600
        cli = [sys.executable, "-m", "echorl.cli", "status", "--run", str(run)]
        out = subprocess.run(
            cli, capture_output=True, text=True, timeout=60, env=os.environ | {"COLUMNS": "200"}
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "samplers: 1 alive, 5000 left" in out.stdout and "(20 of 5001)" in out.stdout
        assert len(out.stdout.splitlines()) < 60
        missing = subprocess.run(
            [*cli[:-1], str(tmp_path)],
            capture_output=True,
            text=True,
            env=os.environ | {"COLUMNS": "400"},
        )
        assert missing.returncode == 2 and "access.json does not exist" in missing.stdout
    finally:
        stop_broker(proc)


LIAR = Path(__file__).parents[1] / "fixtures" / "dishonest_sampler.py"


@pytest.mark.slow
def test_a_liar_rotating_identities_is_quarantined_or_starved(tmp_path):
    """A sampler that reports made-up log-probs and registers anew every few seconds, with
    an enrolment token the admin issued its operator, beside 2 honest samplers: no identity
    of it lives to `quarantine.min_tokens` audited tokens of its own (before: never
    quarantined). Either the audit's sums, kept by its operator, quarantine it with every
    identity (and it may register none after), or probation starves it: a bounded share of
    any batch. The honest samplers are never quarantined."""
    model = save_tiny_model(tmp_path / "v0", "1m", seed=0)
    run = ["-o", "broker.mode=async", "-o", "train.batch_prompts=6", "-o", "train.group_size=2"]
    run += ["-o", "sampling.max_new_tokens=8", "-o", "train.drop_flat_groups=false"]
    run += ["-o", "train.eval_prompts=4", "-o", "train.eval_every=0"]
    proc, url = start_broker(tmp_path / "b", free_port(), *run, *PROBATION)
    data = tmp_path / "b"
    out = tmp_path / "out"
    admin = os.environ | {"ECHORL_TOKEN": TRAINER}
    enrol = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "samplers", "enrol", "mallory", "--broker", url],
        env=admin,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert enrol.returncode == 0, enrol.stdout + enrol.stderr
    token = enrol.stdout.split("ECHORL_SAMPLER_TOKEN=")[1].split()[0]
    honest = [start_sampler(url, model, f"honest{k}", *run) for k in range(2)]
    trainer = start_trainer(url, model, out, *run, "-o", "train.steps=1000")
    liars, refused = [], None
    cmd = [sys.executable, str(LIAR), "fake", "sampler", "--broker", url, "--model", str(model)]
    cmd += ["--threads", "1", "--jobs-per-lease", "2", *run]
    try:
        t_end = time.monotonic() + 150
        while time.monotonic() < t_end:
            liar = subprocess.Popen(
                [*cmd, "--name", f"mallory{len(liars)}"],
                env=os.environ | {"ECHORL_SAMPLER_TOKEN": token},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            liars.append(liar)
            with contextlib.suppress(subprocess.TimeoutExpired):
                liar.wait(12)  # then a new identity
            if liar.poll() is not None:  # refused at registration: the operator is out
                refused = liar.communicate()[0]
                break
            liar.kill()
            liar.communicate()
    finally:
        for p in [*honest, trainer]:
            p.terminate()
            p.communicate(timeout=60)
        stop_broker(proc)
    states = query(data, "SELECT name, state, operator FROM samplers")
    (operator,) = query(data, "SELECT state, audit_total FROM operators WHERE name = 'mallory'")
    shares = query(
        data,
        "SELECT r.consumed_step, AVG(s.operator = 'mallory') FROM rollouts r JOIN samplers s "
        "ON s.id = r.sampler_id WHERE r.state = 'consumed' GROUP BY r.consumed_step",
    )
    worst = max(share for _, share in shares)
    print(f"{len(liars)} identities; operator {operator}; largest share of a batch {worst:.2f}")
    assert len(liars) >= 2 and len(shares) >= 20  # it rotated; the run went on
    assert all(s != "quarantined" for n, s, o in states if n.startswith("honest"))
    if operator[0] == "quarantined":
        assert refused is not None and "operator mallory is quarantined" in refused, refused
        assert all(s == "quarantined" for n, s, o in states if o == "mallory" and s != "lost")
    else:
        assert worst <= 2 / 6  # starved: 2 of a batch of 6 at most


def rss_mb(pid) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


PROBE = """
import sys, time, httpx
with httpx.Client(base_url=sys.argv[1], timeout=30) as http:
    while True:
        t0 = time.perf_counter()
        http.get("/healthz")
        print(time.perf_counter() - t0, flush=True)
        time.sleep(0.02)
"""


@contextlib.contextmanager
def healthz_probe(url):
    """/healthz latencies, measured from a process of their own (this one is busy sending)."""
    latencies = []
    probe = subprocess.Popen([sys.executable, "-c", PROBE, url], stdout=subprocess.PIPE, text=True)
    try:
        yield latencies
    finally:
        probe.terminate()
        latencies += [float(x) for x in probe.communicate(timeout=30)[0].split()]


def test_big_pushes_are_parsed_off_the_loop_and_held_within_a_bound(tmp_path):
    """24 concurrent pushes of 16 MB from 4 samplers (before, 12 from one: /healthz 8.9 s,
    RSS +293 MB): /healthz p99 stays under 500 ms (measured 36-106 ms on 2 busy cores; the
    bound is for the 8.9 s of parsing on the loop, not the machine's load), the bodies in
    flight stay within `push_bytes_in_flight` (the rest are refused, 429, unread) and RSS
    grows by a bounded multiple of it."""
    mb = 1 << 20
    proc, url = start_broker(
        tmp_path / "b",
        free_port(),
        "-o",
        f"broker.max_body_bytes={17 * mb}",
        "-o",
        f"broker.push_bytes_in_flight={4 * 17 * mb}",
        "-o",
        "broker.sampler_calls_per_s=0",
    )
    try:
        publish(url, 0, b"w")
        sids = [register(url, f"big{k}") for k in range(4)]
        ids = list(range(2, 200)) * 4
        c = {"token_ids": ids, "logprobs": [-0.5] * len(ids), "finished": True}
        body = json.dumps(
            {
                "sampler_id": sids[0],
                "groups": [group(k) | {"completions": [c, c]} for k in range(1000)],
            }
        ).encode()
        body = body[: 16 * mb] if len(body) > 16 * mb else body
        base = rss_mb(proc.pid)
        peak, codes = [base], []

        def push(sid):
            own = body.replace(sids[0].encode(), sid.encode(), 1)
            with contextlib.suppress(httpx.TransportError):  # refused before it was sent
                r = httpx.post(
                    f"{url}/v1/rollouts/batch",
                    content=own,
                    headers=as_(sid) | {"Content-Type": "application/json"},
                    timeout=120,
                )
                codes.append(r.status_code)

        pushers = [threading.Thread(target=push, args=(sids[k % 4],)) for k in range(24)]
        with healthz_probe(url) as latencies:
            time.sleep(1.0)  # the probe's interpreter is up
            for t in pushers:
                t.start()
            while any(t.is_alive() for t in pushers):
                peak.append(rss_mb(proc.pid))
                time.sleep(0.05)
            time.sleep(0.5)
    finally:
        stop_broker(proc)
    p99 = statistics.quantiles(latencies, n=100)[98]
    grew = max(peak) - base
    print(
        f"body {len(body) / mb:.1f} MB x 24: healthz p99 {p99 * 1000:.0f} ms over "
        f"{len(latencies)}; RSS +{grew:.0f} MB; answers {sorted(codes)}"
    )
    assert 429 in codes and any(code != 429 for code in codes)
    assert p99 < 0.5
    assert grew < 4 * 68  # a bounded multiple of the 68 MB in flight (parsing expands it)


def test_a_heartbeat_flood_is_rate_limited_and_claims_are_checked(broker):
    """One sampler's 60 connections beating as fast as they can: most are refused (429,
    before any work), /healthz and the trainer's status stay quick; a version the broker
    does not publish is not believed (a version from the future, or other weights under a
    published number, count as none: the reply names the latest to fetch; an error would
    leave an honest sampler whose trainer forgot that version nothing to do but ask again).
    A sampler cannot tell its speed (1e9 tokens/s made the capacity advice keep it alone):
    no request has the field; the broker measures what it delivers."""
    url, data = broker
    publish(url, 0, b"w")
    sid = register(url, "flood")
    held = "SELECT version_held FROM samplers WHERE id = ?"
    right, wrong = hashlib.sha256(b"w").hexdigest(), hashlib.sha256(b"v").hexdigest()
    for claim, believed in [
        ({"version_held": 0, "sha256_held": right}, 0),
        ({"version_held": 2**62}, None),
        ({"version_held": 0, "sha256_held": right}, 0),
        ({"version_held": 0, "sha256_held": wrong}, None),
        ({"version_held": 0}, 0),  # no sha256 (an older sampler): the number alone
    ]:
        reply = httpx.post(f"{url}/v1/samplers/{sid}/heartbeat", json=claim, headers=as_(sid))
        assert reply.status_code == 200 and reply.json()["latest_version"] == 0
        assert query(data, held, sid) == [(believed,)], claim
    bad = httpx.post(
        f"{url}/v1/samplers/{sid}/heartbeat", json={"sha256_held": "x" * 64}, headers=as_(sid)
    )
    assert bad.status_code == 422 and "sha256_held" in bad.text
    for route, body in (
        (f"/v1/samplers/{sid}/heartbeat", {}),
        ("/v1/jobs/lease", {"sampler_id": sid}),
    ):
        boast = httpx.post(f"{url}{route}", json=body | {"tokens_per_s": 1e9}, headers=as_(sid))
        assert boast.status_code == 422 and "tokens_per_s" in boast.text  # no field to claim in
    assert query(data, "SELECT tokens_per_s FROM samplers WHERE id = ?", sid) == [(None,)]
    stop, codes = threading.Event(), []

    def beat():
        with httpx.Client(base_url=url, headers=as_(sid), timeout=30) as http:
            while not stop.is_set():
                codes.append(http.post(f"/v1/samplers/{sid}/heartbeat", json={}).status_code)

    flood = [threading.Thread(target=beat) for _ in range(60)]
    with healthz_probe(url) as latencies:
        time.sleep(1.0)  # the probe's interpreter is up
        t_start = time.monotonic()
        for t in flood:
            t.start()
        time.sleep(1.0)
        t0 = time.perf_counter()
        status = httpx.get(f"{url}/v1/status", headers=as_(TRAINER), timeout=30)
        status_s = time.perf_counter() - t0
        time.sleep(2.0)
        stop.set()
        for t in flood:
            t.join()
        took = time.monotonic() - t_start
    p50 = statistics.median(latencies)
    print(
        f"{len(codes)} beats in {took:.1f} s: {codes.count(200)} answered, {codes.count(429)} refused; "
        f"healthz p50 {p50 * 1000:.0f} ms; status {status_s * 1000:.0f} ms"
    )
    assert status.status_code == 200
    assert codes.count(200) <= 100 * took + 200  # the rate (100/s) and its burst
    assert p50 < 0.05 and status_s < 1.0


def test_a_peer_url_must_be_where_the_sampler_registered_from(tmp_path):
    """Honest samplers are sent to fetch weights wherever a sampler's peer_url points: a
    cloud's metadata service (link-local), another host, a name: 422, nothing registered.
    The address the registration came from is accepted (here loopback: the broker is on
    loopback), and a network the operator allows (broker.peer_hosts) too."""
    data = tmp_path / "b"
    proc, url = start_broker(data, free_port(), "-o", "broker.peer_hosts=[10.0.0.0/8]")
    try:
        refused = {
            "http://169.254.169.254:80": "169.254.169.254 is not an address peers can reach",
            "http://192.168.1.7:9000": "not the address this registration came from (127.0.0.1)",
            "http://peer.example:9000": "name the host by its IP address",
        }
        for peer_url, why in refused.items():
            r = httpx.post(
                f"{url}/v1/samplers",
                json={"name": "p", **IDENTITY, "peer_url": peer_url},
                headers={"Authorization": f"Bearer {SAMPLER}"},
            )
            assert r.status_code == 422 and why in r.text, (peer_url, r.text)
        assert query(data, "SELECT COUNT(*) FROM samplers") == [(0,)]
        for n, peer_url in enumerate(["http://127.0.0.1:9000", "http://10.1.2.3:9000"]):
            assert register(url, f"ok{n}", peer_url=peer_url)
        assert query(data, "SELECT COUNT(*) FROM samplers") == [(2,)]
    finally:
        stop_broker(proc)


def test_a_delivered_group_proves_nothing_an_audit_does_and_the_status_says_so(tmp_path):
    """With probation, a sampler's delivered group is no proof: its next lease is still a
    newcomer's (one job beyond the budget), and `echorl status` shows how far it is from
    proven; once the trainer's audit has covered quarantine.min_tokens of its tokens it
    leases from the budget, and the status says proven."""
    data = tmp_path / "b"
    run = ("-o", "quarantine.min_tokens=6", "-o", "train.batch_prompts=4", *PROBATION)
    proc, url = start_broker(data, free_port(), *run)
    try:
        publish(url, 0, b"w")
        sid = register(url, "worker")
        (job,) = lease(url, sid, 4).json()["jobs"]
        r = httpx.post(
            f"{url}/v1/rollouts", json={"sampler_id": sid, "group": group(job)}, headers=as_(sid)
        )
        assert r.status_code == 200
        wait_until(lambda: query(data, "SELECT delivered FROM samplers") == [(1,)], what="scored")

        def standing():
            reply = httpx.get(f"{url}/v1/status", headers=as_(TRAINER)).json()
            return reply["samplers"][0]["standing"]

        extra = "SELECT COUNT(*) FROM jobs WHERE state = 'leased' AND extra = 1"
        assert len(lease(url, sid, 4).json()["jobs"]) == 1 and query(data, extra) == [(1,)]
        assert standing() == "newcomer: 0 of 6 tokens audited"
        shown = status_cli(url)
        assert "held back, not yet proven by the trainer's audit (1;" in shown, shown
        assert f"{sid} worker: newcomer: 0 of 6 tokens audited" in shown, shown
        pulled = httpx.post(
            f"{url}/v1/batches/pull", json={"n": 1, "step": 0, "wait_s": 2}, headers=as_(TRAINER)
        ).json()["groups"]
        assert [g["job_id"] for g in pulled] == [job["job_id"]]
        audited(url, job["job_id"], 6)
        assert standing() == "proven"
        got = lease(url, sid, 4).json()["jobs"]
        held_extra = query(data, extra)[0][0]
        assert len(got) == 1 and held_extra == 1  # first + delivered (2) - held (1), budget
    finally:
        stop_broker(proc)
