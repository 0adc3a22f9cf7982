"""K trainer steps on fixed groups, as one process or every rank of a torchrun world; rank 0
writes the final weights and the steps' metrics to OUT (test_distributed.py compares them).

    python dist_steps.py OUT [-o key=value ...]
    torchrun --nproc-per-node 2 dist_steps.py OUT -o train.parallel=fsdp2
"""

import json
import sys

import torch
from safetensors.torch import save_file

from echorl.config import load_config
from echorl.models.tiny import build_tiny_model
from echorl.testing import random_groups
from echorl.trainer.distributed import full_state, join_world, wrap
from echorl.trainer.update import build_optimizer, build_scheduler, update_policy

STEPS, B, G = 3, 4, 4


def main(out: str, overrides: list[str]) -> None:
    cfg = load_config(None, [f"train.batch_prompts={B}", f"train.group_size={G}", *overrides])
    torch.set_num_threads(1)
    world = join_world(cfg.train.parallel)
    model, tokenizer = build_tiny_model("1m", seed=0)
    wrapped = wrap(model, world)
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim)
    records = []
    for step in range(STEPS):
        metrics = update_policy(
            model,
            tokenizer.pad_token_id,
            opt,
            sched,
            random_groups(step, B, G, vocab=60, prompt=(3, 6)),
            cfg,
            step,
            world=world,
            wrapped=wrapped,
        )
        records.append(metrics)
    state = full_state(model, world)
    if world.leader:
        save_file({k: v.contiguous() for k, v in state.items()}, f"{out}/model.safetensors")
        with open(f"{out}/metrics.json", "w") as f:
            json.dump({"world": world.size, "steps": records}, f)
    world.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], [a for a, prev in zip(args[1:], args) if prev == "-o"])
