"""Fixtures that start real broker processes on loopback ports."""

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

TRAINER, SAMPLER = "t" * 32, "s" * 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def start_sampler(url, model, name, *args):
    """Start `echorl sampler` against `url` with one torch thread; returns the process."""
    env = os.environ | {"ECHORL_SAMPLER_TOKEN": SAMPLER}
    cmd = [
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
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def register(url, name="s1", **info) -> str:
    """Register a sampler over HTTP; returns its id."""
    reply = httpx.post(
        f"{url}/v1/samplers",
        json={"name": name, **info},
        headers={"Authorization": f"Bearer {SAMPLER}"},
    )
    return reply.json()["sampler_id"]


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
