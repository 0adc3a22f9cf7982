"""From rollout groups to padded token tensors, and the trainer's log-probs of them.

Sequences are laid out right-padded as prompt + completion. Log-prob tensors
are aligned with the *targets*: column t holds the log-prob of token t + 1
given tokens 0..t, so they are one column shorter than `input_ids`. In a
multi-turn episode the environment's tokens are part of the completion but
carry no loss (`Completion.mask`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from echorl.protocol import ScoredGroup


@dataclass
class Batch:
    input_ids: torch.Tensor  # (N, L) prompt + completion, right-padded
    attention_mask: torch.Tensor  # (N, L)
    loss_mask: torch.Tensor  # (N, L-1) 1 where the target is a completion token
    behaviour_logp: torch.Tensor  # (N, L-1) sampler log-probs on the loss mask, 0 elsewhere
    advantages: torch.Tensor  # (N,)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, index: torch.Tensor | slice) -> Batch:
        """The sub-batch of the given rows (a minibatch)."""
        return Batch(
            self.input_ids[index],
            self.attention_mask[index],
            self.loss_mask[index],
            self.behaviour_logp[index],
            self.advantages[index],
        )

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            *(
                t.to(device)
                for t in (
                    self.input_ids,
                    self.attention_mask,
                    self.loss_mask,
                    self.behaviour_logp,
                    self.advantages,
                )
            )
        )


def batch_from_groups(groups: list[ScoredGroup], advantages: torch.Tensor, pad_id: int) -> Batch:
    """The trainer's batch, straight from scored groups: one row per completion, with
    `advantages[i, j]` for completion j of group i."""
    rows = [
        Row(g.prompt_ids, c.token_ids, c.logprobs, c.mask, advantages[i, j].item())
        for i, g in enumerate(groups)
        for j, c in enumerate(g.completions)
    ]
    return collate(rows, pad_id)


class Row(NamedTuple):
    """One prompt + completion: the ids, the behaviour log-prob of each completion token, the
    loss mask (1 = model token, 0 = environment token) and the row's advantage."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    mask: list[int]
    advantage: float


def collate(rows: list[Row], pad_id: int) -> Batch:
    assert rows, "cannot collate an empty batch"
    length = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    loss_mask = torch.zeros((n, length - 1))
    behaviour = torch.zeros((n, length - 1))
    for i, r in enumerate(rows):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        assert len(r.logprobs) == c == len(r.mask), (
            f"row {i}: {c} completion tokens, {len(r.logprobs)} log-probs, a mask of {len(r.mask)}"
        )
        input_ids[i, : p + c] = torch.tensor(r.prompt_ids + r.completion_ids)
        attention[i, : p + c] = 1
        # Completion token k sits at position p + k; its log-prob is in target column p + k - 1.
        mask = torch.tensor(r.mask, dtype=torch.float32)
        loss_mask[i, p - 1 : p - 1 + c] = mask
        behaviour[i, p - 1 : p - 1 + c] = torch.tensor(r.logprobs) * mask
    advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float32)
    return Batch(input_ids, attention, loss_mask, behaviour, advantages)


def token_logprobs(
    model: PreTrainedModel, batch: Batch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N, L-1) of each target token under `model` at `temperature`, and optionally
    the entropy (N, L-1) of each next-token distribution. Gradients flow unless under no_grad."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = logits[:, :-1].float()  # (N, L-1, V): position t predicts token t + 1
    if temperature > 0.0 and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
