"""Which sampler fetches a weight version from whom: the broker's side of peer fan-out.

Every sampler asks where to fetch a version (`POST /v1/versions/{v}/source`). The broker
serves `broker.peer_fanout` of them itself; after that it names a sampler that holds the
version or is fetching it (a peer passes bytes on as they arrive), breadth first: the
shallowest such sampler with room, each serving at most `peer_fanout`. The version goes
down a tree of depth about log_F(K): the broker's uplink carries it F times, not K.

A peer that failed a sampler (reported with its next ask; a sampler can report only the
source it was given) is not named again for that version, and once it has failed
REPORTERS_TO_DROP different samplers, not at all. A failure downstream of a failed source
is that source's: a peer whose own source failed it (a hostile peer high in the tree cut
it, or sent wrong bytes) starts again and so cuts its own takers; their reports then count
against the source above, not the honest relay, whichever report reaches the broker first.

A peer that passes versions on slowly (a home line's uplink) would hold up its whole
subtree: fan-out 2 under one 5 Mbit/s uplink among 50 Mbit/s links took longer than the
broker alone (bench/fanout.py --slow-uplink). So each sampler tells, with its next ask, how
long its last version took from the source named for it and how fast it passed it on
(`Took`); `Speeds` judges, and a peer found slow is named to nobody for SLOW_VERSIONS
versions (a leaf: it still fetches), then tried again; found slow again, twice as long (up
to SLOW_MAX_VERSIONS). Every peer is named with a `min_rate`, LEAVE_SHARE of the rate the
taker got versions from the broker at (else the median such rate): a taker leaves a peer
slower than that a few seconds in for the broker, unreported, so a slow peer not yet found
out (or tried again) costs its takers seconds, not the whole download. Reports are the
samplers' word: a liar can keep a peer a leaf for a while (its own source only, and only
with a second taker's word), which costs the broker bandwidth, never weights.
"""

from __future__ import annotations

import logging
import secrets
import statistics
import threading
from collections import Counter
from collections.abc import Callable

from echorl.protocol import Took, WeightSource
from echorl.rollout.peers import KEEP, ticket

REPORTERS_TO_DROP = 2  # samplers a peer failed (any versions) before it is never named
VERSIONS_KEPT = 8  # the trees of this many newest versions are kept
SLOW_SHARE = 0.5  # a peer passing versions on at under this share of what it could: slow
SLOW_VERSIONS = 4  # versions a slow peer is named to nobody, before it is tried again ...
SLOW_MAX_VERSIONS = 64  # ... doubled each time it is found slow again, up to this
LEAVE_SHARE = 0.25  # min_rate: this share of the median rate samplers got versions at
MAX_RATE = 1e11  # bytes/s: a report of more is taken as this much
MIN_RATE_RANGE = (64e3, 1e9)  # bytes/s: min_rate is clamped to this, whatever was reported
JUDGE_AFTER = 1  # versions after which a taker's report is judged without its source's

log = logging.getLogger("echorl.broker")

BROKER = "@broker"  # the broker's key among a version's sources (no sampler id has an @)


class FanOut:
    def __init__(self, degree: int, trusted: Callable[[str], bool] = lambda sampler: True):
        """`trusted`: whether a sampler's word counts (`Standing.trusted`): only trusted
        samplers' failure reports drop a peer for good, and only their rates measure lines
        (the `min_rate` peers are named with, what a taker could take)."""
        self.degree = degree
        self.trusted = trusted
        self.peers: dict[str, tuple[str, str]] = {}  # sampler id -> (url, secret)
        self.by_url: dict[str, str] = {}  # url -> sampler id
        # version -> {source: [takers so far, hops from the broker]}: the broker, and the
        # samplers fetching or holding it
        self.sources: dict[int, dict[str, list[int]]] = {}
        self.named_to: dict[tuple[int, str], str] = {}  # (version, asker) -> its source
        self.shunned: dict[int, set[str]] = {}  # version -> peers that failed it
        self.reporters: dict[str, set[str]] = {}  # peer -> the askers it failed
        # (version, peer) -> the source that failed the peer (its failure, passed on)
        self.cut: dict[tuple[int, str], str] = {}
        # (version, peer) -> the takers that reported it failed them
        self.blamed: dict[tuple[int, str], set[str]] = {}
        self.sizes: dict[int, int] = {}  # version -> bytes
        self.speeds = Speeds(trusted)
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

    def tree(self) -> dict[int, dict[str, str]]:
        """The recent versions' fan-out trees: version -> {sampler: the source named to it}."""
        with self.lock:
            trees: dict[int, dict[str, str]] = {}
            for (version, asker), source in self.named_to.items():
                trees.setdefault(version, {})[asker] = source
            return trees

    def forget(self, sampler_id: str) -> None:
        """Gone (left, revoked, quarantined): never named again."""
        with self.lock:
            url, _ = self.peers.pop(sampler_id, ("", ""))
            self.by_url.pop(url, None)
            self.speeds.forget(sampler_id)

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
                return self._name(BROKER, sha256, asker)
            for old in [v for v in self.sources if v <= version - VERSIONS_KEPT]:
                del self.sources[old]
                self.sizes.pop(old, None)
                self.shunned.pop(old, None)
                self.cut = {k: s for k, s in self.cut.items() if k[0] != old}
                self.blamed = {k: s for k, s in self.blamed.items() if k[0] != old}
                self.named_to = {k: s for k, s in self.named_to.items() if k[0] != old}
                self.speeds.prune(old)
            if size:
                self.sizes[version] = size
            if took is not None and self.sizes.get(took.version):
                self._took(asker, took)
            sources = self.sources.setdefault(version, {BROKER: [0, 0]})  # [takers, depth]
            before = self.named_to.get((version, asker))
            if before is not None:
                if failed is None or self.peers.get(before, ("",))[0] != failed:
                    return self._name(before, sha256, asker)  # the same, again
                self._failed(version, before, asker)
            # Samplers keep the versions they hold and fetch (peers.KEEP): older ones, from
            # the broker.
            recent = version > max(self.sources) - KEEP
            # Never a sampler below the asker: it has only what the asker passed on (a peer
            # named again after a cut was named its own taker, which then cut it too).
            shunned = self.shunned.get(version, set()) | self._below(version, asker)
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
                    and not self.speeds.is_slow(s, version)
                )
            ]
            # Breadth first: the shallowest source with room (the broker first), so the tree
            # is as shallow as the fan-out allows. Once every source is full, the broker.
            chosen = min(usable, key=lambda s: (sources[s][1], sources[s][0]), default=BROKER)
            sources[chosen][0] += 1
            self.named_to[(version, asker)] = chosen
            if asker in self.peers and asker not in sources:
                sources[asker] = [0, sources[chosen][1] + 1]
            return self._name(chosen, sha256, asker)

    def _below(self, version: int, peer: str) -> set[str]:
        """The samplers that fetch `version` from `peer`, from them, and so on."""
        takers: dict[str, list[str]] = {}
        for (v, taker), source in self.named_to.items():
            if v == version:
                takers.setdefault(source, []).append(taker)
        below, todo = set(), [peer]
        while todo:
            for taker in takers.get(todo.pop(), []):
                if taker not in below:
                    below.add(taker)
                    todo.append(taker)
        return below

    def _failed(self, version: int, source: str, asker: str) -> None:
        """`asker` reports that `source`, named to it for `version`, failed it."""
        self._blame(version, source, asker)
        if asker in self.peers and self.trusted(asker) and (version, asker) not in self.cut:
            # The asker's takers, cut as it starts again, are its source's failures: those
            # that reported it before this report came are taken back (once a version, and
            # only a trusted asker's word: a sybil could excuse itself every time).
            self.cut[(version, asker)] = source
            self.shunned.get(version, set()).discard(asker)
            for taker in self.blamed.pop((version, asker), set()):
                held = self.reporters.get(asker, set())
                held.discard(taker)
                if not held:
                    self.reporters.pop(asker, None)
                self._blame(version, source, taker)

    def _blame(self, version: int, source: str, taker: str) -> None:
        """`source` failed `taker` at `version`: charged to where the failure began (the
        source itself, or the source up its chain of relays whose own source failed it), which
        is not named for the version again, and with REPORTERS_TO_DROP trusted takers' word
        (two sybils' once did it), never again."""
        seen = {source}
        while (up := self.cut.get((version, source))) is not None and up not in seen:
            source = up
            seen.add(source)
        self.shunned.setdefault(version, set()).add(source)  # anyone's word: a version
        self.blamed.setdefault((version, source), set()).add(taker)
        if self.trusted(taker) and source != BROKER:
            self.reporters.setdefault(source, set()).add(taker)

    def _took(self, asker: str, took: Took) -> None:
        """`asker`'s report on the last version it fetched, to the judge of speeds."""
        source = self.named_to.get((took.version, asker))
        if source is None:
            return  # not named by this broker (or forgotten): nothing to judge
        v = took.version
        takers = [a for (ver, a), s in self.named_to.items() if ver == v and s == asker]
        n_source = self.sources[v][source][0]
        self.speeds.told(asker, took, self.sizes[v], None if source == BROKER else source,
                         n_source, takers)  # fmt: skip

    def _name(self, source: str, sha256: str, asker: str) -> WeightSource:
        if source == BROKER or source not in self.peers:
            self.named["broker"] += 1
            return WeightSource()
        self.named["peer"] += 1
        url, secret = self.peers[source]
        rate = self.speeds.min_rate(asker)
        return WeightSource(url=url, ticket=ticket(secret, sha256), min_rate=rate)


class Speeds:
    """How fast samplers receive versions and pass them on, from what they tell with their
    next ask (`Took`), and which peers are too slow to pass versions on.

    A peer is slow for version v when it passed v on at under SLOW_SHARE of what it could
    have: of the rate it got v at itself (bytes pass on as they come, so a peer is never
    blamed for a slow arrival), and of what its takers' lines can take (the best rate each
    got a version from the broker at, where known: a taker's own slow line blames nobody),
    shared among them. Only rates from the broker measure a line: below a slow peer, every
    rate is slow. Its own word (`served`) is enough; its takers' word needs
    REPORTERS_TO_DROP of them, so one liar cannot make a peer a leaf. A taker's report
    waits for its source's own report of that version, JUDGE_AFTER versions at most (a peer
    that never reports was never judged): then it is judged as if the source had got the
    version at any speed. Only `trusted` samplers' rates measure lines and only their
    takers' word blames (a sybil's 86,400 s download pulled min_rate to 6 B/s, its 1e-6 s
    to 2.5e10 B/s); min_rate is clamped to MIN_RATE_RANGE."""

    def __init__(self, trusted: Callable[[str], bool] = lambda sampler: True):
        self.trusted = trusted
        self.got: dict[tuple[int, str], float] = {}  # (version, sampler) -> bytes/s it got v at
        self.best: dict[str, float] = {}  # sampler -> the fastest it got a version from the broker
        self.own: dict[str, float] = {}  # ... as every sampler tells it (trusted or not)
        self.heard: dict[str, int] = {}  # sampler -> the last version it told of
        # (version, source) -> its takers' (taker, rate, takers of the source), until the
        # source's own report of that version comes
        self.pending: dict[tuple[int, str], list[tuple[str, float, int]]] = {}
        self.blamers: dict[str, set[str]] = {}  # peer -> takers that found it slow
        # peer -> (the version it was found slow at, versions it is a leaf for from then)
        self.slow: dict[str, tuple[int, int]] = {}

    def told(
        self,
        sampler: str,
        took: Took,
        size: int,
        source: str | None,
        n_source: int,
        takers: list[str],
    ) -> None:
        """`sampler` got `took.version` (`size` bytes) in `took.seconds` from `source` (a
        peer, serving `n_source`; None: the broker) and passed it on to `takers` at
        `took.served`. Only its first report of a version counts."""
        v = took.version
        if (v, sampler) in self.got:
            return
        rate = min(size / took.seconds, MAX_RATE)
        self.got[(v, sampler)] = rate
        if source is None:  # a line's speed: the broker's rates
            self.own[sampler] = max(self.own.get(sampler, 0.0), rate)
            if self.trusted(sampler):  # its reports from before it was trusted count not
                self.best[sampler] = max(self.best.get(sampler, 0.0), rate)
        self.heard[sampler] = v
        if took.served is not None and takers:  # its own word
            could = min(rate, sum(self.best.get(t, rate) for t in takers))
            if min(took.served, MAX_RATE) < SLOW_SHARE * could:
                self._found(sampler, v, took.served, could)
        for taker, taker_rate, n in self.pending.pop((v, sampler), []):
            self._judge(v, sampler, taker, taker_rate, n)
        if source is not None and self.trusted(sampler):
            if (v, source) in self.got:
                self._judge(v, source, sampler, rate, n_source)
            else:
                self.pending.setdefault((v, source), []).append((sampler, rate, n_source))
        for (w, peer), waiting in list(self.pending.items()):  # sources that never told
            if w <= v - JUDGE_AFTER:
                del self.pending[(w, peer)]
                self.got.setdefault((w, peer), MAX_RATE)
                for taker, taker_rate, n in waiting:
                    self._judge(w, peer, taker, taker_rate, n)

    def _judge(self, v: int, peer: str, taker: str, rate: float, n: int) -> None:
        """`taker` got v from `peer` at `rate`, `peer` serving `n` takers."""
        could = min(self.got[(v, peer)], self.best.get(taker, MAX_RATE)) / max(n, 1)
        if rate < SLOW_SHARE * could:
            blamers = self.blamers.setdefault(peer, set())
            blamers.add(taker)
            if len(blamers) >= REPORTERS_TO_DROP:
                self._found(peer, v, rate * n, could * n)

    def _found(self, peer: str, version: int, served: float, could: float) -> None:
        last, leaf_for = self.slow.get(peer, (-1, 0))
        if last < version:
            leaf_for = min(2 * leaf_for, SLOW_MAX_VERSIONS) if leaf_for else SLOW_VERSIONS
            self.slow[peer] = (version, leaf_for)
            self.blamers.pop(peer, None)
            log.info(
                "peer %s passed version %d on at %.2f MB/s (it could have at %.2f): named "
                "to nobody for %d versions",
                peer,
                version,
                served / 1e6,
                could / 1e6,
                leaf_for,
            )

    def is_slow(self, peer: str, version: int) -> bool:
        """Found slow at a version w, `peer` is named to nobody for w+1 .. w+leaf_for."""
        found, leaf_for = self.slow.get(peer, (-1, 0))
        return version <= found + leaf_for

    def min_rate(self, taker: str | None = None) -> float | None:
        """LEAVE_SHARE of `taker`'s own line (the best rate it told it got a version from the
        broker at: a cable taker would leave every peer by a datacentre's median, and its
        word moves only its own rule), else of the median line: of the trusted samplers'
        best rates (every rate below a slow peer is slow, so their median would not do),
        or while none is trusted (a swarm's start), of every sampler's."""
        lines = self.best or self.own
        if taker in self.own:
            line = self.own[taker]
        elif lines:
            line = statistics.median(lines.values())
        else:
            return None
        low, high = MIN_RATE_RANGE
        return min(max(LEAVE_SHARE * line, low), high)

    def prune(self, old: int) -> None:
        """Version `old` is forgotten: so are reports of it, and samplers not heard since."""
        self.got = {k: r for k, r in self.got.items() if k[0] > old}
        self.pending = {k: p for k, p in self.pending.items() if k[0] > old}
        for sampler in [s for s, v in self.heard.items() if v <= old]:
            self.forget(sampler)

    def forget(self, sampler: str) -> None:
        self.heard.pop(sampler, None)
        self.best.pop(sampler, None)
        self.own.pop(sampler, None)
        self.blamers.pop(sampler, None)
        self.slow.pop(sampler, None)
