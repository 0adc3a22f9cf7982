"""Batched sampling with Hugging Face transformers, on CPU, CUDA or MPS.

`HFBackend.generate_ids` continues each token-id context with one completion:
its token ids and the log-prob of every sampled token under the distribution it
was sampled from (after temperature and top-p), which is what the trainer's
importance weights need. Contexts are token ids, never text: prompts are
encoded once (by the broker, or `RunTokenizer.encode_prompts` in process).
The backend knows nothing about tasks, rewards or the broker.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import nullcontext

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from echorl.config import SamplingConfig
from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import Completion, LoraSpec
from echorl.rollout.backend import Adapters, completion


class HFBackend:
    """Generation with `model.generate`; weights swapped in place (`load_weights`). One of the
    sampler's backends (`rollout/backend.py`)."""

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, keep_adapters: int = 2
    ):
        self.model = model  # a peft model too (the trainer's own LoRA policy, or adapters loaded)
        self.tokenizer = tokenizer
        self.codec = RunTokenizer.from_hf(tokenizer)
        self.slots = Adapters(keep_adapters)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def max_positions(self) -> int:
        return getattr(self.model.config, "max_position_embeddings", 1 << 30)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """A new full version in place, cast to the model's dtype (a bf16 download into an fp32
        model, or the other way)."""
        if self.slots.held:  # back to the plain model: the adapters were for other weights
            self.model = self.model.unload()
            self.slots.clear()
        dtype = next(self.model.parameters()).dtype
        state = {k: t.to(dtype) if t.is_floating_point() else t for k, t in state.items()}
        self.model.load_state_dict(state, strict=True)

    def load_adapter(self, version: int, state: dict[str, torch.Tensor], spec: LoraSpec) -> None:
        """Adapter `version` injected with peft next to the resident ones, and made active."""
        from peft import get_peft_model, set_peft_model_state_dict

        from echorl.models.lora import peft_config

        name = f"v{version}"
        if not self.slots.held:
            self.model = get_peft_model(self.model, peft_config(spec), adapter_name=name)
        elif name not in self.model.peft_config:  # else: the same version, other weights
            self.model.add_adapter(name, peft_config(spec))
        result = set_peft_model_state_dict(self.model, state, adapter_name=name)
        if result.unexpected_keys:
            raise ValueError(f"adapter v{version}: unexpected tensors {result.unexpected_keys[:3]}")
        self.model.set_adapter(name)
        for old in self.slots.add(version, name):
            if old != name:
                self.model.delete_adapter(old)

    def use_adapter(self, version: int | None) -> None:
        name = self.slots.use(version)
        if name is not None:
            self.model.set_adapter(name)

    @property
    def adapters(self) -> list[int]:
        return list(self.slots.held)

    @torch.no_grad()
    def generate_ids(
        self,
        contexts: list[list[int]],
        params: SamplingConfig,
        max_new_tokens: int,
        seed: int,
        stop_ids: tuple[int, ...] = (),
    ) -> list[Completion]:
        """One completion per token-id context (G completions of a prompt: G copies of it; a
        multi-turn episode continues from its own tokens); same `seed` and weights give the
        same tokens. A row ends at eos or any of `stop_ids`, which it includes.

        The model's own forward pass with a KV cache, sampled here: each distinct context is
        prefilled once and its cache copied to its rows (G copies of a prompt cost one
        prefill), and decoding stops when every row has stopped."""
        # Adapters resident but none chosen: the full weights alone generate.
        base_only = self.slots.held and self.slots.active is None
        with self.model.disable_adapter() if base_only else nullcontext():
            rows, logprobs = self._sample(contexts, params, max_new_tokens, seed, stop_ids)
        eos = self.codec.eos_id
        return _cut(rows, logprobs, eos, {eos, *stop_ids})

    @functools.cached_property
    def _cache_arg(self) -> str:
        """What the model's forward calls its KV cache (`cache` from transformers 5.24)."""
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        names = inspect.signature(type(model).forward).parameters
        return "cache" if "cache" in names else "past_key_values"

    def _sample(self, contexts, params, max_new_tokens, seed, stop_ids):
        distinct: dict[tuple[int, ...], int] = {}
        which = torch.tensor([distinct.setdefault(tuple(c), len(distinct)) for c in contexts])
        enc = self.tokenizer.pad(
            {"input_ids": [list(c) for c in distinct]}, return_tensors="pt", padding_side="left"
        ).to(self.device)
        mask = enc["attention_mask"]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=enc["input_ids"],
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = getattr(out, self._cache_arg)
        which = which.to(self.device)
        cache.reorder_cache(which)  # each row gets its context's prefill
        logits, mask, last = out.logits[which, -1], mask[which], positions[which, -1:]
        warp = _warpers(params)
        gen = torch.Generator(self.device).manual_seed(seed)
        stops = torch.tensor([self.codec.eos_id, *stop_ids], device=self.device)
        done = torch.zeros(len(contexts), dtype=torch.bool, device=self.device)
        tokens, logps = [], []
        for t in range(max_new_tokens):
            scores = logits.float()
            for w in warp:
                scores = w(None, scores)
            logp = torch.log_softmax(scores, dim=-1)
            if warp:  # a draw from exp(logp) by its inverse CDF: one uniform per row
                # (the first token whose cumulative mass passes it: never one of mass 0)
                cdf = logp.exp().cumsum(-1)
                u = torch.rand((len(cdf), 1), generator=gen, device=cdf.device) * cdf[:, -1:]
                token = (
                    torch.searchsorted(cdf, u, side="right").squeeze(1).clamp(max=cdf.shape[1] - 1)
                )
            else:
                token = scores.argmax(-1)
            tokens.append(token)
            logps.append(logp.gather(-1, token[:, None]).squeeze(1))
            done |= torch.isin(token, stops)
            if bool(done.all()) or t + 1 == max_new_tokens:
                break
            mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
            last = last + 1
            out = self.model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=last,
                use_cache=True,
                **{self._cache_arg: cache},
            )
            logits = out.logits[:, -1]
        return torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()


def _warpers(params: SamplingConfig) -> list:
    """The sampling distribution: temperature, then top-p (none: greedy). transformers' own
    warpers, so the distribution is the one `generate` would sample from; never a top-k."""
    if params.temperature == 0.0:
        return []
    warp = [TemperatureLogitsWarper(params.temperature)]
    if params.top_p < 1.0:
        warp.append(TopPLogitsWarper(params.top_p))
    return warp


def _cut(rows: list[list[int]], lps: list[list[float]], eos: int, stops: set[int]):
    """Each row up to and including its first stop token (the rest is padding)."""
    completions = []
    for ids, lp in zip(rows, lps):
        length = next((k + 1 for k, t in enumerate(ids) if t in stops), len(ids))
        completions.append(completion(ids[:length], lp[:length], eos))
    return completions
