"""The verifier pool: scores as in process, and a verifier that hangs, spins, eats memory or
kills its process costs that completion a 0 (counted by kind), never the caller's time."""

import multiprocessing as mp
import threading
import time
from pathlib import Path

import pytest

from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import Completion
from echorl.rollout.scoring import score_group
from echorl.rollout.verify import VerifierPool, VerifierSpec
from echorl.tasks import get_task

CODEC = RunTokenizer.builtin()
FIXTURES = Path(__file__).parents[1] / "fixtures" / "hostile_task.py"
HOSTILE = f"{FIXTURES}:Hostile"


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


def deliveries():
    """A `done` that keeps each verdict with the time it came, by tag, in arrival order."""
    came: dict = {}

    def done(pairs):
        for tag, verdict in pairs:
            came[tag] = (time.monotonic(), verdict)

    return came, done


def wait_for(predicate, timeout=60.0):
    t_end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < t_end, "timed out"
        time.sleep(0.01)


def test_each_group_is_delivered_the_moment_it_is_scored():
    """Groups scored in one worker batch come back one by one: a group's verdict does not
    wait for a hanging group batched behind it."""
    came, done = deliveries()
    with VerifierPool(VerifierSpec(HOSTILE, CODEC, time_limit_s=1.0), spare=False) as pool:
        pool.submit("blocker", 12, [completion("sleep")], done)
        time.sleep(0.3)  # the worker is in the blocker's call: the next two wait, one batch
        pool.submit("fast", 12, [completion("3")], done)
        pool.submit("slow", 12, [completion("sleep"), completion("3")], done)
        wait_for(lambda: len(came) == 3)
    assert list(came) == ["blocker", "fast", "slow"]
    gap = came["slow"][0] - came["fast"][0]
    print(f"the fast group came {gap:.2f} s before the slow one of its batch")
    assert gap > 0.8  # the slow one's hanging call was given up after 1 s; the fast one not held
    assert came["fast"][1].rewards == [1.0]
    assert came["slow"][1].rewards == [0.0, 1.0] and came["slow"][1].failed == {"timeout": 1}


def test_keys_are_served_in_turn_and_a_spare_replaces_a_killed_worker_at_once():
    """One key's pile of groups that hang the verifier (3 groups of 2 calls, 1 s each) holds
    another key's group back by the one call already running: the keys are served in turn
    and a hanging key's turn comes last, and the spare takes the killed worker's place at
    once. (This task takes 2 s to load, as math-verify's imports take seconds.)"""
    spec = VerifierSpec(f"{FIXTURES}:SlowStart", CODEC, time_limit_s=1.0)
    took = {}
    for spare in (True, False):
        came, done = deliveries()
        with VerifierPool(spec, workers=1, spare=spare) as pool:
            if spare:
                wait_for(lambda: pool._spare is not None)  # the spare is up
            t0 = time.monotonic()
            for n in range(3):
                pool.submit(n, 12, [completion("sleep")] * 2, done, key="hostile")
            pool.submit("honest", 12, [completion("3")], done, key="honest")
            wait_for(lambda came=came: "honest" in came)
            took[spare] = came["honest"][0] - t0
            assert list(came) == ["honest"] and came["honest"][1].rewards == [1.0]
    print(f"the honest group came after {took[True]:.2f} s ({took[False]:.2f} s with no spare)")
    assert took[True] < 1.8  # the running call's 1 s; then at once
    assert took[False] > 2.5  # and a fresh worker's 2 s start too


def test_a_verifier_that_raises_is_counted_as_an_error_and_its_first_line_kept():
    with VerifierPool(VerifierSpec(HOSTILE, CODEC)) as pool:
        (v,) = pool.score([(12, [completion(t) for t in ("raise", "3", "raise")])])
        assert v.rewards == [0.0, 1.0, 0.0] and v.failed == {"error": 2}
        assert "hostile_task.py" in v.error  # the traceback names the verifier's line
        assert pool.failures == {"error": 2}
        assert pool.first_error == "ZeroDivisionError: division by zero"
        pool.score([(12, [completion("raise")])])
        assert pool.failures == {"error": 3}


def test_close_kills_a_worker_stuck_in_a_call_at_once():
    """No stuck call's time limit is waited for; what was not delivered never is, and a
    caller blocked in `score` is told."""
    came, done = deliveries()
    pool = VerifierPool(VerifierSpec(HOSTILE, CODEC, time_limit_s=60.0), workers=2)
    pool.submit("stuck", 12, [completion("spin")], done)
    told, asleep = [], completion("sleep")
    blocked = threading.Thread(target=lambda: told.append(raised(pool.score, [(12, [asleep])])))
    blocked.start()
    time.sleep(0.5)  # both workers in their calls
    t0 = time.monotonic()
    pool.close()
    took = time.monotonic() - t0
    print(f"closed in {took:.3f} s")
    assert took < 1.0 and not came
    assert not [p for p in mp.active_children() if p.name == "echorl-verifier"]
    blocked.join(5)
    assert told and "closed" in str(told[0])


def raised(fn, *args) -> Exception | None:
    try:
        fn(*args)
    except Exception as e:
        return e
    return None


def test_an_environment_transcript_that_is_not_the_game_is_refused():
    forged = completion("up\n")  # no turns: not an episode
    with VerifierPool(VerifierSpec("sokoban", CODEC)) as pool:
        (v,) = pool.score([(3, [forged])])
    assert v.refused and "multi-turn" in v.refused


def test_a_task_that_cannot_load_fails_the_pool_at_start():
    with pytest.raises(RuntimeError, match="failed to start"):
        VerifierPool(VerifierSpec("tests/no/such/file.py:Nope", CODEC))


HOSTILE_GAME = f"{Path(__file__).parents[1] / 'fixtures' / 'hostile_task.py'}:HostileGame"


def test_live_games_move_in_the_pool_as_in_process_and_survive_a_new_worker():
    env = get_task("sokoban")
    actions = {seed: ["up\n", "left\n", "down\n", "right\n", "up\n"] for seed in range(6)}
    with VerifierPool(VerifierSpec("sokoban", CODEC), workers=2) as pool:
        for turn in range(5):
            moved = pool.step([(("t", s), s, actions[s][: turn + 1]) for s in range(6)])
            for s, v in zip(range(6), moved):
                rewards, observations, _ = env.replay(s, actions[s][: turn + 1])
                if len(rewards) <= turn:  # over before this turn: the pool was not asked
                    continue
                assert v.rewards == [rewards[turn]] and not v.failed
                assert v.observation in (observations[turn], None)
            if turn == 2:  # every worker replaced: the games are replayed from their actions
                for w in pool.workers:
                    w.proc.kill()


def test_a_move_that_hangs_spins_or_dies_ends_its_game_with_nothing_else():
    spec = VerifierSpec(HOSTILE_GAME, CODEC, time_limit_s=1.0)
    seeds = list(range(8))  # two games of each kind
    with VerifierPool(spec, workers=2) as pool:
        t0 = time.monotonic()
        first = pool.step([(s, s, ["a\n"]) for s in seeds])
        second = pool.step([(s, s, ["a\n", "b\n"]) for s in seeds])
        took = time.monotonic() - t0
        assert all(v.rewards == [0.25] and v.observation == "ok\n>" for v in first)
        for s, v in zip(seeds, second):
            if s % 4 == 0:
                assert v.rewards == [0.25] and v.observation == "ok\n>" and not v.failed
            else:  # over: no observation, counted
                assert v.observation is None and v.rewards == [0.0]
                assert set(v.failed) == {"timeout" if s % 4 in (1, 2) else "crash"}
        assert pool.failures == {"timeout": 4, "crash": 2}
        # the fair games play on
        third = pool.step([(s, s, ["a\n", "b\n", "c\n"]) for s in (0, 4)])
        assert [v.observation for v in third] == ["ok\n>"] * 2
    assert took < 30


def test_a_sampler_playing_a_hanging_environment_finishes_its_episodes(tiny_saved):
    """`rollout` of a multi-turn environment with a pool: games whose move hangs end after
    that turn with return 0; the others play to the end."""
    from echorl.config import SamplingConfig
    from echorl.models import load_policy
    from echorl.rollout.generate import rollout
    from echorl.rollout.hf import HFBackend

    env = get_task(HOSTILE_GAME)
    backend = HFBackend(*load_policy(tiny_saved))
    problems = [env.problem(s) for s in range(4)]
    params = SamplingConfig(temperature=1.0)
    ids = backend.codec.encode_prompts([p.prompt for p in problems], params)
    with VerifierPool(VerifierSpec(HOSTILE_GAME, CODEC, time_limit_s=1.0)) as pool:
        groups = rollout(backend, env, problems, ids, 2, params, seed=0, scorer=pool)
    fair, *hostile = groups
    for c, r in zip(fair.completions, fair.rewards):  # played on until done or the model quit
        assert r == 0.25 * len(c.turns)
    for g in hostile:
        for c, r in zip(g.completions, g.rewards):
            assert len(c.turns) <= 2
            assert r == (0.25 if len(c.turns) == 1 else 0.0)


def test_a_lower_tier_is_served_first_then_groups_in_turn_then_their_members():
    """The broker's keys are (tier, group, who): unproven identities' groups (tier 1, their
    operator the group) wait behind proven samplers' (tier 0, each its own group), whatever
    came first; an operator's identities share one turn between them, in turn; plain keys
    are tier 0 and take turns as before."""
    from echorl.rollout.verify import _Job, _Turns

    turns = _Turns()
    keys = [
        (1, "operator:", "s1"),  # 0: three sybils of the shared token, then a named operator
        (1, "operator:", "s2"),  # 1
        (1, "operator:", "s3"),  # 2
        (1, "operator:m", "m1"),  # 3
        (0, "a", "a"),  # 4: proven samplers
        (0, "b", "b"),  # 5
        (0, "a", "a"),  # 6
        (1, "operator:", "s1"),  # 7
        "plain",  # 8: a key of another submitter: tier 0
    ]
    for n, key in enumerate(keys):
        turns.put(_Job(n, ("score", 0, [], 0.0), None, key))
    order = [job.tag for _ in keys for job in turns.take(feeders=1000)]
    # tier 0: a, b, plain in turn (a's second after the others); then the shared token's
    # identities and operator m, group by group and within the shared group one by one
    assert order == [4, 5, 8, 6, 0, 3, 1, 2, 7]
