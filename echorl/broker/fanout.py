"""Which sampler fetches a weight version from whom: the broker's side of peer fan-out.

Every sampler asks where to fetch a version (`POST /v1/versions/{v}/source`). The broker
serves `broker.peer_fanout` of them itself; after that it names a sampler that holds the
version or is fetching it (a peer passes bytes on as they arrive), breadth first: the
shallowest such sampler with room, each serving at most `peer_fanout`. The version goes
down a tree of depth about log_F(K): the broker's uplink carries it F times, not K.

A peer that failed a sampler (reported with its next ask) is not named again for that
version, and after FAILURES_TO_DROP failures not at all. Kept in memory only: after a broker
restart, samplers fetch from the broker until they register again (their peer secrets went
with it).
"""

from __future__ import annotations

import secrets
import threading
from collections import Counter

from echorl.protocol import WeightSource
from echorl.rollout.peers import ticket

FAILURES_TO_DROP = 2  # failed deliveries (any versions) after which a peer is never named
VERSIONS_KEPT = 8  # the trees of this many newest versions are kept

BROKER = ""  # the broker's key among a version's sources


class FanOut:
    def __init__(self, degree: int):
        self.degree = degree
        self.peers: dict[str, tuple[str, str]] = {}  # sampler id -> (url, secret)
        self.by_url: dict[str, str] = {}  # url -> sampler id
        # version -> {source: [takers so far, hops from the broker]}: the broker, and the
        # samplers fetching or holding it
        self.sources: dict[int, dict[str, list[int]]] = {}
        self.shunned: dict[int, set[str]] = {}  # version -> peers that failed it
        self.failures: Counter[str] = Counter()
        self.named = Counter()  # "broker" / "peer": how often each was named
        self.lock = threading.Lock()

    def join(self, sampler_id: str, url: str) -> str:
        """A sampler that serves peers at `url`; returns the secret its tickets are made under."""
        secret = secrets.token_hex(32)
        with self.lock:
            self.by_url.pop(self.peers.get(sampler_id, ("",))[0], None)
            self.peers[sampler_id] = (url, secret)
            self.by_url[url] = sampler_id
        return secret

    def forget(self, sampler_id: str) -> None:
        """Gone (left, revoked, quarantined): never named again."""
        with self.lock:
            url, _ = self.peers.pop(sampler_id, ("", ""))
            self.by_url.pop(url, None)

    def source(self, version: int, sha256: str, asker: str, failed: str | None) -> WeightSource:
        """Where `asker` fetches `version` (weights `sha256`); it becomes a source of it."""
        with self.lock:
            if self.degree == 0:
                self.named["broker"] += 1
                return WeightSource()
            for old in [v for v in self.sources if v <= version - VERSIONS_KEPT]:
                del self.sources[old]
                self.shunned.pop(old, None)
            sources = self.sources.setdefault(version, {BROKER: [0, 0]})  # [takers, depth]
            if failed and (peer := self.by_url.get(failed)):
                self.shunned.setdefault(version, set()).add(peer)
                self.failures[peer] += 1
            shunned = self.shunned.get(version, set())
            usable = [
                s
                for s, (takers, _) in sources.items()
                if takers < self.degree
                and s != asker
                and (s == BROKER or (s in self.peers and s not in shunned))
                and self.failures[s] < FAILURES_TO_DROP
            ]
            # Breadth first: the shallowest source with room (the broker first), so the tree
            # is as shallow as the fan-out allows. Once every source is full, the broker.
            chosen = min(usable, key=lambda s: (sources[s][1], sources[s][0]), default=BROKER)
            sources[chosen][0] += 1
            if asker in self.peers and asker not in sources:
                sources[asker] = [0, sources[chosen][1] + 1]
            if chosen == BROKER:
                self.named["broker"] += 1
                return WeightSource()
            self.named["peer"] += 1
            url, secret = self.peers[chosen]
            return WeightSource(url=url, ticket=ticket(secret, sha256))
