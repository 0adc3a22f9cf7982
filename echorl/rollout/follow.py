"""Follow the broker's weight versions in a backend: download, verify, load in place.

A sampler holds the version its jobs need; an auditor the version whose groups it checks.
Both ask for a version by number and get it loaded unless it is already held. Weights are
known by sha256 too (a resumed trainer may re-publish a number with other weights). An
adapter version (LoRA) is applied on its full base version, loaded first if need be;
adapters still resident in the backend cost nothing. The bytes come from where the broker
says: itself, or a peer already holding or fetching the version (echorl/rollout/peers.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from safetensors.torch import load, load_file

from echorl.client import BrokerClient, BrokerError
from echorl.protocol import Took, WeightVersion
from echorl.rollout.backend import Backend
from echorl.rollout.peers import Shelf, obtain, with_served
from echorl.transfer import Partial, apply_delta

log = logging.getLogger("echorl.weights")

IN_MEMORY_BYTES = 256 << 20  # weights up to this size are fetched into memory, not to disk


class WeightFollower:
    def __init__(
        self,
        client: BrokerClient,
        backend: Backend,
        cache: Path,
        name: str = "",
        shelf: Shelf | None = None,
    ):
        """`shelf`: where the versions fetched are kept for peers (a sampler that serves them)."""
        self.client, self.backend, self.cache, self.name = client, backend, cache, name
        self.shelf = shelf
        self.held: tuple[int, str] | None = None  # (version, sha256) in use now
        self.base: tuple[int, str] | None = None  # the full version under the adapters
        self.adapters: dict[int, str] = {}  # resident adapter versions -> sha256
        self.base_bytes: bytes | None = None  # the full version's, for deltas (in memory only)
        self.downloaded = 0  # bytes of weights fetched
        self.delta_bytes = 0  # of them, bytes of deltas
        self.from_peers = 0  # of them, bytes from peers
        self.peer_failures = 0  # peers that did not deliver
        # The last whole download's time from its source, and that version's sha256: told
        # with the next ask, with how fast this sampler passed it on (if it serves peers).
        self.took: tuple[Took, str] | None = None
        cache.mkdir(parents=True, exist_ok=True)

    @property
    def version(self) -> int | None:
        return None if self.held is None else self.held[0]

    def ensure(self, version: int, known: WeightVersion | None = None) -> float:
        """Hold `version` unless already held; returns the seconds spent. `known`: the
        broker's description of a version, if the caller has it (it came with a lease)."""
        info = known if known is not None and known.version == version else None
        info = info or self.client.describe(version)
        if self.held == (version, info.sha256):
            return 0.0
        t0 = time.perf_counter()
        if info.kind == "lora":
            self._hold_base(self.client.describe(info.base))
            if self.adapters.get(version) == info.sha256 and version in self.backend.adapters:
                self.backend.use_adapter(version)
            else:
                self.backend.load_adapter(version, self._fetch(info), info.lora)
                resident = set(self.backend.adapters)
                self.adapters = {v: h for v, h in self.adapters.items() if v in resident}
                self.adapters[version] = info.sha256
        else:
            self._hold_base(info)
            self.backend.use_adapter(None)
        self.held = (version, info.sha256)
        log.info("%s: now holds version %d (%s)", self.name, version, info.kind)
        return time.perf_counter() - t0

    def _hold_base(self, info: WeightVersion) -> None:
        """Full version `info` in the backend (its adapters go with the old one)."""
        if self.base != (info.version, info.sha256):
            self.backend.load_weights(self._fetch(info, full=True))
            self.base, self.adapters = (info.version, info.sha256), {}

    def _fetch(self, info: WeightVersion, full: bool = False) -> dict[str, torch.Tensor]:
        """The tensors of `info`, verified against its sha256 on the way; on the shelf for
        peers (while they arrive, and after) if this sampler serves them. A `full` version
        comes as a delta against the one held where the broker has one."""
        big = info.size_bytes > IN_MEMORY_BYTES  # streamed to disk (resumable), then mapped
        if full and (part := self._from_delta(info)) is not None:
            if self.shelf is not None:
                self.shelf.put(part)
            self.base_bytes = part.value()
            return load(self.base_bytes)
        self.downloaded += info.size_bytes
        part = Partial(
            info.sha256, info.size_bytes, self.cache / f"{info.sha256}.part" if big else None
        )
        if self.shelf is not None:
            self.shelf.put(part)
        try:
            self._receive(info, part)
        except BaseException:
            part.fail()
            if self.shelf is not None:
                self.shelf.drop(info.sha256)
            raise
        finally:
            part.close()
        if not big:
            data = part.value()
            self.base_bytes = data if full else self.base_bytes
            return load(data)
        self.base_bytes = None if full else self.base_bytes
        weights = load_file(part.path)
        if self.shelf is None:
            part.path.unlink()  # else the shelf deletes it when the version goes
        return weights

    def _from_delta(self, info: WeightVersion) -> Partial | None:
        """`info`'s bytes, whole, from the held full version and the broker's delta; None
        where there is no delta for it, or it does not reproduce `info`'s sha256 (then the
        whole version is fetched)."""
        if info.delta_base is None or self.base_bytes is None or self.base is None:
            return None
        if self.base[0] != info.delta_base:
            return None
        try:
            delta = self.client.fetch_delta(info.version)
            data = apply_delta(self.base_bytes, delta)
        except (BrokerError, ValueError) as e:
            log.warning(
                "%s: no delta for version %d (%s); fetching it whole", self.name, info.version, e
            )
            return None
        self.downloaded += len(delta)
        part = Partial(info.sha256, info.size_bytes)
        part.write(data)  # hashed on the way in, as every download
        if not part.whole:
            log.warning(
                "%s: the delta for version %d does not reproduce it; fetching it whole",
                self.name,
                info.version,
            )
            return None
        self.delta_bytes += len(delta)
        return part

    def report(self) -> Took | None:
        """What the broker hears with the next ask: how long the last version took from its
        source, and how fast this sampler passed it on to peers (broker/fanout.py)."""
        if self.took is None:
            return None
        took, sha256 = self.took
        return with_served(took, self.shelf, sha256)

    def _receive(self, info: WeightVersion, part: Partial) -> None:
        got = obtain(self.client, info, part, self.name, self.report())
        self.took = (got.took, info.sha256)
        self.from_peers += info.size_bytes if got.peer else 0
        self.peer_failures += got.failures
