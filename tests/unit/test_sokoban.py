"""Sokoban: solvable generation, move rules, lenient parsing, reward accounting."""

import pytest

from echorl.tasks.sokoban import (
    Episode,
    Level,
    Rewards,
    Sokoban,
    SokobanPlan,
    generate,
    parse_action,
    parse_plan,
    solve,
)


def board(text: str) -> Level:
    rows = text.strip("\n").split("\n")
    cells = {(r, c): ch for r, row in enumerate(rows) for c, ch in enumerate(row)}
    pick = lambda chars: frozenset(p for p, ch in cells.items() if ch in chars)  # noqa: E731
    (player,) = pick("@+")
    return Level(pick("#"), pick(".*+"), pick("$*"), player, len(rows), len(rows[0]))


def play(level: Level, plan: str) -> Level:
    for a in plan:
        level, _ = level.move(a)
    return level


def test_a_thousand_generated_levels_are_unsolved_and_solvable():
    lengths = []
    for seed in range(1000):
        level = generate(seed)
        assert not level.solved
        assert len(level.boxes) == len(level.targets) == 1
        plan = solve(level)
        assert plan is not None, f"seed {seed} is unsolvable:\n{level.render()}"
        assert play(level, plan).solved
        lengths.append(len(plan))
    assert generate(7) == generate(7)  # a pure function of the seed
    assert len({generate(s).render() for s in range(1000)}) > 300  # and varied
    assert max(lengths) > 3 * min(lengths)


def test_bigger_levels_with_two_boxes_are_solvable():
    for seed in range(30):
        level = generate(seed, size=6, boxes=2)
        assert len(level.boxes) == 2 and solve(level) is not None


def test_move_rules_walls_boxes_and_targets():
    level = board("""
######
#@$$.#
#  $ #
#    #
######""")
    assert level.move("u") == (level, 0)  # a wall
    assert level.move("r") == (level, 0)  # a box into a box does not move
    down, _ = level.move("d")
    assert down.player == (2, 1)
    pushed, delta = down.move("r")  # walks next to the box at (2, 3)
    pushed, delta = pushed.move("r")  # pushes it to (2, 4)
    assert (2, 4) in pushed.boxes and pushed.player == (2, 3) and delta == 0
    assert pushed.move("r") == (pushed, 0)  # a box into a wall does not move
    onto = board("""
#####
#@$.#
#####""")
    after, delta = onto.move("r")
    assert delta == 1 and after.solved and after.render() == "#####\n# @*#\n#####"


@pytest.mark.parametrize(
    "text,action",
    [
        ("left", "l"),
        ("I will go LEFT now.", "l"),
        ("Down.", "d"),
        ("r", "r"),
        ("move: up, then right", "u"),
        ("upward", None),
        ("", None),
        ("jump!", None),
        ("\x00\xff", None),
    ],
)
def test_actions_are_read_leniently(text, action):
    assert parse_action(text) == action


def test_plans_are_read_from_the_first_line():
    assert parse_plan("LLUR") == list("llur")
    assert parse_plan("left, left up\nright") == list("llu")
    assert parse_plan("") == []
    assert len(parse_plan("l" * 1000)) == 200


def test_episode_reward_accounting():
    r = Rewards()
    ep = Episode(board("#####\n#@$.#\n#   #\n#####"), max_turns=5, rewards=r)
    obs, reward, done, info = ep.step("jump")  # unparseable: an invalid move, no crash
    assert (reward, done, info["valid"]) == (r.step, False, False) and obs == ep.observation
    _, reward, done, info = ep.step("left")  # into a wall
    assert (reward, info["valid"]) == (r.step, False)
    _, reward, done, info = ep.step("right")  # the box onto its target: solved
    assert reward == pytest.approx(r.step + r.box_on + r.solved)
    assert done and info["solved"] and ep.actions == [None, "l", "r"]
    with pytest.raises(AssertionError, match="over"):
        ep.step("up")
    off = Episode(board("#####\n#@*.#\n#####"), max_turns=1, rewards=r)
    _, reward, done, _ = off.step("r")  # pushed off one target onto another: +0
    assert reward == pytest.approx(r.step) and done is True  # solved again
    timeout = Episode(board("######\n#@$ .#\n######"), max_turns=2, rewards=r)
    assert timeout.step("l")[2] is False and timeout.step("l")[2] is True  # out of turns


def test_replay_rescores_from_the_seed_alone():
    env = Sokoban()
    demo = env.demonstration(3)
    rewards, _, solved = env.replay(3, demo)
    assert solved and len(rewards) == len(demo)
    assert sum(rewards) == pytest.approx(len(demo) * -0.01 + 0.1 + 1.0)
    rewards, observations, solved = env.replay(3, ["nonsense"] * 50)
    assert (rewards, solved) == ([-0.01] * env.max_turns, False)
    assert observations == [env.problem(3).prompt] * env.max_turns  # nothing moved


def test_single_turn_plan_task():
    task = SokobanPlan()
    p = task.problem(11)
    assert p.prompt.endswith("\n>") and p.prompt.count("\n") == 5
    assert task.score(p, task.demonstration(p)) == 1.0
    assert task.score(p, task.demonstration(p).lower() + "LLLL") == 1.0  # moves after: ignored
    assert task.score(p, "") == 0.0
    assert task.score(p, "\x00garbage") == 0.0
