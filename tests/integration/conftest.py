"""Fixtures that start real broker processes on loopback ports."""

import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest

from echorl.models.tokenizer import RunTokenizer

TRAINER, SAMPLER = "t" * 32, "s" * 32
# What a sampler of a default run (the tiny model's tokenizer, task add) registers with.
IDENTITY = {"tokenizer": RunTokenizer.builtin().fingerprint, "task": "add"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Tests of other mechanisms lease as samplers that have delivered would, with no probation
# (test_hostile.py tests probation, with the defaults: PROBATION).
PROVEN = ("-o", "broker.first_lease=1000000")  # >= max_leased_per_sampler: probation off
PROBATION = ("-o", "broker.first_lease=1", "-o", "broker.newcomer_jobs=1")


def start_broker(data_dir, port, *overrides):
    """Start `echorl broker` and wait until it answers /healthz; returns (process, url)."""
    args = [
        "--data-dir",
        str(data_dir),
        "--port",
        str(port),
        "-o",
        f"broker.trainer_token={TRAINER}",
        "-o",
        f"broker.sampler_token={SAMPLER}",
        "-o",
        "train.group_size=2",
        "-o",
        "broker.max_body_bytes=100000",
        *PROVEN,
        *overrides,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "echorl.cli", "broker", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            httpx.get(url + "/healthz", timeout=0.5)
            return proc, url
        except httpx.TransportError:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
    raise AssertionError("broker did not start")


def start_sampler(url, model, name, *args, inside=(), log=None):
    """Start `echorl sampler` against `url` with one torch thread; returns the process.
    `inside`: a command prefix it runs under (e.g. a network namespace's `ip netns exec`);
    `log`: an open file for what it prints (default: a pipe, read by `communicate`)."""
    env = os.environ | {"ECHORL_SAMPLER_TOKEN": SAMPLER}
    cmd = [
        *inside,
        sys.executable,
        "-m",
        "echorl.cli",
        "sampler",
        "--broker",
        url,
        "--model",
        str(model),
        "--name",
        name,
        "--threads",
        "1",
        *args,
    ]
    out = subprocess.PIPE if log is None else log
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


CREDENTIALS: dict[str, str] = {}  # sampler id -> the credential registration returned


def register(url, name="s1", **info) -> str:
    """Register a sampler over HTTP with the enrolment token; returns its id (its credential
    is kept in CREDENTIALS: `as_(sid)` sends it)."""
    reply = httpx.post(
        f"{url}/v1/samplers",
        json={"name": name, **IDENTITY, **info},
        headers={"Authorization": f"Bearer {SAMPLER}"},
    ).json()
    CREDENTIALS[reply["sampler_id"]] = reply["credential"]
    return reply["sampler_id"]


def as_(who):
    """The Authorization header of a token, or of a registered sampler's id."""
    return {"Authorization": f"Bearer {CREDENTIALS.get(who, who)}"}


def publish(url, version, blob):
    """The trainer's upload of weights `blob` as `version` (the raw HTTP call)."""
    import hashlib

    headers = as_(TRAINER) | {"X-Sha256": hashlib.sha256(blob).hexdigest()}
    return httpx.put(f"{url}/v1/weights/{version}", content=blob, headers=headers)


def lease(url, sid, n=1):
    """Sampler `sid`'s lease of up to `n` jobs (the raw HTTP call)."""
    return httpx.post(f"{url}/v1/jobs/lease", json={"sampler_id": sid, "n": n}, headers=as_(sid))


def group(job, version=0, ids=(26, 17, 1), rewards=(0.0, 0.0)) -> dict:
    """A pushable group body (G = 2) for `job` (a leased job, as JSON or a Job; or a job id,
    for a job the broker does not know)."""
    if isinstance(job, int):
        job_id, prompt_ids = job, [5]
    else:
        job = job if isinstance(job, dict) else job.model_dump()
        job_id, prompt_ids = job["job_id"], job["prompt_ids"]
    c = {"token_ids": list(ids), "logprobs": [-0.5] * len(ids), "finished": True}
    return {
        "job_id": job_id,
        "version": version,
        "prompt_ids": prompt_ids,
        "completions": [c, c],
        "rewards": list(rewards),
    }


def stop_broker(proc) -> str:
    proc.terminate()
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status tells why it ended.
    assert proc.wait(10) in (0, -15)
    out = proc.stdout.read()
    assert "Traceback" not in out and "echorl broker on" in out, out
    return out


@pytest.fixture
def broker(tmp_path):
    proc, url = start_broker(tmp_path / "b", free_port())
    yield url, tmp_path / "b"
    stop_broker(proc)


def start_trainer(url, model, out, *args):
    """Start `echorl trainer` against `url` with one torch thread; returns the process."""
    env = os.environ | {"ECHORL_TRAINER_TOKEN": TRAINER}
    cmd = [sys.executable, "-m", "echorl.cli", "trainer", "--broker", url, "--model", str(model)]
    cmd += ["--out", str(out), "-o", "model.threads=1", *args]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_until(predicate, timeout=180.0, what="condition", poll=0.1):
    """Poll `predicate()` until it returns something truthy; returns that."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if value := predicate():
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def query(data_dir, sql, *params):
    """Rows from the broker's SQLite file (read-only, while the broker may be running)."""
    import sqlite3

    db = sqlite3.connect(f"file:{data_dir / 'broker.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.close()


def echorl_run(out, *overrides, config=None, timeout=900, resume=False):
    """`echorl run [CONFIG] --out OUT [--resume]` on any free port, `-o` each override;
    asserts exit 0 (showing every process log when not) and returns what it printed."""
    args = [sys.executable, "-m", "echorl.cli", "run", *([str(config)] if config else [])]
    args += ["--out", str(out), *(["--resume"] if resume else [])]
    # Without probation: these runs' fixed-seed realizations (and the learning margins measured
    # on them) stay what they were; probation's growing first leases would leave each lease's
    # composition, and so its seed, to timing (test_hostile.py and the demo run with it).
    for o in ("broker.port=0", PROVEN[1], *overrides):
        args += ["-o", o]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    logs = "".join(p.read_text() for p in sorted((out / "logs").glob("*.log")))
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    return proc.stdout


# Held-out learning is measured as sampled pass@1 (`train.eval_samples` completions per prompt
# at the run's temperature): what RL raises, and steady across CPUs. Greedy accuracy is not: its
# argmax flips with the CPU's float kernels. The co-located add run (120 steps, 200 prompts): greedy
# 0.725 -> 0.885 on one CPU; 0.78 -> 0.805, 0.83, 0.87 (seeds 0, 1, 2) on another, where pass@1
# rose 0.47 -> 0.62, 0.63, 0.64 (40 steps: 0.47 -> 0.57-0.59).
SAMPLED = "train.eval_samples=8"

# 60 async steps, held-out evaluation at both ends only: what the learning tests of tasks and
# checkpoints run through `echorl run`.
ASYNC_RUN = [
    "broker.mode=async",
    "train.steps=60",
    "train.eval_every=0",
    "train.eval_prompts=100",
    SAMPLED,
]


def reward_pairs(out):
    """(broker rewards, sampler's claims) of every group the run's broker stored."""
    import json

    rows = query(out / "broker", "SELECT rewards, claimed FROM rollouts WHERE rewards IS NOT NULL")
    return [(json.loads(rewards), json.loads(claimed)) for rewards, claimed in rows]


def pass1(records):
    """Every held-out evaluation's sampled pass@1, in order."""
    return [r["eval/pass1"] for r in records if "eval/pass1" in r]


def learning(out):
    """(first 10 steps' mean train reward, last 10's, held-out pass@1 before and after)."""
    records = read_jsonl(out / "metrics.jsonl")
    train = [r["reward/mean"] for r in records if "reward/mean" in r]
    evals = pass1(records)
    return sum(train[:10]) / 10, sum(train[-10:]) / 10, evals[0], evals[-1]


def audited(url, job_id, tokens) -> None:
    """The trainer acks `job_id`'s group (pulled) at step 0 and reports a clean audit of
    `tokens` of its tokens: its sampler is proven once that reaches quarantine.min_tokens."""
    ack = {"job_ids": [job_id], "step": 0}
    assert httpx.post(f"{url}/v1/batches/ack", json=ack, headers=as_(TRAINER)).status_code == 200
    audit = {"job_id": job_id, "tokens": tokens, "abs_delta": 0.0, "kl": 0.0, "beyond": 0}
    r = httpx.post(
        f"{url}/v1/trainer/audit",
        json={"step": 0, "groups": [audit | {"exact": True}]},
        headers=as_(TRAINER),
    )
    assert r.status_code == 200 and r.json()["quarantined"] == {}, r.text


def status_cli(url) -> str:
    """What `echorl status --broker URL` prints (as the trainer, on a wide terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "echorl.cli", "status", "--broker", url],
        env=os.environ | {"ECHORL_TOKEN": TRAINER, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout


def read_jsonl(path):
    import json

    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def warm_add(tmp_path_factory):
    """The 1m tiny model warmed up on `add` (the demo's warm-up), once per session."""
    out = tmp_path_factory.mktemp("warm") / "sft"
    proc = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "sft", "--task", "add", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, last = map(float, re.search(r"warm-up loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert last < 0.5 * first, proc.stdout  # the warm-up learned the demonstrations
    return out
