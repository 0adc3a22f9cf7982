"""The warm-up: a short supervised phase on task demonstrations.

RL needs signal: a randomly initialised tiny model never answers right, so its
GRPO advantages are all zero. A few hundred steps of next-token training on
`task.demonstration` answers give it a non-zero but imperfect reward; the
result is saved as an ordinary HF checkpoint that becomes policy version 0.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from echorl.config import SamplingConfig, SFTConfig
from echorl.models.tokenizer import RunTokenizer
from echorl.progress import BarSteps, LineSteps
from echorl.tasks import Environment, Task, is_environment, problem_stream
from echorl.trainer.batch import Row, collate, token_logprobs


def demonstration_batches(
    task: Task | Environment,
    tokenizer: PreTrainedTokenizerBase,
    cfg: SFTConfig,
    params: SamplingConfig = SamplingConfig(),
):
    """Endless batches of prompt + demonstration + eos, loss on the answer and the eos; for an
    environment, prompt + demonstrated turns, loss on the actions only."""
    stream = problem_stream(task, cfg.seed, split="train")
    codec = RunTokenizer.from_hf(tokenizer)
    while True:
        problems = [next(stream) for _ in range(cfg.batch_size)]
        prompts = codec.encode_prompts([p.query for p in problems], params)
        rows = []
        for p, prompt in zip(problems, prompts):
            if is_environment(task):
                ids, mask = transcript(task.demonstration_turns(p), codec.encode)
            else:
                ids = codec.encode(task.demonstration(p)) + [codec.eos_id]
                mask = [1] * len(ids)
            rows.append(Row(prompt, ids, [0.0] * len(ids), mask, 0.0))
        yield collate(rows, tokenizer.pad_token_id)


def transcript(turns: list[tuple[str, str]], encode) -> tuple[list[int], list[int]]:
    """Token ids of (action, observation) turns, and the mask that trains on actions only;
    the observation after the last action is left out, as the sampler leaves it out."""
    ids: list[int] = []
    mask: list[int] = []
    for k, (action, observation) in enumerate(turns):
        a = encode(action)
        ids += a
        mask += [1] * len(a)
        if k < len(turns) - 1:
            o = encode(observation)
            ids += o
            mask += [0] * len(o)
    return ids, mask


def warm_up(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    cfg: SFTConfig,
    bar: BarSteps | LineSteps | None = None,
    params: SamplingConfig = SamplingConfig(),
) -> list[float]:
    """Train `model` in place on demonstrations; returns the loss per step. `bar` (see
    `echorl.progress.steps`, total `cfg.steps`) is told each step and its loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99))
    # Linear decay to 30%, not lower: RL then runs at a rate well below where warm-up ended,
    # which keeps the first policy-gradient steps inside the region warm-up left stable.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.7 * i / max(cfg.steps, 1))
    batches = demonstration_batches(task, tokenizer, cfg, params)
    losses = []
    device = next(model.parameters()).device
    model.train()
    for i in range(cfg.steps):
        batch = next(batches).to(device)
        logp, _ = token_logprobs(model, batch)
        loss = -(logp * batch.loss_mask).sum() / batch.loss_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(i + 1, f"loss {losses[-1]:.3f}")
    model.eval()
    return losses
