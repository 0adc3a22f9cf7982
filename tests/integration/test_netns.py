"""Samplers behind real slow links (`bench/netns.py`: network namespaces, tc-shaped veth
cables): a cable pulled mid-download, then plugged back, and the download resumes where
it broke off (HTTP Range) and is verified by its sha256; a cable pulled while its sampler
holds a job, and the job is redone by another sampler once the lease runs out, the late
group thrown away when the cable comes back. Skipped where namespaces cannot be made (not
root, no iproute2), with the reason."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from bench.netns import HOST_IP, Net, unavailable
from echorl.client import BrokerClient
from tests.integration.conftest import (
    IDENTITY,
    SAMPLER,
    TRAINER,
    free_port,
    query,
    read_jsonl,
    start_broker,
    start_sampler,
    start_trainer,
    stop_broker,
    wait_until,
)

pytestmark = [pytest.mark.integration, pytest.mark.netns]
if why := unavailable():
    pytestmark.append(pytest.mark.skip(reason=why))

SIZE = 8 << 20  # 3.4 s at 20 Mbit/s

# Run inside the sampler's namespace: register, then download the latest version, noting
# the byte offset each attempt started from.
DOWNLOAD = """
import json, sys
from pathlib import Path
from echorl.client import BrokerClient
from echorl.protocol import SamplerInfo

url, token, identity, dest = sys.argv[1:5]
starts = []
stream = BrokerClient._stream
def noted(self, info, into, peer):
    starts.append(into.have)
    return stream(self, info, into, peer)
BrokerClient._stream = noted
with BrokerClient(url, token, timeout=2.0, retries=30, backoff=0.5) as client:
    client.register(SamplerInfo(name="behind-a-cable", **json.loads(identity)))
    client.download(client.latest(), Path(dest))
print(json.dumps(starts))
"""


def test_a_link_cut_mid_download_resumes_and_the_sha256_matches(tmp_path):
    blob = os.urandom(SIZE)
    (tmp_path / "w.safetensors").write_bytes(blob)
    broker, url = start_broker(tmp_path / "b", free_port(), "-o", "broker.host=0.0.0.0")
    try:
        with BrokerClient(url, TRAINER) as trainer:
            trainer.publish(0, tmp_path / "w.safetensors")
        with Net() as net:
            link = net.add("s0", mbit=20)
            dest = tmp_path / "got.safetensors"
            part = tmp_path / "got.safetensors.part"
            remote = f"http://{HOST_IP}:{url.rsplit(':', 1)[1]}"
            cmd = [sys.executable, "-c", DOWNLOAD, remote, SAMPLER, json.dumps(IDENTITY), str(dest)]
            seen = []

            def pull_the_cable():
                while not part.exists() or part.stat().st_size < SIZE // 4:
                    time.sleep(0.05)
                seen.append(part.stat().st_size)
                link.cut()
                time.sleep(4)  # past the client's 2 s timeout: the transfer breaks off
                link.restore()

            cutter = threading.Thread(target=pull_the_cable, daemon=True)
            cutter.start()
            proc = subprocess.run(link.exec(*cmd), capture_output=True, text=True, timeout=120)
            cutter.join(10)
    finally:
        stop_broker(broker)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    starts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0 < seen[0] < SIZE  # cut mid-transfer
    # The first attempt from 0; every later one resumed from where the bytes stopped.
    assert starts[0] == 0 and len(starts) >= 2 and all(0 < s < SIZE for s in starts[1:]), starts
    assert starts[1] >= seen[0]  # nothing fetched twice
    assert dest.read_bytes() == blob and not part.exists()  # whole, verified, renamed


@pytest.mark.long  # ~60 s: 20 steps, a lease running out, the victim back at work
def test_a_sampler_whose_cable_is_pulled_mid_job_is_replaced(tmp_path):
    """Not a kill: the victim keeps running, cut off. The broker hears nothing, so its lease
    runs out, the job goes to the survivor, and the run goes on; plugged back, the victim
    throws its late group away and works again, nothing consumed twice."""
    from echorl.models import save_tiny_model

    model = save_tiny_model(tmp_path / "v0", "1m", seed=0)
    run = ["-o", "task.name=add", "-o", "train.batch_prompts=4", "-o", "train.group_size=4"]
    run += ["-o", "sampling.max_new_tokens=48", "-o", "train.drop_flat_groups=false"]
    timeouts = ["-o", "broker.lease_seconds=3", "-o", "broker.sampler_timeout=3"]
    data = tmp_path / "b"
    broker, url = start_broker(data, free_port(), "-o", "broker.host=0.0.0.0", *run, *timeouts)
    remote = f"http://{HOST_IP}:{url.rsplit(':', 1)[1]}"
    trainer = samplers = None
    try:
        with Net() as net:
            link = net.add("victim")
            # The victim at a quarter of its speed (a simulated wait after each lease), so it
            # holds its one job most of the time.
            slow = ["--jobs-per-lease", "1", "-o", "sampler.slowdown=4", *run]
            samplers = [
                start_sampler(remote, model, "victim", *slow, inside=link.exec()),
                start_sampler(url, model, "survivor", "--jobs-per-lease", "1", *run),
            ]
            trainer = start_trainer(url, model, tmp_path / "t", "-o", "train.steps=20", *run)
            victim = "(SELECT id FROM samplers WHERE name = 'victim')"
            held = f"SELECT job_id FROM jobs WHERE state = 'leased' AND lease_owner = {victim}"

            def stranded():
                """Pull the cable while the victim holds a job; its jobs a moment later are
                the ones it can no longer deliver (None: it held none; plugged back)."""
                wait_until(lambda: query(data, held), poll=0.005, what="the victim to hold a job")
                link.cut()
                time.sleep(0.5)
                if jobs := [j for (j,) in query(data, held)]:
                    return jobs
                link.restore()

            jobs = wait_until(stranded, what="a job stranded behind the cable")
            status = f"SELECT state FROM samplers WHERE id = {victim}"
            wait_until(lambda: query(data, status) == [("lost",)], what="the victim lost")
            marks = ",".join("?" * len(jobs))
            redone = f"SELECT COUNT(*) FROM jobs WHERE state = 'done' AND job_id IN ({marks})"
            wait_until(lambda: query(data, redone, *jobs) == [(len(jobs),)], what="jobs redone")
            plugged = time.time()
            link.restore()
            back = f"SELECT COUNT(*) FROM rollouts WHERE sampler_id = {victim} AND created_at > ?"
            wait_until(lambda: query(data, back, plugged)[0][0], what="the victim working again")
            assert query(data, status) == [("alive",)]
            out = trainer.communicate(timeout=300)[0]
            assert trainer.returncode == 0, out
    finally:
        for proc in ([trainer] if trainer else []) + (samplers or []):
            if proc.poll() is None:
                proc.terminate()
        logs = [proc.communicate(timeout=60)[0] for proc in samplers or []]
        stop_broker(broker)
    # Every stranded job was delivered once, by the survivor; the victim's late groups refused.
    rows = query(data, f"SELECT job_id, sampler_id = {victim} FROM rollouts")
    assert [(j, 0) for j in jobs] == [(j, mine) for j, mine in rows if j in jobs]
    # The victim threw its late work away: refused by the broker (the job is done) or, in
    # sync, cancelled by the victim itself on hearing a newer version is out.
    late = re.search(r"\((\d+) refused, (\d+) cancelled\)", logs[0])
    assert late and int(late[1]) + int(late[2]) >= len(jobs), logs[0][-3000:]
    consumed = query(
        data,
        "SELECT consumed_step, COUNT(*), COUNT(DISTINCT job_id) FROM "
        "rollouts WHERE state = 'consumed' GROUP BY consumed_step",
    )
    assert consumed == [(s, 4, 4) for s in range(20)]
    assert len(read_jsonl(tmp_path / "t" / "metrics.jsonl")) >= 20


@pytest.mark.long  # ~60 s: CI's second stage (the default suite reached 15:51 with it)
def test_a_sampler_behind_a_slow_link_whose_groups_go_stale_is_named_with_the_cure(tmp_path):
    """Two samplers, async, staleness 1: one on the host, one behind a 6 Mbit/s cable, where
    each version (3.6 MB) takes seconds against a trainer step of a fraction of one. Its
    groups all go stale; `echorl status` names it, with the time a version takes it, and the
    cures (before: a total `stale=115` and the median sampler's fetch time hid it)."""
    from echorl.models import save_tiny_model

    model = save_tiny_model(tmp_path / "v0", "1m", seed=0)
    run = ["-o", "train.batch_prompts=4", "-o", "train.group_size=2", "-o", "broker.mode=async"]
    run += ["-o", "broker.max_staleness=1", "-o", "sampling.max_new_tokens=8"]
    run += ["-o", "train.drop_flat_groups=false", "-o", "train.eval_prompts=4"]
    data = tmp_path / "b"
    broker, url = start_broker(data, free_port(), "-o", "broker.host=0.0.0.0", *run)
    remote = f"http://{HOST_IP}:{url.rsplit(':', 1)[1]}"
    procs = []
    try:
        with Net() as net:
            link = net.add("slowbox", mbit=6)
            procs.append(start_sampler(remote, model, "slowbox", *run, inside=link.exec()))
            procs.append(start_sampler(url, model, "fastbox", *run))
            procs.append(
                start_trainer(url, model, tmp_path / "t", "-o", "train.steps=100000", *run)
            )
            account = "SELECT pushed, stale FROM samplers WHERE name = 'slowbox'"
            wait_until(
                lambda: (query(data, account) or [(0, 0)])[0][1] >= 8,
                timeout=240,
                what="8 of the slow sampler's groups dropped stale",
            )
            env = os.environ | {"ECHORL_TOKEN": TRAINER, "COLUMNS": "400"}
            shown = subprocess.run(
                [sys.executable, "-m", "echorl.cli", "status", "--broker", url],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
            proc.communicate(timeout=60)
        stop_broker(broker)
    said = " ".join(shown.split())
    line = re.search(
        r"slowbox \(\w+\): (all|\d+) of its \d+ groups dropped stale: a version "
        r"takes it ([\d.]+) s against a ([\d.]+) s step; try [^\n]*",
        said,
    )
    assert line, said
    assert float(line.group(2)) > 3 * float(line.group(3))
    assert "broker.sampler_dtype=bfloat16" in line.group(0) and "sampler.serve_peers" in line.group(
        0
    )
    assert "broker.max_staleness >=" in line.group(0)
    assert [w for w in shown.splitlines() if "dropped stale" in w and "fastbox" in w] == []
