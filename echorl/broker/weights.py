"""The broker's weight store: one safetensors file per policy version, immutable once stored.

    weights/v7.safetensors          what samplers download (cast to `sampler_dtype`)
    weights/v7.sha256               its sha256, served as X-Sha256 and in WeightVersion
    weights/v7.upload.sha256        the sha256 of the trainer's upload (a retry is recognised)
    weights/v7.kind.json            what it is: full weights, or a LoRA adapter on a full version
    weights/v7.delta, .delta.json   v7 as the 16-bit words changed since v6, where that is
                                    small (bf16 weights: transfer.make_delta); its base

A LoRA run's versions after v0 are adapters (`echorl.kind = lora` in the file's metadata,
`models/lora.py`); one is accepted only on a stored full version, which is then kept as
long as a kept adapter needs it.

An upload is streamed to a temporary file while it is hashed, fsynced off the
event loop, checked against the sha256 the trainer announced, cast for the
samplers when asked, and only then renamed into place: a version appears whole
or not at all. The last `keep` versions stay on disk, and any older one a leased
sync job still requires.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import safetensors
from pydantic import ValidationError

from echorl.protocol import (
    BadRequest,
    LoraSpec,
    NotFound,
    ProtocolError,
    TooLarge,
    WeightVersion,
)
from echorl.transfer import make_delta

MAX_HEADER = 100 << 20  # safetensors' own bound on a header
DELTA_MAX_BYTES = 4 << 30  # versions up to this size get deltas (both held in memory a moment)


class WeightStore:
    def __init__(
        self, folder: Path, dtype: str = "float32", keep: int = 3, max_bytes: int = 1 << 36
    ):
        self.folder, self.dtype, self.keep, self.max_bytes = folder, dtype, keep, max_bytes
        self.uploading: set[int] = set()  # versions being received now (on the event loop)
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob(".upload-*"):  # a broker killed mid-upload
            stale.unlink()

    def file(self, version: int) -> Path:
        return self.folder / f"v{version}.safetensors"

    def has(self, version: int) -> bool:
        return self.file(version).is_file()

    def describe(self, version: int) -> WeightVersion:
        path = self.file(version)
        if not path.is_file():
            raise NotFound(f"version {version} is not stored (kept: the last {self.keep})")
        delta = self.folder / f"v{version}.delta"
        if delta.is_file():
            base = json.loads((self.folder / f"v{version}.delta.json").read_text())["base"]
            delta_of = {"delta_base": base, "delta_bytes": delta.stat().st_size}
        else:
            delta_of = {}
        return WeightVersion(
            version=version,
            sha256=path.with_suffix(".sha256").read_text(),
            size_bytes=path.stat().st_size,
            dtype=self.dtype,
            **self.kind(version),
            **delta_of,
        )

    def kind(self, version: int) -> dict:
        """{"kind": "full"} or {"kind": "lora", "base": v, "lora": {...}} (a store written
        before versions had kinds holds full ones)."""
        mark = self.folder / f"v{version}.kind.json"
        return json.loads(mark.read_text()) if mark.is_file() else {"kind": "full"}

    def is_stored_upload(self, version: int, sha256: str) -> bool:
        """Whether `version` is stored from an upload hashing to `sha256` (a retried publish)."""
        mark = self.folder / f"v{version}.upload.sha256"
        return mark.is_file() and mark.read_text() == sha256

    async def receive(self, version: int, sha256: str, chunks: AsyncIterator[bytes]) -> None:
        """Store the upload of `version`, which must hash to `sha256`; raises TooLarge or
        BadRequest (and stores nothing) otherwise, and ProtocolError while another upload of
        `version` is under way (each upload has its own file: they never mix)."""
        if version in self.uploading:
            raise ProtocolError(f"an upload of version {version} is under way; retry later")
        self.uploading.add(version)
        tmp = self.folder / f".upload-{version}-{os.urandom(8).hex()}"
        digest, size = hashlib.sha256(), 0
        try:
            with tmp.open("wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise TooLarge(f"weights exceed {self.max_bytes} bytes")
                    digest.update(chunk)
                    f.write(chunk)
                f.flush()
                await asyncio.to_thread(os.fsync, f.fileno())  # the other routes go on meanwhile
            if digest.hexdigest() != sha256:
                raise BadRequest(f"sha256 mismatch: body hashes to {digest.hexdigest()}")
            await asyncio.to_thread(self._serve, tmp, version, sha256)
        finally:
            tmp.unlink(missing_ok=True)
            tmp.with_name(tmp.name + ".cast").unlink(missing_ok=True)
            self.uploading.discard(version)

    def _serve(self, upload: Path, version: int, sha256: str) -> None:
        """Put the upload in place as the samplers' file (cast when asked), its sha256 files
        first: the version is visible only once everything about it is."""
        kind = self._check_kind(upload)
        staged = upload
        if self.dtype != "float32":
            staged = upload.with_name(upload.name + ".cast")
            try:
                _cast_safetensors(upload, staged, self.dtype)
            except (safetensors.SafetensorError, ValueError, OSError) as e:
                raise BadRequest(f"cannot cast the upload to {self.dtype}: {e}") from None
        final = self.file(version)
        final.with_suffix(".sha256").write_text(sha256 if staged is upload else _sha256(staged))
        (self.folder / f"v{version}.kind.json").write_text(json.dumps(kind))
        (self.folder / f"v{version}.upload.sha256").write_text(sha256)
        self._delta(staged, version, kind)
        staged.replace(final)

    def _delta(self, staged: Path, version: int, kind: dict) -> None:
        """`version` as a delta against the version before it, for samplers that hold that
        one (transfer.make_delta), where one is worth having: bf16 weights, a small step."""
        path, base = self.folder / f"v{version}.delta", self.folder / f"v{version}.delta.json"
        path.unlink(missing_ok=True)  # a version number published again: its old delta goes
        base.unlink(missing_ok=True)
        before = version - 1
        if self.dtype == "float32" or kind["kind"] != "full":
            return  # float32's low half-words change with any step: no delta worth making
        if not self.has(before) or self.kind(before)["kind"] != "full":
            return
        if staged.stat().st_size > DELTA_MAX_BYTES:
            return
        delta = make_delta(self.file(before).read_bytes(), staged.read_bytes())
        if delta is not None:  # its base first: a delta is visible only once it is whole
            base.write_text(json.dumps({"base": before}))
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(delta)
            tmp.replace(path)

    def delta_file(self, version: int) -> Path:
        path = self.folder / f"v{version}.delta"
        if not path.is_file():
            raise NotFound(f"version {version} has no delta")
        return path

    def _check_kind(self, upload: Path) -> dict:
        """What the upload says it is, checked: an adapter must name a stored full version as
        its base, and its shape must be one a sampler can apply."""
        meta = _metadata(upload)
        if meta.get("echorl.kind", "full") == "full":
            return {"kind": "full"}
        if meta["echorl.kind"] != "lora":
            raise BadRequest(f"echorl.kind {meta['echorl.kind']!r}: expected full or lora")
        try:
            base = int(meta.get("echorl.base", ""))
            spec = LoraSpec.model_validate_json(meta.get("echorl.lora", ""))
        except (TypeError, ValueError, ValidationError) as e:
            raise BadRequest(f"a lora version needs echorl.base and echorl.lora: {e}") from None
        if not self.has(base) or self.kind(base)["kind"] != "full":
            raise BadRequest(f"a lora version's base v{base} is not a stored full version")
        return {"kind": "lora", "base": base, "lora": spec.model_dump()}

    def retain(self, newest: int, referenced: set[int], keep: int | None = None) -> None:
        """Delete versions older than the last `keep` (default: the store's own), except those
        still referenced and the bases of the adapters kept."""
        keep = keep or self.keep
        versions = self.versions()
        kept = {v for v in versions if v > newest - keep or v in referenced}
        kept |= {self.kind(v).get("base") for v in kept} - {None}
        for v in versions:
            if v not in kept:
                self.forget(v)

    def forget_after(self, version: int) -> None:
        """Delete every version newer than `version` (a resumed trainer forgot them)."""
        for v in self.versions():
            if v > version:
                self.forget(v)

    def versions(self) -> list[int]:
        return sorted(int(p.stem[1:]) for p in self.folder.glob("v*.safetensors"))

    def forget(self, version: int) -> None:
        path = self.file(version)
        path.unlink(missing_ok=True)
        path.with_suffix(".sha256").unlink(missing_ok=True)
        (self.folder / f"v{version}.upload.sha256").unlink(missing_ok=True)
        (self.folder / f"v{version}.kind.json").unlink(missing_ok=True)
        (self.folder / f"v{version}.delta").unlink(missing_ok=True)
        (self.folder / f"v{version}.delta.json").unlink(missing_ok=True)


def _metadata(path: Path) -> dict[str, str]:
    """A safetensors file's `__metadata__`, read from its header alone ({} when there is none:
    the broker stores weights as opaque bytes unless they declare a kind)."""
    with path.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        try:
            header = json.loads(f.read(n)) if 2 <= n <= MAX_HEADER else {}
        except ValueError:
            header = {}
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return meta if isinstance(meta, dict) else {}


def _cast_safetensors(src: Path, dst: Path, dtype: str) -> None:
    """Write `src` with every floating tensor cast to `dtype` to `dst`."""
    import torch  # only when casting: the broker otherwise starts without torch
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    tensors = {k: (t.to(target) if t.is_floating_point() else t) for k, t in load_file(src).items()}
    save_file(tensors, dst, metadata={"format": "pt"})


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
