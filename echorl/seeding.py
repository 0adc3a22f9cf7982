"""Explicit seeds: every random draw derives from (run seed, step, prompt, sample), never from globals."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 63-bit seed that depends on every part, in order (stable across processes and runs)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
