"""A weight version's bytes in transit: `Partial` receives them (in memory, or in a file for
large weights), hashes them as they come, survives a cut (the next request resumes from what
is in), and lets others read them meanwhile (a sampler passes a version on to its peers while
it is still arriving: echorl/rollout/peers.py)."""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from pathlib import Path

import numpy as np

WAIT_S = 30.0  # a reader waits this long for the next bytes of a version still arriving


class Partial:
    """The bytes of the version with `sha256` and `size`, as far as they have come."""

    def __init__(self, sha256: str, size: int, path: Path | None = None):
        self.sha256, self.size, self.path = sha256, size, path
        self.data = bytearray() if path is None else None
        self.hasher = hashlib.sha256()
        self.file = None
        if path is not None:  # a file: resume what an earlier attempt left
            if path.exists():
                with path.open("rb") as f:
                    while block := f.read(1 << 20):
                        self.hasher.update(block)
            self.file = path.open("ab")
        self.have = self.file.tell() if self.file else 0
        self.generation = 0  # bumped by each restart: a reader of the old bytes is cut off
        self.failed = False
        self.changed = threading.Condition()

    # -- the writer: one download, possibly over several requests ------------------------------

    def write(self, chunk: bytes) -> None:
        self.hasher.update(chunk)
        if self.file is not None:
            self.file.write(chunk)
            self.file.flush()  # readers read the file
        else:
            self.data += chunk
        with self.changed:
            self.have += len(chunk)
            self.changed.notify_all()

    def restart(self) -> None:
        """Drop what arrived (a source sent it all again, or it was wrong). With nothing in,
        nothing changes: readers already waiting for the first bytes stay."""
        with self.changed:
            if self.have == 0:
                return
            if self.file is not None:
                self.file.truncate(0)
                self.file.seek(0)
            else:
                del self.data[:]
            self.have = 0
            self.generation += 1
            self.hasher = hashlib.sha256()
            self.changed.notify_all()

    @property
    def whole(self) -> bool:
        """Every byte in, and the right ones."""
        return self.have == self.size and self.hasher.hexdigest() == self.sha256

    def fail(self) -> None:
        """Given up: readers waiting for more are cut off."""
        with self.changed:
            self.failed = True
            self.changed.notify_all()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def value(self) -> bytes:
        return bytes(self.data) if self.data is not None else self.path.read_bytes()

    # -- readers -------------------------------------------------------------------------------

    def read(self, offset: int, n: int, generation: int) -> bytes:
        """Up to `n` bytes from `offset`, waiting (up to WAIT_S) while they are still to come;
        b"" where the version ends, or once the download failed or restarted since the
        reader began (at `generation`): the bytes it has are not this download's."""

        def over() -> bool:
            return self.failed or self.generation != generation

        with self.changed:
            self.changed.wait_for(lambda: self.have > offset or over(), timeout=WAIT_S)
            end = min(self.have, offset + n)
            if over() or end <= offset:
                return b""
            if self.data is not None:
                return bytes(self.data[offset:end])
        with self.path.open("rb") as f:
            return os.pread(f.fileno(), end - offset, offset)


# -- deltas: a version as the 16-bit words that changed since the one a sampler holds ----------
#
# bf16 weights after one small optimiser step differ from the last version in few words (most
# updates are below bf16's resolution): a delta lists them (word indices, gap-coded, and their
# new values), zlib-compressed. It is applied to the held version's bytes, and the result must
# hash to the new version's sha256, so a delta needs no trust of its own.

DELTA_MAX_SHARE = 0.5  # a delta is worth keeping only below this share of the full version


def make_delta(old: bytes, new: bytes) -> bytes | None:
    """`new` as a delta against `old`, or None where there is none worth having (sizes
    differ, odd lengths, or too many words changed)."""
    if len(old) != len(new) or len(new) % 2 or len(new) >= 1 << 33:
        return None
    a, b = np.frombuffer(old, "<u2"), np.frombuffer(new, "<u2")
    most = int(DELTA_MAX_SHARE * len(new) / 6)  # 6 bytes a changed word, before compression
    changed = 0
    for i in range(0, len(a), 1 << 24):  # counted by pieces: given up early, memory bounded
        changed += int(np.count_nonzero(a[i : i + (1 << 24)] != b[i : i + (1 << 24)]))
        if changed > most:
            return None
    idx = np.flatnonzero(a != b)
    gaps = np.diff(idx, prepend=0).astype("<u4")
    raw = len(idx).to_bytes(8, "little") + gaps.tobytes() + b[idx].tobytes()
    blob = zlib.compress(raw, 1)
    return blob if len(blob) <= DELTA_MAX_SHARE * len(new) else None


def apply_delta(old: bytes, delta: bytes) -> bytes:
    """The version `delta` was made for, from `old`; ValueError if it does not fit. Inflated
    at most to what a delta of `old` can be (every word changed: 8 + 3 x its bytes), so a
    zlib bomb costs its first bytes past that, not the memory it asks for."""
    most = 8 + 3 * len(old)
    inflate = zlib.decompressobj()
    try:
        raw = inflate.decompress(delta, most + 1)
    except zlib.error as e:
        raise ValueError(f"not a delta: {e}") from None
    if len(raw) > most or inflate.unconsumed_tail:
        raise ValueError(f"a delta inflating past {most} bytes, the most one of these weights is")
    n = int.from_bytes(raw[:8], "little")
    if len(raw) != 8 + 6 * n:
        raise ValueError("a delta of the wrong length")
    idx = np.cumsum(np.frombuffer(raw, "<u4", n, 8), dtype=np.int64)
    words = np.frombuffer(old, "<u2").copy()
    if n and idx[-1] >= len(words):
        raise ValueError("a delta for larger weights")
    words[idx] = np.frombuffer(raw, "<u2", n, 8 + 4 * n)
    return words.tobytes()
