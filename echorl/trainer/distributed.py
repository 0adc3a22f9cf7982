"""The trainer as a `torchrun` world: data parallel (DDP) or fully sharded (FSDP2).

    torchrun --nproc-per-node 2 -m echorl trainer -c run.toml -o train.parallel=fsdp2

Every rank holds the whole batch (rank 0 pulls it and broadcasts it) and trains on its
share of each minibatch's rows: rows `rank, rank + size, ...` of the minibatch, in the
order the seeded shuffle gave. Each rank's loss is its rows' sum over the *minibatch's*
token (or row) count, times the world size; DDP and FSDP2 average gradients over ranks,
so the step is the one a single process makes on the whole minibatch, and the metrics
(shares of one mean) add up across ranks.

Rank 0 alone talks to the broker, writes logs and checkpoints; under FSDP2 the full
weights are gathered tensor by tensor to rank 0's CPU (the other ranks never hold them).
gloo on CPU, NCCL on GPUs, picked from the device.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

Strategy = Literal["ddp", "fsdp2"]
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass(frozen=True)
class World:
    """This process's place in the trainer's world; one process alone is a world of one."""

    rank: int = 0
    size: int = 1
    strategy: Strategy = "ddp"
    started: bool = False  # a process group is up (torchrun)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """FSDP2: each rank holds a shard of every parameter (so forward passes are collective)."""
        return self.started and self.strategy == "fsdp2"

    def broadcast(self, obj):
        """Rank 0's `obj`, on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over ranks, in place (NCCL reduces on the GPU: a CPU `t` goes there
        and back)."""
        if self.size > 1:
            if t.device.type == "cpu" and dist.get_backend() == "nccl":
                t.copy_(self.sum(t.to(torch.cuda.current_device())).cpu())
            else:
                dist.all_reduce(t)
        return t

    def rows(self, index: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """This rank's share of `index` (rows of a minibatch), and whether it is a stand-in:
        a rank with no row of its own takes the first row with no loss, so that every rank
        makes the same forward and backward passes (DDP and FSDP2 need them)."""
        mine = index[self.rank :: self.size]
        return (mine, False) if len(mine) else (index[:1], True)

    def close(self, together: bool = True) -> None:
        """Leave the world. `together` (every rank finished): a barrier first, so no rank
        tears down while another still talks, then a pause: gloo's worker threads free
        finished work themselves and need the GIL to, and a group destroyed under the GIL
        (by DDP's reducer, when the model goes) waits for those threads, a deadlock at exit
        (seen once in CI). Not together (a rank failed): at once, since nobody may come."""
        if self.started:
            if together:
                dist.barrier()
                time.sleep(0.2)
            dist.destroy_process_group()


SOLO = World()  # one process, no torchrun


def join_world(strategy: Strategy = "ddp", device: str = "cpu") -> World:
    """The world torchrun started this process in (WORLD_SIZE, RANK in the environment), or a
    world of one. NCCL when the device is a GPU, gloo otherwise."""
    if "WORLD_SIZE" not in os.environ:
        return World(strategy=strategy)
    gpu = torch.device(device).type == "cuda"
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # A rank waits on rank 0 while it pulls from the broker and evaluates: allow for it.
    dist.init_process_group("nccl" if gpu else "gloo", timeout=timedelta(hours=2))
    return World(dist.get_rank(), dist.get_world_size(), strategy, started=True)


def local_device(device: str) -> str:
    """`cuda` becomes this rank's GPU (`cuda:LOCAL_RANK`) under torchrun."""
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        return f"cuda:{os.environ['LOCAL_RANK']}"
    return device


def wrap(model: torch.nn.Module, world: World) -> torch.nn.Module:
    """What forward and backward go through: the model itself alone, DDP around it, or the
    model sharded in place by FSDP2 (each decoder layer a unit, then the root)."""
    if not world.started:
        return model
    if world.strategy == "ddp":
        if world.size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        # No buffer broadcast: the rotary tables never change, and a forward pass of the
        # inner module on one rank alone (evaluation, the audit) must not need the others.
        return DistributedDataParallel(model, forward_sync_buffers=False)
    from torch.distributed.fsdp import fully_shard

    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layers:
            fully_shard(module)
    fully_shard(model)
    return model


def resharded(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every FSDP2 unit back in shards. The root unit keeps its parameters whole
    after a forward pass until the backward pass; reading or copying parameters in between
    would meet plain tensors among the sharded ones. Without FSDP2: `model` as it is."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def full_state(model: torch.nn.Module, world: World) -> dict[str, torch.Tensor] | None:
    """The whole state dict on rank 0's CPU, gathered tensor by tensor under FSDP2 (every rank
    must call it; the others get None). Without sharding: the model's own state dict."""
    if not world.sharded:
        return model.state_dict() if world.leader else None
    state = get_model_state_dict(model, options=FULL)
    return state if world.leader else None


def optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, world: World) -> dict:
    """The optimiser's whole state keyed by parameter name (so a checkpoint loads into any
    world size and strategy); gathered under FSDP2 (every rank calls it)."""
    return get_optimizer_state_dict(model, opt, options=FULL if world.sharded else None)


def load_optimizer_state(
    model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict, world: World
) -> None:
    """The inverse of `optimizer_state`: each rank takes its shard of the whole state."""
    options = StateDictOptions(full_state_dict=True) if world.sharded else None
    set_optimizer_state_dict(model, opt, state, options=options)


def full_grad_norm(norm: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_'s total norm as a plain tensor (FSDP2 returns a replicated DTensor)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
