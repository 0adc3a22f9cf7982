"""From rollout groups to padded token tensors, and the trainer's log-probs of them.

Sequences are laid out right-padded as prompt + completion. Log-prob tensors
are aligned with the *targets*: column t holds the log-prob of token t + 1
given tokens 0..t, so they are one column shorter than `input_ids`. In a
multi-turn episode the environment's tokens are part of the completion but
carry no loss (`Sequence.mask`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel


@dataclass
class Sequence:
    """One prompt + completion, as the trainer needs it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]  # one per completion token
    advantage: float
    mask: list[int] | None = None  # 1 = model token, 0 = environment token (no loss); None = all 1


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


def collate(seqs: list[Sequence], pad_id: int) -> Batch:
    assert seqs, "cannot collate an empty batch"
    length = max(len(s.prompt_ids) + len(s.completion_ids) for s in seqs)
    n = len(seqs)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    loss_mask = torch.zeros((n, length - 1))
    behaviour = torch.zeros((n, length - 1))
    for i, s in enumerate(seqs):
        assert len(s.behaviour_logprobs) == len(s.completion_ids), (
            f"row {i}: {len(s.completion_ids)} completion tokens but {len(s.behaviour_logprobs)} log-probs"
        )
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        attention[i, : p + c] = 1
        # Completion token k sits at position p + k; its log-prob is in target column p + k - 1.
        mask = torch.ones(c) if s.mask is None else torch.tensor(s.mask, dtype=torch.float32)
        assert mask.numel() == c, f"row {i}: {c} completion tokens but a mask of {mask.numel()}"
        loss_mask[i, p - 1 : p - 1 + c] = mask
        behaviour[i, p - 1 : p - 1 + c] = torch.tensor(s.behaviour_logprobs) * mask
    advantages = torch.tensor([s.advantage for s in seqs], dtype=torch.float32)
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
