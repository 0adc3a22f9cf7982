"""Pushes parsed in a process of their own, so a big one never stalls the server.

pydantic parses and validates a push in Rust, holding the interpreter lock all the while:
a 16 MB push is a few hundred milliseconds in which the server's event loop answers
nobody (/healthz, the trainer's pull), whatever thread does the parsing. Here a pool of
`workers` spawned processes parses each push body, applies the rules that need only the
run's settings (`Limits.check`: no completion longer than the run generates; turns only
where the task makes them) and hands back one `Arrival` per group: the few numbers the
store checks against the job, and the group's JSON, which is stored as it is and which the
verifier parses in its own process. The server's process moves bytes and never builds a
big group's token lists.

    parser = PushParser(Limits.of(task, cfg, codec))
    sampler_id, arrivals = await parser.parse(body, many=True)   # or (job id, why refused)
    parser.close()
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import ValidationError

from echorl.config import RunConfig
from echorl.protocol import (
    Arrival,
    ProtocolError,
    PushManyRequest,
    PushRequest,
    ScoredGroup,
    Unprocessable,
)
from echorl.stopping import die_with_parent
from echorl.tasks import Environment, Task, is_environment

if TYPE_CHECKING:
    from echorl.models.tokenizer import RunTokenizer


@dataclass(frozen=True)
class Limits:
    """What a group's completions may be, from the run's task and settings alone."""

    task: str
    max_new_tokens: int  # single-turn: tokens per completion
    max_turns: int = 0  # multi-turn: model turns per episode (0: single-turn)
    max_action_tokens: int = 0  # and tokens per turn
    stops: frozenset[int] = frozenset()  # tokens that end generation (a completion, a turn)
    never: frozenset[int] = frozenset()  # tokens generation never emits (never_emitted)

    @classmethod
    def of(cls, task: Task | Environment, cfg: RunConfig, codec: RunTokenizer) -> Limits:
        if is_environment(task):  # a turn ends at eos or at the action's newline (`play`)
            stops = frozenset({codec.eos_id, codec.encode("\n")[-1]})
            never = frozenset(codec.never_emitted)
            return cls(task.name, 0, task.max_turns, task.max_action_tokens, stops, never)
        max_new = cfg.sampling.max_new_tokens or task.max_new_tokens
        never = frozenset(codec.never_emitted)
        return cls(task.name, max_new, stops=frozenset({codec.eos_id}), never=never)

    def check(self, group: ScoredGroup) -> None:
        """No completion longer than the run lets a sampler generate (Unprocessable): the
        task's `max_new_tokens` (or sampling.max_new_tokens), or for an environment its
        `max_turns` turns of `max_action_tokens` (observations are checked by replay). A
        single-turn task's completions carry no `turns`: all of it is the model's, so the
        tokens scored are the tokens trained on and audited. And a completion is only what
        generation emits: a stop token (eos; a turn's newline) ends a completion or a
        model turn, so none comes before its end (an answer behind a leading eos would be
        scored, the decode dropping the eos, while the loss trained the eos first), and no
        other special token (a pad) is in it at all: every backend keeps generation from
        emitting one, and the decode would drop it from the text the verifier scores."""
        for k, c in enumerate(group.completions):
            if self.max_turns:
                turns = c.turns or []
                model = sum(t.end - t.start for t in turns)
                if len(turns) > self.max_turns or model > self.max_turns * self.max_action_tokens:
                    raise Unprocessable(
                        f"completions[{k}]: {len(turns)} turns of {model} tokens, but "
                        f"{self.task} allows {self.max_turns} of {self.max_action_tokens}"
                    )
                for n, (start, end) in enumerate(c.spans):
                    self.emitted(c.token_ids[start:end], f"completions[{k}] turn {n}")
            elif c.turns is not None:
                # The loss and the audit train only a model turn's tokens; the verifier reads
                # them all. Turns a single-turn task never makes would credit the model for
                # text marked as the environment's (an answer behind a lone eos).
                raise Unprocessable(
                    f"completions[{k}]: turns on a single-turn task ({self.task}); every "
                    "token of its completion is the model's"
                )
            elif len(c.token_ids) > self.max_new_tokens:
                raise Unprocessable(
                    f"completions[{k}]: {len(c.token_ids)} tokens, but the run generates at "
                    f"most {self.max_new_tokens} (max_new_tokens)"
                )
            else:
                self.emitted(c.token_ids, f"completions[{k}]")

    def emitted(self, ids: list[int], where: str) -> None:
        """Unprocessable when `ids` (a model's run of tokens) are not what generation emits:
        a stop token before the last of them, or a token generation never emits."""
        if not self.never.isdisjoint(ids):
            at = next(i for i, t in enumerate(ids) if t in self.never)
            raise Unprocessable(
                f"{where}: token {ids[at]} at position {at} of {len(ids)} is a special token "
                "generation never emits (every backend suppresses it; the decode would drop "
                "it from the text scored)"
            )
        if self.stops.isdisjoint(ids[:-1]):  # the common case, in C
            return
        early = next(i for i, t in enumerate(ids) if t in self.stops)
        raise Unprocessable(
            f"{where}: stop token {ids[early]} at position {early} of {len(ids)}: "
            "generation ends at its first stop token, so none comes before the end"
        )


# The sampler's id, and each group's arrival or (its job id, why it is refused).
Parsed = tuple[str, list[Arrival | tuple[int, str]]]


def parse(body: bytes, many: bool, limits: Limits) -> Parsed | list[dict]:
    """A push body's groups, each checked against `limits`; the validation errors (as
    pydantic lists them, without the input) when the body is malformed."""
    try:
        if many:
            request = PushManyRequest.model_validate_json(body)
            sampler_id, groups = request.sampler_id, request.groups
        else:
            request = PushRequest.model_validate_json(body)
            sampler_id, groups = request.sampler_id, [request.group]
    except ValidationError as e:
        return e.errors(include_input=False, include_url=False, include_context=False)
    out: list[Arrival | tuple[int, str]] = []
    for group in groups:
        try:
            limits.check(group)
            out.append(Arrival.of(group))
        except ProtocolError as e:
            if not many:
                raise
            out.append((group.job_id, str(e)))
    return sampler_id, out


def _start_parser() -> None:
    die_with_parent()  # a broker killed outright leaves no parser behind
    os.nice(5)  # below the server: parsing waits for /healthz and the trainer, not the reverse


class PushParser:
    """`workers` processes that parse push bodies (see the module docstring)."""

    def __init__(self, limits: Limits, workers: int = 1):
        self.limits = limits
        self.pool = ProcessPoolExecutor(
            workers, mp_context=mp.get_context("spawn"), initializer=_start_parser
        )

    async def parse(self, body: bytes, many: bool) -> Parsed | list[dict]:
        """`parse(body)` in a parser process; a refused single push raises its error."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, parse, body, many, self.limits)

    def close(self) -> None:
        """Stop the parsers now: waited for, since the broker may be about to die by the
        signal that stopped it (no exit handlers, which would otherwise stop them)."""
        self.pool.shutdown(wait=True, cancel_futures=True)
