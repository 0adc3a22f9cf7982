"""Text Sokoban: procedurally generated, always solvable puzzles, as a multi-turn environment
and as a single-turn task (the whole plan in one answer).

A level is a pure function of a seed. It is made backwards: boxes start on their
targets (the solved state) and the player walks and *pulls* boxes at random; a
pull reversed is a push, so the level the pulls end in is solvable by
construction. `solve` (breadth-first over (player, boxes)) then finds a shortest
plan, used for demonstrations and to check solvability.

Board text (the usual Sokoban notation): `#` wall, ` ` floor, `.` target,
`$` box, `*` box on a target, `@` player, `+` player on a target. Actions are
`up`, `down`, `left`, `right` (or `u d l r`), read leniently from model text;
anything unreadable is an invalid move: nothing moves, the step costs, no crash.

    env = Sokoban()
    ep = env.episode(seed=7)          # multi-turn: one action per turn
    obs, reward, done, info = ep.step("I will go left")
    SokobanPlan().score(problem, "LLUR")   # single-turn: the whole plan
"""

from __future__ import annotations

import random
import re
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache

from echorl.tasks.base import Problem, first_line, play_actions

Pos = tuple[int, int]  # (row, col)
MOVES: dict[str, Pos] = {"u": (-1, 0), "d": (1, 0), "l": (0, -1), "r": (0, 1)}
WORDS = {"up": "u", "down": "d", "left": "l", "right": "r"}
_ACTION = re.compile(r"\b(up|down|left|right|u|d|l|r)\b", re.IGNORECASE)
_PLAN = re.compile(r"\b(?:up|down|left|right)\b|[udlr]", re.IGNORECASE)


@dataclass(frozen=True)
class Rewards:
    """Per-step rewards; an episode's return is their sum."""

    step: float = -0.01  # every action, valid or not
    box_on: float = 0.1  # a box pushed onto a target
    box_off: float = -0.1  # a box pushed off a target
    solved: float = 1.0  # the last box lands on its target


@dataclass(frozen=True)
class Level:
    walls: frozenset[Pos]
    targets: frozenset[Pos]
    boxes: frozenset[Pos]
    player: Pos
    height: int
    width: int

    @property
    def solved(self) -> bool:
        return self.boxes == self.targets

    def render(self) -> str:
        rows = []
        for r in range(self.height):
            row = ""
            for c in range(self.width):
                p = (r, c)
                if p in self.walls:
                    row += "#"
                elif p == self.player:
                    row += "+" if p in self.targets else "@"
                elif p in self.boxes:
                    row += "*" if p in self.targets else "$"
                else:
                    row += "." if p in self.targets else " "
            rows.append(row)
        return "\n".join(rows)

    def move(self, action: str) -> tuple[Level, int]:
        """The level after `action` (one of u d l r) and the change in boxes on targets;
        the same level back when the move is blocked (a wall, or a box that cannot move)."""
        dr, dc = MOVES[action]
        nxt = (self.player[0] + dr, self.player[1] + dc)
        if nxt in self.walls:
            return self, 0
        boxes = self.boxes
        if nxt in boxes:
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if beyond in self.walls or beyond in boxes:
                return self, 0
            boxes = (boxes - {nxt}) | {beyond}
        moved = Level(self.walls, self.targets, boxes, nxt, self.height, self.width)
        return moved, len(boxes & self.targets) - len(self.boxes & self.targets)


def parse_action(text: str) -> str | None:
    """The first action word or letter in `text` (`u d l r`), or None."""
    m = _ACTION.search(text)
    return None if m is None else WORDS.get(m.group(1).lower(), m.group(1).lower())


def parse_plan(text: str, limit: int = 200) -> list[str]:
    """Every action in the first line of `text`, as letters: `LLUR`, `left left up`, `l,l,u`."""
    out = [WORDS.get(t.lower(), t.lower()) for t in _PLAN.findall(first_line(text))]
    return out[:limit]


def solve(level: Level, max_states: int = 200_000) -> str | None:
    """A shortest plan (letters) that solves `level`, or None if there is none."""
    start = (level.player, level.boxes)
    seen = {start: ""}
    queue = deque([level])
    while queue and len(seen) < max_states:
        cur = queue.popleft()
        path = seen[(cur.player, cur.boxes)]
        if cur.solved:
            return path
        for a in "udlr":
            nxt, _ = cur.move(a)
            key = (nxt.player, nxt.boxes)
            if key not in seen:
                seen[key] = path + a
                queue.append(nxt)
    return None


@lru_cache(maxsize=4096)  # scoring a group regenerates the same level G times
def generate(seed: int, size: int = 5, boxes: int = 1, pulls: int = 30) -> Level:
    """A solvable, unsolved `size` x `size` level (walls around) with `boxes` boxes."""
    rng = random.Random(seed)
    inner = [(r, c) for r in range(1, size - 1) for c in range(1, size - 1)]
    border = {(r, c) for r in range(size) for c in range(size)} - set(inner)
    while True:
        extra = set(rng.sample(inner, rng.randint(0, max(0, (size - 4) * 2))))
        floor = [p for p in inner if p not in extra]
        if len(floor) < boxes + 2:
            continue
        cells = rng.sample(floor, boxes + 1)
        targets = frozenset(cells[:boxes])
        level = Level(frozenset(border | extra), targets, targets, cells[-1], size, size)
        level = _pull_around(level, rng, pulls)
        if not level.solved and solve(level) is not None:
            return level


def _pull_around(level: Level, rng: random.Random, pulls: int) -> Level:
    """Walk the player at random; when a box is behind it, pull the box along half the time."""
    for _ in range(pulls * 4):
        dr, dc = MOVES[rng.choice("udlr")]
        nxt = (level.player[0] + dr, level.player[1] + dc)
        if nxt in level.walls or nxt in level.boxes:
            continue
        behind = (level.player[0] - dr, level.player[1] - dc)
        boxes = level.boxes
        if behind in boxes and rng.random() < 0.5:
            boxes = (boxes - {behind}) | {level.player}
        level = Level(level.walls, level.targets, boxes, nxt, level.height, level.width)
    return level


@dataclass
class Episode:
    """One multi-turn Sokoban game; `step` takes raw model text."""

    level: Level
    max_turns: int
    rewards: Rewards
    turns: int = 0
    actions: list[str | None] = field(default_factory=list)  # None: unparseable

    @property
    def observation(self) -> str:
        return self.level.render() + "\n>"

    def step(self, text: str) -> tuple[str, float, bool, dict]:
        assert self.turns < self.max_turns and not self.level.solved, "the episode is over"
        action = parse_action(text)
        self.actions.append(action)
        self.turns += 1
        reward = self.rewards.step
        valid = False
        if action is not None:
            moved, delta = self.level.move(action)
            valid = moved is not self.level
            self.level = moved
            reward += self.rewards.box_on * max(delta, 0) + self.rewards.box_off * max(-delta, 0)
        if self.level.solved:
            reward += self.rewards.solved
        done = self.level.solved or self.turns >= self.max_turns
        return self.observation, reward, done, {"valid": valid, "solved": self.level.solved}


@dataclass(frozen=True)
class Sokoban:
    """The multi-turn environment (an `Environment`): the board then `>` is the observation,
    the model answers one action and a newline per turn."""

    name: str = "sokoban"
    size: int = 5
    boxes: int = 1
    max_turns: int = 10  # 10 turns of a 5x5 board fit the tiny model's 512 positions
    max_action_tokens: int = 8
    rewards: Rewards = Rewards()

    def level(self, seed: int) -> Level:
        return generate(seed, self.size, self.boxes)

    def problem(self, seed: int) -> Problem:
        plan = solve(self.level(seed)) or ""
        return Problem(
            self.name, seed, self.episode(seed).observation, plan.upper(), {"seed": seed}
        )

    def episode(self, seed: int) -> Episode:
        return Episode(self.level(seed), self.max_turns, self.rewards)

    def replay(self, seed: int, actions: list[str]) -> tuple[list[float], list[str], bool]:
        """Per-turn rewards, observations and success of the recorded action texts, in a fresh
        copy of the environment: how the broker re-scores an episode without trusting the
        sampler. Actions after the episode ended are ignored."""
        ep = self.episode(seed)
        rewards, observations = play_actions(ep, actions, self.max_turns)
        return rewards, observations, ep.level.solved

    def demonstration(self, seed: int) -> list[str]:
        """A shortest solution, one action word per turn."""
        plan = solve(self.level(seed)) or ""
        return [next(w for w, a in WORDS.items() if a == letter) for letter in plan]

    def demonstration_turns(self, problem: Problem) -> list[tuple[str, str]]:
        actions = [a + "\n" for a in self.demonstration(problem.seed)][: self.max_turns]
        _, observations, _ = self.replay(problem.seed, actions)
        return list(zip(actions, observations))


@dataclass(frozen=True)
class SokobanPlan:
    """Single-turn Sokoban: the board in the prompt, the whole plan as the answer (`LLUR`).
    Reward 1 when the plan solves the level, else 0.5 x the fraction of boxes it leaves on
    targets (moves after the level is solved are ignored)."""

    name: str = "sokoban_plan"
    size: int = 5
    boxes: int = 1
    max_new_tokens: int = 24

    def problem(self, seed: int) -> Problem:
        level = generate(seed, self.size, self.boxes)
        plan = solve(level)
        assert plan is not None, f"seed {seed}: generated an unsolvable level"
        return Problem(self.name, seed, level.render() + "\n>", plan.upper(), {"seed": seed})

    def score(self, problem: Problem, completion: str) -> float:
        level = generate(problem.data["seed"], self.size, self.boxes)
        for action in parse_plan(completion):
            if level.solved:
                break
            level, _ = level.move(action)
        if level.solved:
            return 1.0
        return 0.5 * len(level.boxes & level.targets) / len(level.targets)

    def demonstration(self, problem: Problem) -> str:
        return problem.answer
