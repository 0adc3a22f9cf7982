"""Held-out evaluation: greedy accuracy, and sampled pass@1 that agrees with it at temperature 0."""

from dataclasses import dataclass

import pytest

from echorl.config import SamplingConfig
from echorl.models import load_policy
from echorl.rollout.evaluate import evaluate
from echorl.rollout.hf import HFBackend
from echorl.tasks.base import Problem, success


@dataclass(frozen=True)
class FirstByte:
    """Right when the completion starts with a byte below 'n': a random model gets some right."""

    name: str = "first_byte"
    max_new_tokens: int = 2

    def problem(self, seed: int) -> Problem:
        return Problem(self.name, seed, f"q{seed % 997}:", "")

    def score(self, problem: Problem, completion: str) -> float:
        return float(bool(completion) and completion[0] < "n")


@pytest.fixture(scope="module")
def backend(tiny_saved):
    return HFBackend(*load_policy(tiny_saved))


def test_sampled_pass1_is_greedy_at_temperature_zero(backend):
    zero = evaluate(backend, FirstByte(), 40, params=SamplingConfig(temperature=0.0), samples=3)
    assert zero.pass1 == zero.accuracy and zero.samples == 3


def test_sampled_pass1_is_a_mean_over_samples(backend):
    hot = evaluate(backend, FirstByte(), 40, params=SamplingConfig(temperature=1.0), samples=4)
    assert 0.0 < hot.pass1 < 1.0
    assert hot.pass1 * 40 * 4 == pytest.approx(round(hot.pass1 * 40 * 4))  # whole successes
    assert set(hot.record()) == {"eval/accuracy", "eval/reward", "eval/pass1"}
    assert "eval/pass1" not in evaluate(backend, FirstByte(), 8).record()


def test_success_tolerates_the_rounding_of_a_sum_of_step_rewards():
    assert success(sum([-0.01] * 10) + 1.1) and success(1.0) and not success(0.99)
