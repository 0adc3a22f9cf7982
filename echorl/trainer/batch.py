"""From rollout groups to padded token tensors, and the trainer's log-probs of them.

Sequences are laid out right-padded as prompt + completion. Log-prob tensors
are aligned with the *targets*: column t holds the log-prob of token t + 1
given tokens 0..t, so they are one column shorter than `input_ids`. In a
multi-turn episode the environment's tokens are part of the completion but
carry no loss (`Completion.mask`).
"""

from __future__ import annotations

import inspect
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
    prompt_lens: torch.Tensor  # (N,) the prompt's tokens at the start of each row

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
            self.prompt_lens[index],
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
                    self.prompt_lens,
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
    input_ids, attention, loss_mask, behaviour = [], [], [], []
    for i, r in enumerate(rows):
        p, c = len(r.prompt_ids), len(r.completion_ids)
        assert len(r.logprobs) == c == len(r.mask), (
            f"row {i}: {c} completion tokens, {len(r.logprobs)} log-probs, a mask of {len(r.mask)}"
        )
        pad = length - p - c
        input_ids.append(r.prompt_ids + r.completion_ids + [pad_id] * pad)
        attention.append([1] * (p + c) + [0] * pad)
        # Completion token k sits at position p + k; its log-prob is in target column p + k - 1.
        loss_mask.append([0] * (p - 1) + list(r.mask) + [0] * pad)
        behaviour.append(
            [0.0] * (p - 1) + [lp * m for lp, m in zip(r.logprobs, r.mask)] + [0.0] * pad
        )
    return Batch(
        torch.tensor(input_ids),
        torch.tensor(attention),
        torch.tensor(loss_mask, dtype=torch.float32),
        torch.tensor(behaviour, dtype=torch.float32),
        torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        torch.tensor([len(r.prompt_ids) for r in rows]),
    )


def token_logprobs(
    model: PreTrainedModel,
    batch: Batch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (N, L-1) of each target token under `model` at `temperature` (0 off the
    completions), and optionally the entropy (N, L-1) of each next-token distribution.
    Gradients flow unless under no_grad.

    Rows that share a prompt (a group's G completions) share its forward pass: each distinct
    prompt runs once and its KV cache is copied to its rows, whose completions then run on
    it. Only the completions' positions reach the output layer. `share_prompts=False` makes
    one pass whatever the rows (FSDP2's ranks must all make the same number of passes)."""
    distinct: dict[tuple[int, ...], int] = {}
    ids = batch.input_ids.tolist()
    which = [
        distinct.setdefault(tuple(row[:p]), len(distinct))
        for row, p in zip(ids, batch.prompt_lens.tolist())
    ]
    device = batch.input_ids.device
    if len(distinct) == len(ids) or not share_prompts:  # demonstrations, multi-turn: one pass
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logits = logits[:, :-1].float()  # (N, L-1, V): position t predicts token t + 1
        if temperature > 0.0 and temperature != 1.0:
            logits = logits / temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        logp = _trained_only(logp, batch)
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy
    # The distinct prompts, left-padded: their last tokens line up.
    plen = batch.prompt_lens
    width = int(plen.max())
    prompts = torch.zeros((len(distinct), width), dtype=torch.long, device=device)
    pmask = torch.zeros_like(prompts)
    for k, prompt in enumerate(distinct):
        if prompt:
            prompts[k, width - len(prompt) :] = torch.tensor(prompt)
            pmask[k, width - len(prompt) :] = 1
    out = model(
        input_ids=prompts,
        attention_mask=pmask,
        position_ids=(pmask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        logits_to_keep=1,  # the prompt's last position predicts the completion's first token
    )
    index = torch.tensor(which, device=device)
    cache = _cache_of(out)
    cache.reorder_cache(index)  # each row on its prompt's keys and values
    # The completions, right-padded: token k of row i sits at input position plen[i] + k.
    clen = batch.attention_mask.sum(-1) - plen
    steps = torch.arange(max(1, int(clen.max())), device=device)
    at = (plen[:, None] + steps).clamp(max=batch.input_ids.shape[1] - 1)
    completions = batch.input_ids.gather(1, at)
    cmask = steps[None, :] < clen[:, None]
    out2 = model(
        input_ids=completions,
        attention_mask=torch.cat([pmask[index], cmask.long()], dim=1),
        position_ids=plen[:, None] + steps,
        use_cache=True,
        **{_cache_arg(model): cache},
    )
    # Position k predicts completion token k: the prompt's last logits, then the completion's.
    logits = torch.cat([out.logits[index, -1:], out2.logits[:, :-1]], dim=1).float()
    if temperature > 0.0 and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    # Back to the batch's layout: completion token k of row i is target column plen[i] - 1 + k.
    target = (plen[:, None] - 1 + steps).clamp(max=batch.input_ids.shape[1] - 2)
    shape = (len(ids), batch.input_ids.shape[1] - 1)
    logp = torch.zeros(shape, device=device).scatter_add(1, target, torch.where(cmask, logp, 0.0))
    logp = _trained_only(logp, batch)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            ent = torch.where(cmask, -(logp_all.exp() * logp_all).sum(-1), 0.0)
            entropy = torch.zeros(shape, device=device).scatter_add(1, target, ent)
    return logp, entropy


def _trained_only(logp: torch.Tensor, batch: Batch) -> torch.Tensor:
    """0 off the tokens the loss trains (prompts, padding, environment tokens): their targets
    may be special tokens whose suppressed log-prob (-1e4) would make exp(behaviour - logp)
    inf there, and inf x a mask of 0 is nan."""
    return torch.where(batch.loss_mask > 0, logp, 0.0)


def _cache_of(out):
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def _cache_arg(model) -> str:
    """What the model's forward calls its KV cache (`cache` from transformers 5.24)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return (
        "cache"
        if "cache" in inspect.signature(type(base).forward).parameters
        else "past_key_values"
    )
