"""A non-finite loss or gradient never reaches the weights, and weights with a NaN or inf
are never published."""

import pytest
import torch

from echorl.config import load_config
from echorl.protocol import Completion, ScoredGroup
from echorl.trainer.decoupled import NonFiniteWeights, publishable
from echorl.trainer.update import build_optimizer, build_scheduler, groups_to_batch, train_on_batch


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


def test_weights_with_a_nan_are_never_published(tiny):
    model, _ = tiny
    assert publishable(model, 3)[0]  # sound weights: what would be uploaded
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteWeights, match="non-finite values in 1 tensors"):
        publishable(model, 3)
