"""The verifier pool: scores as in process, and a verifier that hangs, spins, eats memory or
kills its process costs that completion a 0 (counted by kind), never the caller's time."""

import time
from pathlib import Path

import pytest

from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import Completion
from echorl.rollout.scoring import score_group
from echorl.rollout.verify import VerifierPool, VerifierSpec
from echorl.tasks import get_task

CODEC = RunTokenizer.builtin()
HOSTILE = f"{Path(__file__).parents[1] / 'fixtures' / 'hostile_task.py'}:Hostile"


def completion(text: str) -> Completion:
    ids = CODEC.encode(text)
    return Completion(token_ids=ids, logprobs=[-0.1] * len(ids), finished=True)


def test_pool_scores_as_in_process():
    task = get_task("add")
    items = [
        (seed, [completion(task.problem(seed).answer)] + [completion(str(k)) for k in range(7)])
        for seed in range(20)
    ]
    with VerifierPool(VerifierSpec("add", CODEC), workers=2) as pool:
        verdicts = pool.score(items)
    for (seed, comps), v in zip(items, verdicts):
        assert v.rewards == score_group(task, task.problem(seed), comps, CODEC)
        assert not v.failed and v.refused is None
    assert sum(sum(v.rewards) for v in verdicts) >= 20  # the right answers are right


def test_misbehaving_verifiers_score_zero_and_are_counted():
    spec = VerifierSpec(HOSTILE, CODEC, time_limit_s=1.0, memory_mb=256)
    # seed 12: 2 + 1 = 3
    bad = [completion(t) for t in ("3", "sleep", "3", "spin", "huge", "die", "power", "3")]
    good = [completion("3")] * 4
    with VerifierPool(spec, workers=2) as pool:
        t0 = time.monotonic()
        verdicts = pool.score([(12, bad), (12, good)])
        took = time.monotonic() - t0
        assert verdicts[0].rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert verdicts[0].failed == {"timeout": 3, "memory": 1, "crash": 1}
        assert verdicts[1].rewards == [1.0] * 4 and not verdicts[1].failed
        assert pool.failures == {"timeout": 3, "memory": 1, "crash": 1}
        # and the pool still works afterwards
        assert pool.score([(12, good)])[0].rewards == [1.0] * 4
    assert took < 30  # three 1 s limits and four worker restarts, not an hour


def test_an_environment_transcript_that_is_not_the_game_is_refused():
    forged = completion("up\n")  # no turns: not an episode
    with VerifierPool(VerifierSpec("sokoban", CODEC)) as pool:
        (v,) = pool.score([(3, [forged])])
    assert v.refused and "multi-turn" in v.refused


def test_a_task_that_cannot_load_fails_the_pool_at_start():
    with pytest.raises(RuntimeError, match="failed to start"):
        VerifierPool(VerifierSpec("tests/no/such/file.py:Nope", CODEC))
