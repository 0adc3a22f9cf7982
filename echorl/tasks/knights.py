"""Knights and knaves: who tells the truth? A logic-puzzle family with an exact verifier.

Each of n islanders is a knight (always tells the truth) or a knave (always lies),
and each makes one statement about the others. A puzzle is drawn from a seed and
kept only if exactly one assignment of kinds is consistent with every statement
(checked by trying all 2^n), so the answer is unique and the verifier exact.

Statements: `X=K` (X is a knight), `X=N` (a knave), `X=K&Y=N` (both hold),
`X=N|Y=N` (at least one holds), `X~Y` (same kind), `X!Y` (different kinds).

    compact (the tiny model):  `kk A:B=N. B:A=K&C=K. C:A~B. ->`   answer `KNK`
    text (real checkpoints):   `A says: "B is a knave." ... Who is a knight?` answer `KNK`

The answer is one letter per islander in order, K or N; the verifier also reads
`A=K B=N C=K` and `A: knight, B: knave, C: knight`. Anything else scores 0.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass

from echorl.tasks.base import Problem, first_line

NAMES = "ABCDE"
Assignment = tuple[bool, ...]  # True = knight, one per islander


def holds(statement: tuple, kinds: Assignment) -> bool:
    """Whether `statement` is true of `kinds`."""
    op, *args = statement
    if op == "is":
        who, knight = args
        return kinds[who] == knight
    if op == "and":
        return holds(args[0], kinds) and holds(args[1], kinds)
    if op == "or":
        return holds(args[0], kinds) or holds(args[1], kinds)
    a, b = args
    return (kinds[a] == kinds[b]) == (op == "same")


def consistent(statements: list[tuple], kinds: Assignment) -> bool:
    """Knights' statements are true, knaves' are false."""
    return all(holds(s, kinds) == kinds[i] for i, s in enumerate(statements))


def solutions(statements: list[tuple]) -> list[Assignment]:
    n = len(statements)
    return [k for k in itertools.product((True, False), repeat=n) if consistent(statements, k)]


def _random_statement(rng: random.Random, speaker: int, n: int) -> tuple:
    others = [i for i in range(n) if i != speaker] or [speaker]
    atom = lambda: ("is", rng.choice(others), rng.random() < 0.5)  # noqa: E731
    kind = rng.choice(["is", "is", "and", "or", "same", "diff"])
    if kind == "is":
        return atom()
    if kind in ("and", "or"):
        return (kind, atom(), atom())
    a, b = rng.sample(range(n), 2)
    return (kind, a, b)


def compact(statement: tuple) -> str:
    op, *args = statement
    if op == "is":
        return f"{NAMES[args[0]]}={'K' if args[1] else 'N'}"
    if op in ("and", "or"):
        return compact(args[0]) + ("&" if op == "and" else "|") + compact(args[1])
    return NAMES[args[0]] + ("~" if op == "same" else "!") + NAMES[args[1]]


def text(statement: tuple) -> str:
    op, *args = statement
    if op == "is":
        return f"{NAMES[args[0]]} is a {'knight' if args[1] else 'knave'}"
    if op in ("and", "or"):
        return f"{text(args[0])} {op} {text(args[1])}"
    return f"{NAMES[args[0]]} and {NAMES[args[1]]} are {'the same' if op == 'same' else 'different'} kinds"


_PAIR = re.compile(r"\b([A-E])\s*[:=]?\s*(knight|knave|k|n)\b", re.IGNORECASE)


def parse_answer(answer: str, n: int) -> Assignment | None:
    """Kinds from the first line: `KNK`, `A=K B=N C=K` or `A: knight, B: knave, C: knight`."""
    line = first_line(answer)
    letters = line.replace(" ", "").upper()
    if len(letters) == n and set(letters) <= {"K", "N"}:
        return tuple(c == "K" for c in letters)
    pairs = {
        m.group(1).upper(): m.group(2).lower() in ("k", "knight") for m in _PAIR.finditer(line)
    }
    if pairs and set(pairs) == set(NAMES[:n]):
        return tuple(pairs[c] for c in NAMES[:n])
    return None


@dataclass(frozen=True)
class KnightsKnaves:
    name: str = "knights"
    people: int = 3
    style: str = "compact"  # or "text"
    max_new_tokens: int = 8

    def statements(self, seed: int) -> list[tuple]:
        rng = random.Random(seed)
        while True:
            said = [_random_statement(rng, i, self.people) for i in range(self.people)]
            if len(solutions(said)) == 1:
                return said

    def problem(self, seed: int) -> Problem:
        said = self.statements(seed)
        (kinds,) = solutions(said)
        answer = "".join("K" if k else "N" for k in kinds)
        if self.style == "compact":
            prompt = "kk " + " ".join(f"{NAMES[i]}:{compact(s)}." for i, s in enumerate(said))
            prompt += " ->"
        else:
            lines = [f'{NAMES[i]} says: "{text(s)}."' for i, s in enumerate(said)]
            prompt = (
                f"On an island, knights always tell the truth and knaves always lie. "
                f"{' '.join(lines)} For each of {', '.join(NAMES[: self.people])} in order, "
                f"answer K for knight or N for knave, e.g. {'K' * self.people}. Answer:"
            )
        return Problem(self.name, seed, prompt, answer, {"kinds": kinds})

    def score(self, problem: Problem, completion: str) -> float:
        return float(parse_answer(completion, self.people) == tuple(problem.data["kinds"]))

    def demonstration(self, problem: Problem) -> str:
        return problem.answer
