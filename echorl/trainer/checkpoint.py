"""Trainer checkpoints: the policy as an HF folder plus optimiser, step and RNG state.

A checkpoint is written to a temporary folder and renamed into place, so a
crash mid-write leaves the previous one intact. `LATEST` names the newest.
The optimiser state is keyed by parameter name and whole (gathered from the ranks of
an FSDP2 world), so one checkpoint resumes under any world size and strategy.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from echorl.trainer.distributed import (
    SOLO,
    World,
    full_state,
    load_optimizer_state,
    optimizer_state,
)


@dataclass
class TrainerState:
    step: int  # steps completed
    extra: dict


def save_checkpoint(
    root: Path,
    step: int,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    optimizer: torch.optim.Optimizer,
    scheduler,
    extra: dict | None = None,
    world: World = SOLO,
) -> Path | None:
    """Every rank of a world calls it (FSDP2 gathers the weights and optimiser state to rank
    0); rank 0 writes, and returns the folder."""
    weights = full_state(model, world) if world.sharded else None
    opt_state = optimizer_state(model, optimizer, world)
    if not world.leader:
        return None
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp_step_{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "policy", state_dict=weights)
    tokenizer.save_pretrained(tmp / "policy")
    torch.save(
        {
            "step": step,
            "optimizer": opt_state,
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "extra": extra or {},
        },
        tmp / "trainer_state.pt",
    )
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    (root / "LATEST.tmp").write_text(final.name)
    (root / "LATEST.tmp").replace(root / "LATEST")
    return final


def latest_checkpoint(root: Path) -> Path | None:
    marker = root / "LATEST"
    return root / marker.read_text().strip() if marker.is_file() else None


def load_trainer_state(
    ckpt: Path, model, optimizer: torch.optim.Optimizer, scheduler, world: World = SOLO
) -> TrainerState:
    """Restore optimiser, scheduler and RNG from `ckpt` (the policy is loaded separately);
    each rank of a world reads it and keeps its own shard."""
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    if all(isinstance(k, int) for k in state["optimizer"]["state"]):  # an older checkpoint
        optimizer.load_state_dict(state["optimizer"])
    else:
        load_optimizer_state(model, optimizer, state["optimizer"], world)
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return TrainerState(state["step"], state["extra"])
