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


@dataclass
class Completion:
    token_ids: list[int]  # generated tokens, the eos included when one was produced
    logprobs: list[float]  # behaviour log-prob of each generated token
    text: str  # decoded without special tokens
    finished: bool  # True when the model stopped with eos, False when cut at max_new_tokens


class HFBackend:
    """Generation with `model.generate`; weights can be swapped in place with `load_state_dict`."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase):
        self.model = model
        self.tokenizer = tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(
        self, prompts: list[str], n: int, params: SamplingConfig, max_new_tokens: int, seed: int
    ) -> list[list[Completion]]:
        """G = `n` completions per prompt; same `seed` and weights give the same tokens."""
        tok = self.tokenizer
        expanded = [p for p in prompts for _ in range(n)]  # (B*n,), each prompt n times in a row
        enc = tok(
            expanded,
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=False,
        ).to(self.device)
        greedy = params.temperature == 0.0
        # top_k=0: never the library's default top-k; the sampling distribution is ours to define.
        sampling = (
            {} if greedy else {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        )
        torch.manual_seed(seed)
        out = self.model.generate(
            **enc,
            do_sample=not greedy,
            max_new_tokens=max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            return_dict_in_generate=True,
            output_scores=True,
            **sampling,
        )
        new = out.sequences[:, enc["input_ids"].shape[1] :]  # (B*n, T)
        scores = torch.stack(out.scores, dim=1).float()  # (B*n, T, V), processed logits
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        return _split(new.tolist(), logprobs.tolist(), n, tok)


def _split(rows: list[list[int]], lps: list[list[float]], n: int, tok) -> list[list[Completion]]:
    completions = []
    for ids, lp in zip(rows, lps):
        length = ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else len(ids)
        ids, lp = ids[:length], lp[:length]
        finished = bool(ids) and ids[-1] == tok.eos_token_id
        completions.append(Completion(ids, lp, tok.decode(ids, skip_special_tokens=True), finished))
    return [completions[i : i + n] for i in range(0, len(completions), n)]
