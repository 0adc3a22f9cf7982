"""A weight version's bytes in transit: `Partial` receives them (in memory, or in a file for
large weights), hashes them as they come, survives a cut (the next request resumes from what
is in), and lets others read them meanwhile (a sampler passes a version on to its peers while
it is still arriving: echorl/rollout/peers.py)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

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
        """Drop what arrived (a source sent it all again, or it was wrong)."""
        with self.changed:
            if self.file is not None:
                self.file.truncate(0)
                self.file.seek(0)
            else:
                del self.data[:]
            self.have = 0
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

    def read(self, offset: int, n: int) -> bytes:
        """Up to `n` bytes from `offset`, waiting (up to WAIT_S) while they are still to come;
        b"" where the version ends, or once the download failed or went back before `offset`."""
        with self.changed:
            self.changed.wait_for(lambda: self.have > offset or self.failed, timeout=WAIT_S)
            end = min(self.have, offset + n)
            if self.failed or end <= offset:
                return b""
            if self.data is not None:
                return bytes(self.data[offset:end])
        with self.path.open("rb") as f:
            return os.pread(f.fileno(), end - offset, offset)
