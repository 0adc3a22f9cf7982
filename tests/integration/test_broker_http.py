"""A real broker process on a loopback port, driven over HTTP."""

import hashlib
import os
import subprocess
import sys

import httpx
import pytest

from tests.integration.conftest import IDENTITY, SAMPLER, TRAINER, as_, group, register

pytestmark = pytest.mark.integration


def publish(url, version, blob):
    return httpx.put(
        f"{url}/v1/weights/{version}",
        content=blob,
        headers=as_(TRAINER) | {"X-Sha256": hashlib.sha256(blob).hexdigest()},
    )


def test_a_sync_round_trip_over_http(broker):
    url, data = broker
    sid = register(url, "s1")

    def lease():
        return httpx.post(
            f"{url}/v1/jobs/lease",
            json={"sampler_id": sid, "n": 2},
            headers=as_(sid),
        ).json()

    assert lease()["jobs"] == []  # no weights yet: nothing to generate with
    blob = bytes(range(256)) * 100
    assert publish(url, 0, blob).json()["version"] == 0
    r = httpx.get(f"{url}/v1/weights/0", headers=as_(sid) | {"Range": "bytes=100-"})
    assert r.status_code == 206 and r.content == blob[100:]
    jobs = lease()["jobs"]
    assert [j["required_version"] for j in jobs] == [0, 0]

    # The broker scores with its own verifier: "90" is right only for prompts that sum to 90.
    body = {"sampler_id": sid, "group": group(jobs[0], rewards=(1.0, 1.0))}
    first = httpx.post(f"{url}/v1/rollouts", json=body, headers=as_(sid)).json()
    a, b = jobs[0]["prompt"][:-1].split("+")
    assert first == {"stored": True}  # stored at once; scored by the broker's verifiers later
    again = httpx.post(f"{url}/v1/rollouts", json=body, headers=as_(sid)).json()
    assert again["stored"] is False

    pulled = httpx.post(  # a long poll: answered once the group is scored
        f"{url}/v1/batches/pull", json={"n": 8, "step": 0, "wait_s": 5}, headers=as_(TRAINER)
    ).json()
    assert [g["job_id"] for g in pulled["groups"]] == [jobs[0]["job_id"]]
    # the broker's rewards, not the claims
    assert pulled["groups"][0]["rewards"] == [float(int(a) + int(b) == 90)] * 2
    ack = httpx.post(
        f"{url}/v1/batches/ack",
        json={"job_ids": [jobs[0]["job_id"]], "step": 0},
        headers=as_(TRAINER),
    ).json()
    assert ack == {"consumed": 1}
    status = httpx.get(f"{url}/v1/status", headers=as_(TRAINER)).json()
    assert status["rollouts"] == {"consumed": 1} and status["latest_version"] == 0
    assert "broker_groups_pushed_total 1.0" in httpx.get(f"{url}/metrics").text


def test_bad_requests_get_a_reason_and_change_nothing(broker):
    url, data = broker
    sid = register(url, "s1")
    publish(url, 0, b"weights")
    job = httpx.post(
        f"{url}/v1/jobs/lease", json={"sampler_id": sid, "n": 1}, headers=as_(sid)
    ).json()["jobs"][0]
    other = register(url, "s2")
    push = f"{url}/v1/rollouts"

    def dump():
        import sqlite3

        with sqlite3.connect(data / "broker.sqlite") as db:
            return [line for line in db.iterdump() if "samplers" not in line]

    cases = [
        (
            httpx.post(
                push,
                content=b"{not json",
                headers=as_(sid) | {"Content-Type": "application/json"},
            ),
            422,
            "",
        ),
        (
            httpx.post(
                push,
                json={"sampler_id": sid, "group": group(job) | {"version": "new"}},
                headers=as_(sid),
            ),
            422,
            "integer",
        ),
        (
            httpx.post(
                push,
                json={"sampler_id": sid, "group": group(job, ids=(5, 9999))},
                headers=as_(sid),
            ),
            422,
            "outside the vocabulary",
        ),
        (
            httpx.post(
                push,
                json={"sampler_id": sid, "group": group(job) | {"prompt_ids": [5, 6]}},
                headers=as_(sid),
            ),
            409,
            "not the job's prompt",
        ),
        (
            httpx.post(
                push, json={"sampler_id": sid, "group": group(job, version=3)}, headers=as_(sid)
            ),
            409,
            "newer than the latest",
        ),
        (
            httpx.post(push, json={"sampler_id": other, "group": group(job)}, headers=as_(other)),
            409,
            "not leased to sampler",
        ),
        (
            httpx.post(push, json={"sampler_id": sid, "group": group(job)}),
            401,
            "missing bearer token",
        ),
        (
            httpx.post(push, json={"sampler_id": sid, "group": group(job)}, headers=as_("x" * 32)),
            401,
            "unknown token",
        ),
        (
            httpx.post(f"{url}/v1/batches/pull", json={"n": 1, "step": 0}, headers=as_(sid)),
            403,
            "sampler role",
        ),
        (httpx.post(push, content=b"x" * 200_000, headers=as_(sid)), 413, "exceeds the limit"),
        (
            httpx.put(
                f"{url}/v1/weights/1", content=b"abc", headers=as_(TRAINER) | {"X-Sha256": "0" * 64}
            ),
            400,
            "sha256 mismatch",
        ),
        (publish(url, 5, b"abc"), 409, "not the next one"),
        (
            httpx.post(
                f"{url}/v1/samplers", json={"name": "../../etc", **IDENTITY}, headers=as_(SAMPLER)
            ),
            422,
            "pattern",
        ),
        (
            httpx.post(
                f"{url}/v1/samplers",
                json={"name": "other-tokenizer", **IDENTITY, "tokenizer": "ab" * 32},
                headers=as_(SAMPLER),
            ),
            409,
            "tokenizer (fingerprint abababab",
        ),
        (
            httpx.post(
                f"{url}/v1/samplers",
                json={"name": "other-task", **IDENTITY, "task": "reverse"},
                headers=as_(SAMPLER),
            ),
            409,
            "runs task 'reverse'",
        ),
        (
            httpx.post(
                f"{url}/v1/batches/ack",
                json={"job_ids": [job["job_id"]], "step": 0},
                headers=as_(TRAINER),
            ),
            404,
            "no stored group",
        ),
    ]
    before = dump()
    for response, code, reason in cases:
        assert response.status_code == code, response.text
        assert reason in response.text
    assert dump() == before


def test_status_command_prints_the_swarm(broker):
    url, _ = broker
    httpx.post(
        f"{url}/v1/samplers",
        json={"name": "laptop", "hardware": "cpu x2", **IDENTITY},
        headers=as_(SAMPLER),
    )
    out = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "status", "--broker", url],
        env={**os.environ, "ECHORL_TOKEN": TRAINER},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "laptop" in out.stdout and "cpu x2" in out.stdout and "latest version -1" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "status", "--broker", url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "ECHORL_TOKEN": ""},
    )
    assert bad.returncode == 1 and "401" in bad.stdout


def test_async_admission_control_and_retention(tmp_path):
    from tests.integration.conftest import free_port, start_broker, stop_broker

    proc, url = start_broker(
        tmp_path / "b",
        free_port(),
        "-o",
        "broker.mode=async",
        "-o",
        "broker.max_staleness=1",
        "-o",
        "train.batch_prompts=3",
        "-o",
        "broker.keep_versions=2",
        "-o",
        "broker.max_leased_per_sampler=100",
    )
    try:
        assert publish(url, 0, b"weights 0").status_code == 200
        sid = register(url, "s")

        def lease(n):
            return httpx.post(
                f"{url}/v1/jobs/lease", json={"sampler_id": sid, "n": n}, headers=as_(sid)
            ).json()["jobs"]

        def pull(step, n=3, wait_s=0):
            body = {"n": n, "step": step, "wait_s": wait_s}
            return httpx.post(f"{url}/v1/batches/pull", json=body, headers=as_(TRAINER))

        first = lease(5)  # (latest + max_staleness + 1) * B = 6 may ever be out at v0
        assert len(first) == 5 and all(j["required_version"] is None for j in first)
        assert len(lease(5)) == 1 and lease(5) == []
        body = {"sampler_id": sid, "group": group(first[0], version=0)}
        assert httpx.post(f"{url}/v1/rollouts", json=body, headers=as_(sid)).json()["stored"]
        assert lease(5) == []  # the pushed group still waits in the buffer
        assert len(pull(0, wait_s=5).json()["groups"]) == 1  # once scored
        assert lease(5) == []  # taken by the trainer, but still counted against v0's budget
        assert pull(0, n=4).status_code == 409  # more than B: the trainer's config differs
        assert publish(url, 1, b"weights 1").status_code == 200
        assert len(lease(5)) == 3  # v1 makes room for one more batch
        for v in (2, 3):
            assert publish(url, v, f"weights {v}".encode()).status_code == 200
        kept = sorted(p.name for p in (tmp_path / "b" / "weights").glob("*.safetensors"))
        assert kept == ["v2.safetensors", "v3.safetensors"]
        assert httpx.get(f"{url}/v1/weights/0", headers=as_(sid)).status_code == 404
    finally:
        stop_broker(proc)


def test_more_hostile_requests_are_refused_without_side_effects(broker):
    """With the table above: 33 distinct malformed or hostile requests, each a 4xx with a reason."""
    import json
    import sqlite3

    url, data = broker
    sid = register(url, "s1")
    publish(url, 0, b"weights")
    job = httpx.post(
        f"{url}/v1/jobs/lease", json={"sampler_id": sid, "n": 1}, headers=as_(sid)
    ).json()["jobs"][0]
    push, h = f"{url}/v1/rollouts", as_(sid)

    def raw(
        body,
    ):  # json.dumps writes NaN, which strict JSON parsers must refuse or validators catch
        return httpx.post(
            push, content=json.dumps(body), headers=h | {"Content-Type": "application/json"}
        )

    c = {"token_ids": [26, 1], "logprobs": [-0.1, -0.2], "finished": True}
    cases = [
        (
            raw(
                {
                    "sampler_id": sid,
                    "group": group(job)
                    | {"completions": [c | {"logprobs": [float("nan"), -0.2]}] * 2},
                }
            ),
            422,
        ),
        (
            raw(
                {
                    "sampler_id": sid,
                    "group": group(job) | {"completions": [c | {"logprobs": [0.5, -0.2]}] * 2},
                }
            ),
            422,
        ),
        (
            raw(
                {
                    "sampler_id": sid,
                    "group": group(job) | {"completions": [c | {"token_ids": [26]}] * 2},
                }
            ),
            422,
        ),
        (
            raw(
                {
                    "sampler_id": sid,
                    "group": group(job) | {"completions": [c] * 3, "rewards": [0] * 3},
                }
            ),
            409,
        ),
        (raw({"sampler_id": sid, "group": group(job) | {"completions": [c] * 3}}), 422),
        (raw({"sampler_id": sid, "group": group(10**6)}), 404),
        (raw({"sampler_id": sid, "group": group(job), "admin": True}), 422),
        (httpx.post(f"{url}/v1/jobs/lease", json={"sampler_id": sid, "n": 10**6}, headers=h), 422),
        (httpx.post(f"{url}/v1/jobs/lease", json={"sampler_id": "ghost", "n": 1}, headers=h), 403),
        (httpx.post(f"{url}/v1/samplers/ghost/heartbeat", json={}, headers=h), 403),
        (httpx.post(f"{url}/v1/batches/pull", json={"n": 0, "step": 0}, headers=as_(TRAINER)), 422),
        (
            httpx.post(
                f"{url}/v1/batches/ack",
                json={"job_ids": [job["job_id"]], "step": -1},
                headers=as_(TRAINER),
            ),
            422,
        ),
        (httpx.put(f"{url}/v1/weights/1", content=b"abc", headers=as_(TRAINER)), 400),
        (httpx.put(f"{url}/v1/weights/1", content=b"abc", headers=h | {"X-Sha256": "0" * 64}), 403),
        (httpx.get(f"{url}/v1/weights/7", headers=h), 404),
        (httpx.get(f"{url}/v1/weights/..%2F..%2Fbroker.sqlite", headers=h), 404),
        (
            httpx.post(
                f"{url}/v1/samplers",
                json={"name": "x", "max_batch": -4, **IDENTITY},
                headers=as_(SAMPLER),
            ),
            422,
        ),
        (httpx.post(f"{url}/v1/samplers", json={"name": "no-identity"}, headers=as_(SAMPLER)), 422),
    ]
    with sqlite3.connect(data / "broker.sqlite") as db:
        jobs_before = list(db.execute("SELECT * FROM jobs"))
        rollouts_before = list(db.execute("SELECT * FROM rollouts"))
    for response, code in cases:
        assert response.status_code == code, (code, response.request.url, response.text)
        assert response.json()["detail"]
    with sqlite3.connect(data / "broker.sqlite") as db:
        assert list(db.execute("SELECT * FROM jobs")) == jobs_before
        assert list(db.execute("SELECT * FROM rollouts")) == rollouts_before


def test_leases_expire_and_unacked_pulls_return_over_http(tmp_path):
    import time

    from tests.integration.conftest import free_port, query, start_broker, stop_broker, wait_until

    proc, url = start_broker(
        tmp_path / "b",
        free_port(),
        "-o",
        "broker.lease_seconds=1",
        "-o",
        "broker.trainer_lease_seconds=1",
        "-o",
        "broker.sampler_timeout=30",
    )
    try:
        publish(url, 0, b"w")
        a = register(url, "a")
        b = register(url, "b")

        def lease(sid, n=1):
            return httpx.post(
                f"{url}/v1/jobs/lease", json={"sampler_id": sid, "n": n}, headers=as_(sid)
            ).json()["jobs"]

        (job,) = lease(a)  # sampler a "dies" holding it
        # The broker's sweep (each second) finds the lease run out: the job is queued again,
        # and `a` barred for one lease period from then.
        sql = "SELECT state FROM jobs WHERE job_id = ?"
        wait_until(lambda: query(tmp_path / "b", sql, job["job_id"]) == [("queued",)], 10)
        assert [j["job_id"] for j in lease(b)] == [job["job_id"]]  # re-leased to b
        assert lease(a) == []  # its lease ran out unpushed: barred for one lease period
        late = httpx.post(
            f"{url}/v1/rollouts", json={"sampler_id": a, "group": group(job)}, headers=as_(a)
        )
        assert late.status_code == 409  # a's lease is gone
        assert httpx.post(
            f"{url}/v1/rollouts", json={"sampler_id": b, "group": group(job)}, headers=as_(b)
        ).json()["stored"]

        def pull(wait_s=0):
            body = {"n": 4, "step": 0, "wait_s": wait_s}
            reply = httpx.post(f"{url}/v1/batches/pull", json=body, headers=as_(TRAINER))
            return [g["job_id"] for g in reply.json()["groups"]]

        assert pull(wait_s=5) == [job["job_id"]]  # scored; the trainer "dies" before acking
        assert pull() == []
        time.sleep(2.5)
        assert pull() == [job["job_id"]]  # offered again, and consumed once
        ack = {"job_ids": [job["job_id"]], "step": 0}
        assert httpx.post(f"{url}/v1/batches/ack", json=ack, headers=as_(TRAINER)).json() == {
            "consumed": 1
        }
        assert httpx.post(f"{url}/v1/batches/ack", json=ack, headers=as_(TRAINER)).json() == {
            "consumed": 0
        }
        status = httpx.get(f"{url}/v1/status", headers=as_(TRAINER)).json()
        assert status["jobs"]["done"] == 1 and status["rollouts"] == {"consumed": 1}
    finally:
        stop_broker(proc)


def test_samplers_get_bf16_weights_while_the_trainer_uploads_fp32(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from echorl.client import BrokerClient
    from echorl.protocol import SamplerInfo
    from tests.integration.conftest import free_port, start_broker, stop_broker

    proc, url = start_broker(tmp_path / "b", free_port(), "-o", "broker.sampler_dtype=bfloat16")
    try:
        weights = {"w": torch.randn(64, 64), "steps": torch.arange(3)}
        save_file(weights, tmp_path / "fp32.safetensors")
        with BrokerClient(url, TRAINER) as trainer, BrokerClient(url, SAMPLER) as sampler:
            trainer.publish(0, tmp_path / "fp32.safetensors")
            sampler.register(SamplerInfo(name="bf16", **IDENTITY))
            latest = sampler.latest()
            assert latest.dtype == "bfloat16"
            got = load_file(sampler.download(latest, tmp_path / "dl.safetensors"))
        assert got["w"].dtype == torch.bfloat16 and got["steps"].dtype == torch.int64
        assert torch.allclose(got["w"].float(), weights["w"], rtol=1e-2)
        assert latest.size_bytes < (tmp_path / "fp32.safetensors").stat().st_size * 0.6
        bad = publish(url, 1, b"not a safetensors file")
        assert bad.status_code == 400 and "cannot cast" in bad.text
        assert httpx.get(f"{url}/v1/weights/latest", headers=as_(TRAINER)).json()["version"] == 0
    finally:
        stop_broker(proc)
