"""Countdown: reach a target with the given numbers and + - * /, each number once.

`3 5 7>22:` -> `3*5+7`. The verifier parses the answer with `ast` and evaluates
only a whitelist of node types in exact rational arithmetic; `eval` is never
called. Any expression that uses exactly the given multiset of numbers and hits
the target scores 1, so many answers are right (the one in `Problem.answer` is
just one of them).
"""

from __future__ import annotations

import ast
import operator
import random
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from echorl.tasks.base import Problem, first_line

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
MAX_EXPR_CHARS = 64


class InvalidExpression(ValueError):
    pass


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression and the integer literals it uses.

    Raises InvalidExpression for anything but integer literals, + - * /, and
    parentheses, or on division by zero.
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise InvalidExpression(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError) as e:
        raise InvalidExpression(str(e)) from e
    numbers: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise InvalidExpression("division by zero")
            return _OPS[type(node.op)](left, right)
        raise InvalidExpression(f"{type(node).__name__} is not allowed")

    return walk(tree.body), numbers


@dataclass(frozen=True)
class Countdown:
    name: str = "countdown"
    count: int = 3
    max_number: int = 9
    max_new_tokens: int = 16

    def problem(self, seed: int) -> Problem:
        rng = random.Random(seed)
        while True:  # draw until the random expression has a positive integer value
            numbers = [rng.randint(1, self.max_number) for _ in range(self.count)]
            expr = str(numbers[0])
            for n in numbers[1:]:
                op = rng.choice([ast.Add, ast.Sub, ast.Mult, ast.Div])
                # Built left to right; parentheses keep that order under * and /.
                wrap = op in (ast.Mult, ast.Div) and any(c in expr for c in "+-")
                expr = f"({expr}){_SYMBOL[op]}{n}" if wrap else f"{expr}{_SYMBOL[op]}{n}"
            value, _ = evaluate(expr)
            if value.denominator == 1 and value > 0:
                break
        prompt = " ".join(map(str, sorted(numbers))) + f">{int(value)}:"
        return Problem(
            self.name, seed, prompt, expr, data={"numbers": sorted(numbers), "target": int(value)}
        )

    def score(self, problem: Problem, completion: str) -> float:
        try:
            value, used = evaluate(first_line(completion))
        except InvalidExpression:
            return 0.0
        ok = Counter(used) == Counter(problem.data["numbers"]) and value == problem.data["target"]
        return float(ok)

    def demonstration(self, problem: Problem) -> str:
        return problem.answer
