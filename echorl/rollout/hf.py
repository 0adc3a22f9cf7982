"""Batched sampling with Hugging Face transformers, on CPU, CUDA or MPS.

`HFBackend.generate_ids` continues each token-id context with one completion:
its token ids and the log-prob of every sampled token under the distribution it
was sampled from (after temperature and top-p), which is what the trainer's
importance weights need. Contexts are token ids, never text: prompts are
encoded once (by the broker, or `RunTokenizer.encode_prompts` in process).
The backend knows nothing about tasks, rewards or the broker.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

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
        same tokens. A row ends at eos or any of `stop_ids`, which it includes."""
        tok = self.tokenizer
        enc = tok.pad({"input_ids": contexts}, return_tensors="pt", padding_side="left").to(
            self.device
        )
        greedy = params.temperature == 0.0
        # top_k=0: never the library's default top-k; the sampling distribution is ours to define.
        sampling = (
            {} if greedy else {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        )
        eos = self.codec.eos_id
        stops = [eos, *stop_ids]
        torch.manual_seed(seed)
        # Adapters resident but none chosen: the full weights alone generate.
        base_only = self.slots.held and self.slots.active is None
        with self.model.disable_adapter() if base_only else nullcontext():
            out = self._generate(enc, greedy, max_new_tokens, stops if stop_ids else eos, sampling)
        new = out.sequences[:, enc["input_ids"].shape[1] :]  # (N, T)
        scores = torch.stack(out.scores, dim=1).float()  # (N, T, V), processed logits
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        return _cut(new.tolist(), logprobs.tolist(), eos, set(stops))

    def _generate(self, enc, greedy, max_new_tokens, eos, sampling):
        return self.model.generate(
            **enc,
            do_sample=not greedy,
            max_new_tokens=max_new_tokens,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=eos,
            return_dict_in_generate=True,
            output_scores=True,
            **sampling,
        )


def _cut(rows: list[list[int]], lps: list[list[float]], eos: int, stops: set[int]):
    """Each row up to and including its first stop token (the rest is padding)."""
    completions = []
    for ids, lp in zip(rows, lps):
        length = next((k + 1 for k, t in enumerate(ids) if t in stops), len(ids))
        completions.append(completion(ids[:length], lp[:length], eos))
    return completions
