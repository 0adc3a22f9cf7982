"""Samplers behind real slow links (`bench/netns.py`: network namespaces, tc-shaped veth
cables): a cable pulled mid-download, then plugged back, and the download resumes where
it broke off (HTTP Range) and is verified by its sha256. Skipped where namespaces cannot
be made (not root, no iproute2), with the reason."""

import json
import os
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
    start_broker,
    stop_broker,
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
