import math

import pytest
import torch

from echorl.config import AdvantageConfig
from echorl.trainer.advantages import compute_advantages

R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])


def test_grpo_normalises_by_the_sample_std():
    a = compute_advantages(R, AdvantageConfig(type="grpo"))
    s = math.sqrt(1 / 3)  # sample std of [1, 0, 0, 1]
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / (s + 1e-6)
    assert torch.allclose(a[0], expected[0], atol=1e-6)
    assert torch.equal(a[1], torch.zeros(4))  # a flat group carries no signal


def test_drgrpo_only_centres():
    a = compute_advantages(R, AdvantageConfig(type="drgrpo"))
    assert torch.allclose(a, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))


def test_rloo_subtracts_the_mean_of_the_others():
    a = compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0]]), AdvantageConfig(type="rloo"))
    # For a 1: 1 - 1/4; for a 0: 0 - 2/4.
    assert torch.allclose(a, torch.tensor([[0.75, -0.5, -0.5, 0.75, -0.5]]))


def test_advantages_reject_a_flat_list():
    with pytest.raises(AssertionError, match="n_groups, G"):
        compute_advantages(torch.tensor([1.0, 0.0]), AdvantageConfig())
