"""TRL's GRPOTrainer on an echorl task: the peer half of `bench/peer_trl.py`.

Runs in TRL's own virtual environment (`.venv-trl`, made by peer_trl.py), with echorl
installed there for the model folder, the task and its prompt stream, so both loops see
the same model, the same prompts step by step and the same reward. Prints one JSON line.

    .venv-trl/bin/python bench/trl_side.py --model DIR --out DIR --steps 60
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from echorl.config import RunConfig
from echorl.models import load_policy
from echorl.tasks import get_task
from echorl.trainer.colocated import step_problems


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--task", default="add")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    task = get_task(a.task)
    cfg = RunConfig.model_validate(
        {
            "task": {"name": a.task, "seed": a.task_seed},
            "train": {"batch_prompts": a.batch, "group_size": a.group},
        }
    )
    # echorl's prompt stream, step by step, in order: TRL's batch s is echorl's step s.
    problems = [p for s in range(a.steps) for p in step_problems(task, cfg, s)]
    data = Dataset.from_list([{"prompt": p.prompt, "index": i} for i, p in enumerate(problems)])

    def reward(completions, index, **_):
        return [task.score(problems[i], c) for c, i in zip(completions, index)]

    model, tokenizer = load_policy(a.model)
    args = GRPOConfig(
        output_dir=a.out,
        max_steps=a.steps,
        per_device_train_batch_size=a.batch * a.group,  # completions per optimiser step
        num_generations=a.group,
        max_completion_length=a.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        adam_beta2=0.99,  # echorl's optim defaults
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,  # no KL term, as echorl's default
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",  # token mean over the batch, as echorl's default
        scale_rewards="group",  # (r - mean) / std within a group: GRPO, as echorl's default
        shuffle_dataset=False,
        use_cpu=True,
        seed=a.seed,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    trainer.model.save_pretrained(f"{a.out}/policy")
    tokenizer.save_pretrained(f"{a.out}/policy")
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    print(json.dumps({"wall_s": wall, "steps": a.steps, "rewards": rewards}))


if __name__ == "__main__":
    main()
