"""Which sampler fetches a weight version from whom: the broker's side of peer fan-out.

Every sampler asks where to fetch a version (`POST /v1/versions/{v}/source`). The broker
serves `broker.peer_fanout` of them itself; after that it names a sampler that holds the
version or is fetching it (a peer passes bytes on as they arrive), breadth first: the
shallowest such sampler with room, each serving at most `peer_fanout`. The version goes
down a tree of depth about log_F(K): the broker's uplink carries it F times, not K.

A peer that failed a sampler (reported with its next ask; a sampler can report only the
source it was given) is not named again for that version, and once it has failed
REPORTERS_TO_DROP different samplers, not at all.

A peer that passes versions on slowly (a home line's uplink) would hold up its whole
subtree: fan-out 2 under one 5 Mbit/s uplink among 50 Mbit/s links took longer than the
broker alone (bench/fanout.py --slow-uplink). So each sampler tells, with its next ask, how
long its last version took from the source named for it. A peer whose takers together got
under SLOW_SHARE of the rate it received at itself is named to nobody for SLOW_VERSIONS
versions (a leaf: it still fetches), then tried again; found slow again, for twice as
long (up to SLOW_MAX_VERSIONS). Until a slow peer is found out (the first version it
passes on, and each retry), its takers are told a `min_rate`, half the median rate samplers
got their last versions at: a peer slower than that a few seconds in is left for the broker
(unreported, since it may only be passing on a slow arrival; its own word and its takers'
times then find it out). A taker's rate is bounded by its
source's own arrival (bytes pass on as they come), so a slow peer's grandchildren do not
blame their healthy parents. A sampler can so report only the source named to it; a liar
can make that one peer a leaf for a while, which costs the broker bandwidth, never weights. Kept in memory only: after a broker
restart, samplers fetch from the broker until they register again (their peer secrets went
with it).
"""

from __future__ import annotations

import logging
import secrets
import statistics
import threading
from collections import Counter

from echorl.protocol import Took, WeightSource
from echorl.rollout.peers import KEEP, ticket

REPORTERS_TO_DROP = 2  # samplers a peer failed (any versions) before it is never named
VERSIONS_KEPT = 8  # the trees of this many newest versions are kept
SLOW_SHARE = 0.5  # a peer's takers together under this share of its own rate: slow
SLOW_VERSIONS = 4  # versions a slow peer is named to nobody, before it is tried again ...
SLOW_MAX_VERSIONS = 64  # ... doubled each time it is found slow again, up to this

log = logging.getLogger("echorl.broker")

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
        self.sizes: dict[int, int] = {}  # version -> bytes
        self.rate: dict[str, float] = {}  # sampler -> bytes/s its last version arrived at
        # peer -> (the last version it passed on slowly, versions it is a leaf for from then)
        self.slow: dict[str, tuple[int, int]] = {}
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
            self.rate.pop(sampler_id, None)

    def source(
        self,
        version: int,
        sha256: str,
        asker: str,
        failed: str | None,
        size: int = 0,
        took: Took | None = None,
    ) -> WeightSource:
        """Where `asker` fetches `version` (weights `sha256`, `size` bytes); it becomes a
        source of it. Asked again, the same answer (no second place in the tree), unless it
        reports that source `failed`: only the source named to it counts, so a sampler can
        shun no other. `took`: its last version's time from the source named for it."""
        with self.lock:
            if self.degree == 0:
                return self._name(BROKER, sha256)
            for old in [v for v in self.sources if v <= version - VERSIONS_KEPT]:
                del self.sources[old]
                self.sizes.pop(old, None)
                self.shunned.pop(old, None)
                self.named_to = {k: s for k, s in self.named_to.items() if k[0] != old}
            if size:
                self.sizes[version] = size
            if took is not None:
                self._took(asker, took)
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
                    and sum(self.slow.get(s, (-1, 0))) <= version
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

    def _took(self, asker: str, took: Took) -> None:
        """`asker` received `took.version` in `took.seconds` from the source named for it and
        passed it on at `took.served`: its own rate, and verdicts on it and on its source."""
        source = self.named_to.get((took.version, asker))
        if source is None or not self.sizes.get(took.version):
            return  # not named by this broker (or forgotten): nothing to judge
        rate = self.sizes[took.version] / took.seconds
        self.rate[asker] = rate
        served_by = self.sources[took.version]
        # Its own word: it passed the version on slower than it got it (timely: told before
        # it takes a place in the next version's tree).
        told = took.served
        if told is not None and served_by.get(asker, [0])[0] and told < SLOW_SHARE * rate:
            self._slow(asker, took.version, told, rate)
        # Its source's takers' word (a peer that claims to be fast is found out by them): a
        # taker gets at most what its source receives, so its own takers do not blame it.
        own = self.rate.get(source)
        if source != BROKER and own is not None:
            takers = served_by[source][0]
            if rate * takers < SLOW_SHARE * own:
                self._slow(source, took.version, rate * takers, own)

    def _slow(self, peer: str, version: int, served: float, own: float) -> None:
        last, leaf_for = self.slow.get(peer, (-1, 0))
        if last < version:
            leaf_for = min(2 * leaf_for, SLOW_MAX_VERSIONS) if leaf_for else SLOW_VERSIONS
            self.slow[peer] = (version, leaf_for)
            log.info(
                "peer %s passed version %d on at %.1f MB/s (it got it at %.1f): named to "
                "nobody for %d versions",
                peer,
                version,
                served / 1e6,
                own / 1e6,
                leaf_for,
            )

    def _name(self, source: str, sha256: str) -> WeightSource:
        if source == BROKER or source not in self.peers:
            self.named["broker"] += 1
            return WeightSource()
        self.named["peer"] += 1
        url, secret = self.peers[source]
        # Leave a peer much slower than samplers got their last versions at (a slow uplink
        # not yet found out) for the broker.
        typical = statistics.median(self.rate.values()) if len(self.rate) >= 2 else None
        floor = SLOW_SHARE * typical if typical else None
        return WeightSource(url=url, ticket=ticket(secret, sha256), min_rate=floor)
