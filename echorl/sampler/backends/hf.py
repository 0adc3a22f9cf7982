"""Batched sampling with Hugging Face transformers, on CPU, CUDA or MPS.

`HFBackend.generate` returns, for each prompt, G completions with the token ids
and the log-prob of every sampled token under the distribution it was sampled
from (after temperature and top-p), which is what the trainer's importance
weights need. The backend knows nothing about tasks, rewards or the broker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from echorl.config import SamplingConfig
from echorl.models.prompts import encode_prompts
from echorl.protocol import turn_mask


@dataclass
class Completion:
    token_ids: list[int]  # generated tokens, the eos included when one was produced
    logprobs: list[float]  # behaviour log-prob of each generated token
    text: str  # decoded without special tokens
    finished: bool  # True when the model stopped with eos, False when cut at max_new_tokens
    # Multi-turn episodes: (start, end, version) of each model turn; other tokens are the
    # environment's. None for a single-turn completion.
    turns: list[tuple[int, int, int]] | None = None

    @property
    def mask(self) -> list[int] | None:
        """1 on the model's turns, 0 on the environment's tokens; None for a single turn."""
        if self.turns is None:
            return None
        return turn_mask(len(self.token_ids), [(s, e) for s, e, _ in self.turns])


class HFBackend:
    """Generation with `model.generate`; weights can be swapped in place with `load_state_dict`."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase):
        self.model = model
        self.tokenizer = tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(
        self, prompts: list[str], n: int, params: SamplingConfig, max_new_tokens: int, seed: int
    ) -> list[list[Completion]]:
        """G = `n` completions per prompt; same `seed` and weights give the same tokens."""
        ids = encode_prompts(self.tokenizer, prompts, params)
        flat = self.generate_ids([p for p in ids for _ in range(n)], params, max_new_tokens, seed)
        return [flat[i : i + n] for i in range(0, len(flat), n)]

    @torch.no_grad()
    def generate_ids(
        self,
        contexts: list[list[int]],
        params: SamplingConfig,
        max_new_tokens: int,
        seed: int,
        stop_ids: tuple[int, ...] = (),
    ) -> list[Completion]:
        """One completion per token-id context (a multi-turn episode continues from its own
        tokens); generation of a row ends at eos or any of `stop_ids`, which it includes."""
        tok = self.tokenizer
        enc = tok.pad({"input_ids": contexts}, return_tensors="pt", padding_side="left").to(
            self.device
        )
        greedy = params.temperature == 0.0
        # top_k=0: never the library's default top-k; the sampling distribution is ours to define.
        sampling = (
            {} if greedy else {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        )
        stops = [tok.eos_token_id, *stop_ids]
        torch.manual_seed(seed)
        out = self.model.generate(
            **enc,
            do_sample=not greedy,
            max_new_tokens=max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=stops if stop_ids else tok.eos_token_id,
            return_dict_in_generate=True,
            output_scores=True,
            **sampling,
        )
        new = out.sequences[:, enc["input_ids"].shape[1] :]  # (N, T)
        scores = torch.stack(out.scores, dim=1).float()  # (N, T, V), processed logits
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        return _cut(new.tolist(), logprobs.tolist(), tok, set(stops))


def _cut(rows: list[list[int]], lps: list[list[float]], tok, stops: set[int]) -> list[Completion]:
    """Each row up to and including its first stop token (the rest is padding)."""
    completions = []
    for ids, lp in zip(rows, lps):
        length = next((k + 1 for k, t in enumerate(ids) if t in stops), len(ids))
        ids, lp = ids[:length], lp[:length]
        finished = bool(ids) and ids[-1] == tok.eos_token_id
        completions.append(Completion(ids, lp, tok.decode(ids, skip_special_tokens=True), finished))
    return completions
