"""A state dict on the wire as a safetensors file that is never built: the header, then each
tensor's own bytes, streamed.

    digest, size, chunks = stream_safetensors(state)   # one pass to hash, no copy
    client.publish_stream(version, digest, size, chunks)

`safetensors.torch.save` builds the whole file in memory first (for a 50m model it
spends ~5x longer than writing a file, measured in bench/weight_sync.py); this
writes the same format (8-byte little-endian header length, JSON header padded
to 8 bytes, then the tensors back to back) straight from the tensors' storage.
Whatever reads safetensors reads it. CPU tensors only, little-endian hosts.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterator

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy when it is already contiguous."""
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _layout(
    state: dict[str, torch.Tensor], metadata: dict[str, str] | None
) -> tuple[bytes, list[tuple[torch.Tensor, int]], int]:
    """The file's head (length and JSON header), each tensor with its data offset, and the
    data's size."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    placed, offset = [], 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        placed.append((t, offset))
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors start 8-byte aligned
    return struct.pack("<Q", len(text)) + text, placed, offset


def stream_safetensors(
    state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> tuple[str, int, Callable[[], Iterator[memoryview | bytes]]]:
    """(sha256, size in bytes, a factory of the file's chunks) for `state`; each call of the
    factory streams the file from the start (an HTTP retry sends it again)."""
    for name, t in state.items():
        assert t.device.type == "cpu", f"{name} is on {t.device}: stream CPU tensors"
    head, placed, size = _layout(state, metadata)
    views = [_raw(t) for t, _ in placed]
    digest = hashlib.sha256(head)
    for raw in views:
        digest.update(raw)

    def chunks() -> Iterator[memoryview | bytes]:
        yield head
        yield from views

    return digest.hexdigest(), len(head) + size, chunks


def safetensors_size(state: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> int:
    head, _, size = _layout(state, metadata)
    return len(head) + size


def write_safetensors(
    state: dict[str, torch.Tensor], metadata: dict[str, str] | None, buffer: memoryview
) -> int:
    """Write `state` as a safetensors file into `buffer` (a shared mapping: one copy per
    tensor, from any device); returns the file's size."""
    head, placed, size = _layout(state, metadata)
    buffer[: len(head)] = head
    base = len(head)
    for t, offset in placed:
        n = t.numel() * t.element_size()
        if n:
            out = torch.frombuffer(buffer, dtype=torch.uint8, count=n, offset=base + offset)
            out.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return base + size
