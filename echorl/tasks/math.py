"""Math reasoning with verified answers: a user's JSONL file, or procedural word problems.

    task.name = "jsonl:data/gsm.jsonl"    # one {"prompt": ..., "answer": ...} object a line
    task.name = "math_word"               # multi-step arithmetic word problems, built here

Answers are scored with `math-verify`: the model's answer is taken from its last
`\\boxed{...}` or, failing that, its last non-empty line, parsed (LaTeX or plain
expressions) and checked for mathematical equivalence with the reference, so
`\\boxed{1/2}`, `0.5` and `\\frac{1}{2}` all match `1/2`. math-verify's own timeouts
use signals, which only work on a main thread (the broker scores on worker
threads), so they are off here and the text is capped in length instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property, lru_cache
from pathlib import Path

from echorl.tasks.base import Problem

MAX_ANSWER_CHARS = 200  # bounds sympy's work on untrusted text
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def extract_answer(completion: str) -> str:
    """The last `\\boxed{...}`, else the last non-empty line, else ''."""
    boxed = _BOXED.findall(completion)
    if boxed:
        return boxed[-1].strip()
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def equivalent(answer: str, reference: str) -> bool:
    """math-verify's equivalence of two answers (LaTeX or plain); False on anything unparsable.
    Plain numbers on both sides (`14`, `-3.5`, `1/2`) are compared exactly without it, and
    parses are cached (a reference is parsed once per process, a group's repeated answers
    once): a full parse costs 2-5 ms, the fast path microseconds."""
    answer = extract_answer(answer)[:MAX_ANSWER_CHARS]
    if not answer:
        return False
    ours, theirs = _number(answer), _number(reference)
    if ours is not None and theirs is not None:
        return ours == theirs
    from math_verify import verify  # imported here: the broker starts without sympy

    gold, pred = _parse(reference), _parse(answer)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


_NUMBER = re.compile(r"(-?\d+(?:\.\d+)?)(?:\s*/\s*([1-9]\d*))?\.?")  # 12, -0.5, 3/4, 7.
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")  # 1,000 and 12,345.5


def _number(text: str) -> Fraction | None:
    """`text` as an exact number when it is a plain one, else None (math-verify decides)."""
    text = text.strip().strip("$").strip()
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    m = _NUMBER.fullmatch(text)
    if not m:
        return None
    value = Fraction(m.group(1))
    return value / int(m.group(2)) if m.group(2) else value


@lru_cache(maxsize=4096)
def _parse(text: str):
    from math_verify import parse

    # It warns on every call that its timeouts are off; they are off on purpose (see above).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return parse(f"${text}$", parsing_timeout=None)


@dataclass(frozen=True)
class MathJSONL:
    """Problems from a JSONL file; problem(seed) is row `seed % rows`."""

    path: str
    max_new_tokens: int = 512

    @cached_property
    def name(self) -> str:
        """The file's name and a digest of its content, not its path: the same problems on
        two machines (or in two folders) are one task, with one problem stream."""
        digest = hashlib.sha256(Path(self.path).read_bytes()).hexdigest()[:12]
        return f"jsonl:{Path(self.path).name}@{digest}"

    @cached_property
    def rows(self) -> list[dict]:
        rows = []
        for i, line in enumerate(Path(self.path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.path}:{i}: not a JSON object: {e.msg}") from None
            if not isinstance(row, dict) or not {"prompt", "answer"} <= row.keys():
                raise ValueError(f"{self.path}:{i}: each line needs 'prompt' and 'answer'")
            rows.append({"prompt": str(row["prompt"]), "answer": str(row["answer"])})
        if not rows:
            raise ValueError(f"{self.path} holds no problems")
        return rows

    def problem(self, seed: int) -> Problem:
        row = self.rows[seed % len(self.rows)]
        return Problem(self.name, seed, row["prompt"], row["answer"])

    def score(self, problem: Problem, completion: str) -> float:
        return float(equivalent(completion, problem.answer))

    def demonstration(self, problem: Problem) -> str:
        return f"\\boxed{{{problem.answer}}}"


_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]
_THINGS = ["apples", "books", "coins", "marbles", "pens", "shells", "stamps", "cards"]


@dataclass(frozen=True)
class WordProblems:
    """Multi-step arithmetic word problems with exact integer answers, e.g.
    `Ana has 7 pens. She buys 3 packs of 4 pens, then gives away 5. How many pens does she
    have now?` -> 14. Two to four steps; every intermediate count stays non-negative."""

    name: str = "math_word"
    steps: tuple[int, int] = (2, 3)
    max_new_tokens: int = 8

    def problem(self, seed: int) -> Problem:
        rng = random.Random(seed)
        who, thing = rng.choice(_NAMES), rng.choice(_THINGS)
        count = rng.randint(2, 20)
        text = [f"{who} has {count} {thing}."]
        for _ in range(rng.randint(*self.steps)):
            kind = rng.choice(["buy", "packs", "lose", "double"])
            if kind == "buy":
                n = rng.randint(1, 9)
                count += n
                text.append(f"Then gets {n} more.")
            elif kind == "packs":
                packs, each = rng.randint(2, 4), rng.randint(2, 5)
                count += packs * each
                text.append(f"Then buys {packs} packs of {each}.")
            elif kind == "lose" and count > 1:
                n = rng.randint(1, count - 1)
                count -= n
                text.append(f"Then gives away {n}.")
            else:
                count *= 2
                text.append("Then doubles them.")
        text.append(f"How many {thing} now?")
        return Problem(self.name, seed, " ".join(text) + " =", str(count))

    def score(self, problem: Problem, completion: str) -> float:
        return float(equivalent(completion.split("\n", 1)[0], problem.answer))

    def demonstration(self, problem: Problem) -> str:
        return problem.answer
