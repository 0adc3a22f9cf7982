"""A non-finite loss or gradient never reaches the weights, and weights with a NaN or inf
are never published."""

import pytest
import torch

from echorl.config import load_config
from echorl.protocol import Completion, ScoredGroup
from echorl.trainer.brokerio import nonfinite_tensors
from echorl.trainer.decoupled import publishable
from echorl.trainer.update import build_optimizer, build_scheduler, groups_to_batch, train_on_batch
from echorl.trainer.weights import safetensors_size, write_safetensors


def groups(n=2):
    c = Completion(token_ids=[20, 21, 1], logprobs=[-0.5] * 3, finished=True)
    d = Completion(token_ids=[22, 1], logprobs=[-0.5] * 2, finished=True)
    return [
        ScoredGroup(job_id=k, version=0, prompt_ids=[5, 6], completions=[c, d], rewards=[1.0, 0.0])
        for k in range(n)
    ]


def test_a_non_finite_loss_skips_the_minibatch_and_leaves_the_weights(tiny):
    model, tok = tiny
    cfg = load_config(None, ["train.minibatches=2", "train.batch_prompts=2", "train.group_size=2"])
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim)
    batch = groups_to_batch(groups(), tok.pad_token_id, cfg)
    batch.advantages[:] = float("nan")  # what a broken batch would make of the loss
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = train_on_batch(model, opt, sched, batch, cfg)
    assert metrics["optim/nonfinite_skipped"] == 2.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    batch = groups_to_batch(groups(), tok.pad_token_id, cfg)  # a sound batch still trains
    assert train_on_batch(model, opt, sched, batch, cfg)["optim/nonfinite_skipped"] == 0.0
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def as_file(state):
    buffer = bytearray(safetensors_size(state, None))
    write_safetensors(state, None, memoryview(buffer))
    return memoryview(buffer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_io_process_finds_every_nan_and_inf_and_nothing_else(dtype):
    big = torch.finfo(dtype).max
    sound = torch.tensor([0.0, -0.0, 1.5, -big, big, torch.finfo(dtype).tiny / 2], dtype=dtype)
    state = {"ok": sound, "ids": torch.tensor([-1, 2**31 - 1], dtype=torch.int32)}
    for bad in (float("nan"), float("inf"), float("-inf")):
        state[f"bad{bad}"] = torch.cat([sound, torch.tensor([bad], dtype=dtype)])
    state["empty"] = torch.zeros(0, dtype=dtype)
    assert nonfinite_tensors(as_file(state)) == ["badnan", "badinf", "bad-inf"]
    assert nonfinite_tensors(as_file(state), chunk=2) == ["badnan", "badinf", "bad-inf"]


def test_weights_with_a_nan_are_found_in_what_would_be_published(tiny):
    model, _ = tiny
    state, meta = publishable(model, 3)
    assert state and nonfinite_tensors(as_file(state)) == []  # sound weights: uploaded
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    state, meta = publishable(model, 3)
    assert len(nonfinite_tensors(as_file(state))) == 1
