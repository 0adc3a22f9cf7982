"""Samplers behind real slow links, on one machine: Linux network namespaces joined by a
bridge, each link shaped with `tc` tbf (root, `ip` and `tc`; netem is not needed).

    hub namespace: bridge ── veth ── root namespace (the broker, HOST_IP; its uplink shaped)
                          ├─ veth ── sampler namespace 1 (its download and upload shaped)
                          └─ veth ── sampler namespace 2 ...

Everything stays on this machine: the namespaces have no route out, and the root side only
gains one address on its own veth. Used by bench/swarm.py (`--netns`) and the tests marked
`netns`, which skip with `unavailable()`'s reason where namespaces cannot be made.

    with Net(broker_mbit=100) as net:
        link = net.add("s0", mbit=20)
        subprocess.run(link.exec(sys.executable, "-m", "echorl.cli", "sampler", ...))
        link.cut(); ...; link.restore()   # the sampler's cable pulled, then plugged back
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

SUBNET = "10.78.0"
HOST_IP = f"{SUBNET}.1"  # the root namespace (broker, trainer) as the samplers see it


def sh(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")


def unavailable() -> str | None:
    """Why namespaces with shaped links cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2)"
    probe = f"echorl-probe-{os.getpid()}"
    try:
        sh("ip", "netns", "add", probe)
    except RuntimeError as e:
        return f"cannot make a network namespace: {e}"
    sh("ip", "netns", "del", probe)
    return None


def shape(ns: str | None, dev: str, mbit: float) -> None:
    """Limit what `dev` sends to `mbit` Mbit/s (token bucket, a 10 ms burst)."""
    burst = max(16_000, int(mbit * 1e6 / 8 / 100))
    cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit"]
    cmd += ["burst", str(burst), "latency", "200ms"]
    sh(*(["ip", "netns", "exec", ns] if ns else []), *cmd)


@dataclass
class Link:
    """One sampler's namespace and its cable to the hub."""

    ns: str
    ip: str
    hub: str  # the hub's namespace
    hub_dev: str  # the cable's end in the hub (shaped: what the sampler downloads)

    def exec(self, *cmd: str) -> list[str]:
        """`cmd` as run inside this namespace."""
        return ["ip", "netns", "exec", self.ns, *cmd]

    def cut(self) -> None:
        """Pull the cable: nothing passes until `restore`."""
        sh("ip", "netns", "exec", self.hub, "ip", "link", "set", self.hub_dev, "down")

    def restore(self) -> None:
        sh("ip", "netns", "exec", self.hub, "ip", "link", "set", self.hub_dev, "up")


class Net:
    """The hub and the root namespace's cable to it; `add` plugs in a sampler namespace."""

    def __init__(self, broker_mbit: float | None = None):
        self.broker_mbit = broker_mbit
        self.tag = f"er{os.getpid() % 100000}"  # interface names: 15 characters at most
        self.hub = f"{self.tag}-hub"
        self.links: list[Link] = []

    def __enter__(self) -> Net:
        try:
            sh("ip", "netns", "add", self.hub)
            self._in_hub("ip", "link", "add", "br0", "type", "bridge")
            self._in_hub("ip", "link", "set", "br0", "up")
            root, peer = f"{self.tag}r", f"{self.tag}rh"
            sh("ip", "link", "add", root, "type", "veth", "peer", "name", peer)
            self._plug(peer)
            sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", root)
            sh("ip", "link", "set", root, "up")
            if self.broker_mbit:
                shape(None, root, self.broker_mbit)  # the broker's uplink, shared by all
        except BaseException:
            self.__exit__()
            raise
        return self

    def add(self, name: str, mbit: float | None = None, up_mbit: float | None = None) -> Link:
        """A namespace for one sampler, on the hub at `SUBNET.(10 + k)`, its link limited to
        `mbit` Mbit/s each way (None: as fast as the machine), or to `up_mbit` for what it
        sends (a home line's slow uplink)."""
        k = len(self.links)
        ns, dev, peer = f"{self.tag}-{name}", f"{self.tag}s{k}", f"{self.tag}h{k}"
        ip = f"{SUBNET}.{10 + k}"
        sh("ip", "netns", "add", ns)
        link = Link(ns, ip, self.hub, peer)
        self.links.append(link)
        sh("ip", "link", "add", dev, "type", "veth", "peer", "name", peer)
        self._plug(peer)
        sh("ip", "link", "set", dev, "netns", ns)
        for cmd in (
            ["ip", "addr", "add", f"{ip}/24", "dev", dev],
            ["ip", "link", "set", dev, "up"],
            ["ip", "link", "set", "lo", "up"],
        ):
            sh(*link.exec(*cmd))
        if mbit:
            shape(self.hub, peer, mbit)  # to the sampler: its downloads
        if up_mbit or mbit:
            shape(ns, dev, up_mbit or mbit)  # from it: its pushes, what it serves peers
        return link

    def _plug(self, dev: str) -> None:
        """Move `dev` into the hub and onto its bridge."""
        sh("ip", "link", "set", dev, "netns", self.hub)
        self._in_hub("ip", "link", "set", dev, "master", "br0")
        self._in_hub("ip", "link", "set", dev, "up")

    def _in_hub(self, *cmd: str) -> None:
        sh("ip", "netns", "exec", self.hub, *cmd)

    def __exit__(self, *exc) -> None:
        """Remove every namespace (their cables go with them, the root's end too)."""
        for ns in [link.ns for link in self.links] + [self.hub]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{self.tag}r"], capture_output=True)
