"""Which sampler fetches a weight version from whom: the broker's side of peer fan-out.

Every sampler asks where to fetch a version (`POST /v1/versions/{v}/source`). The broker
serves `broker.peer_fanout` of them itself; after that it names a sampler that holds the
version or is fetching it (a peer passes bytes on as they arrive), breadth first: the
shallowest such sampler with room, each serving at most `peer_fanout`. The version goes
down a tree of depth about log_F(K): the broker's uplink carries it F times, not K.

A peer that failed a sampler (reported with its next ask; a sampler can report only the
source it was given) is not named again for that version, and once it has failed
REPORTERS_TO_DROP different samplers, not at all. Kept in memory only: after a broker
restart, samplers fetch from the broker until they register again (their peer secrets went
with it).
"""

from __future__ import annotations

import secrets
import threading
from collections import Counter

from echorl.protocol import WeightSource
from echorl.rollout.peers import KEEP, ticket

REPORTERS_TO_DROP = 2  # samplers a peer failed (any versions) before it is never named
VERSIONS_KEPT = 8  # the trees of this many newest versions are kept

BROKER = "@broker"  # the broker's key among a version's sources (no sampler id has an @)


class FanOut:
    def __init__(self, degree: int):
        self.degree = degree
        self.peers: dict[str, tuple[str, str]] = {}  # sampler id -> (url, secret)
        self.by_url: dict[str, str] = {}  # url -> sampler id
        # version -> {source: [takers so far, hops from the broker]}: the broker, and the
        # samplers fetching or holding it
        self.sources: dict[int, dict[str, list[int]]] = {}
        self.named_to: dict[tuple[int, str], str] = {}  # (version, asker) -> its source
        self.shunned: dict[int, set[str]] = {}  # version -> peers that failed it
        self.reporters: dict[str, set[str]] = {}  # peer -> the askers it failed
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
        """Where `asker` fetches `version` (weights `sha256`); it becomes a source of it. Asked
        again, the same answer (no second place in the tree), unless it reports that source
        `failed`: only the source named to it counts, so a sampler can shun no other."""
        with self.lock:
            if self.degree == 0:
                return self._name(BROKER, sha256)
            for old in [v for v in self.sources if v <= version - VERSIONS_KEPT]:
                del self.sources[old]
                self.shunned.pop(old, None)
                self.named_to = {k: s for k, s in self.named_to.items() if k[0] != old}
            sources = self.sources.setdefault(version, {BROKER: [0, 0]})  # [takers, depth]
            before = self.named_to.get((version, asker))
            if before is not None:
                if failed is None or self.peers.get(before, ("",))[0] != failed:
                    return self._name(before, sha256)  # the same, again
                self.shunned.setdefault(version, set()).add(before)
                self.reporters.setdefault(before, set()).add(asker)
            # Samplers keep the versions they hold and fetch (peers.KEEP): older ones, from
            # the broker.
            recent = version > max(self.sources) - KEEP
            shunned = self.shunned.get(version, set())
            usable = [
                s
                for s, (takers, _) in sources.items()
                if takers < self.degree
                and s != asker
                and (
                    s == BROKER
                    or recent
                    and s in self.peers
                    and s not in shunned
                    and len(self.reporters.get(s, ())) < REPORTERS_TO_DROP
                )
            ]
            # Breadth first: the shallowest source with room (the broker first), so the tree
            # is as shallow as the fan-out allows. Once every source is full, the broker.
            chosen = min(usable, key=lambda s: (sources[s][1], sources[s][0]), default=BROKER)
            sources[chosen][0] += 1
            self.named_to[(version, asker)] = chosen
            if asker in self.peers and asker not in sources:
                sources[asker] = [0, sources[chosen][1] + 1]
            return self._name(chosen, sha256)

    def _name(self, source: str, sha256: str) -> WeightSource:
        if source == BROKER or source not in self.peers:
            self.named["broker"] += 1
            return WeightSource()
        self.named["peer"] += 1
        url, secret = self.peers[source]
        return WeightSource(url=url, ticket=ticket(secret, sha256))
