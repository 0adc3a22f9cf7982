"""Wire types shared by the broker, its client, the sampler and the trainer.

Every message between roles is one of these pydantic models, serialised as JSON;
each says who produces it and who consumes it. They are defined here once and
imported everywhere, never redefined. Validation is in two layers:

- shape rules that need no state live in the models (lengths agree, log-probs
  are finite and <= 0, ids are non-negative, sizes are bounded), so a malformed
  body is refused before it reaches any handler;
- rules that need the broker's state (vocabulary size, the group size that was
  leased, the latest published version) are `Arrival.check_against`,
  which raises an error of the `ProtocolError` tree, whose `status` the broker answers with.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_GROUP_SIZE = 1024
MAX_COMPLETION_TOKENS = 32768
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # no slashes, no dots first: safe in paths
SHA256_PATTERN = r"^[0-9a-f]{64}$"
TICKET_PATTERN = r"^[0-9]{1,12}\.[0-9a-f]{64}$"  # a peer's ticket: EXPIRES.HMAC (rollout/peers.py)
# Where a sampler serves weights to its peers: http, a host (name, IPv4 or [IPv6]), a port.
PEER_URL_PATTERN = r"^http://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}$"
MAX_PROMPT_TOKENS = 1 << 17
MAX_TASK_NAME = 4096  # a built-in name, jsonl:PATH, rg:DATASET or module:Name
MAX_ID = 2**62  # ids, versions and steps fit SQLite's signed 64-bit integers
# A sampled token's log-prob below this had a chance under 4e-44 of being drawn: a sampler
# that reports one is broken or lying (and -1e30 would make the loss inf).
MIN_LOGPROB = -100.0
Id = Annotated[int, Field(ge=0, le=MAX_ID)]


# -- errors: one small tree, mapped to HTTP status codes by one handler in the broker ---------


class ProtocolError(ValueError):
    """A message is well-formed but not acceptable now: a state conflict (409). The broker
    answers every error of this tree with its `status` and its message as the reason."""

    status = 409


class BadRequest(ProtocolError):
    """A request the route cannot make sense of, e.g. an upload whose bytes do not hash to its
    X-Sha256 (400)."""

    status = 400


class NotFound(ProtocolError):
    """An unknown sampler, job or weight version (404)."""

    status = 404


class Unprocessable(ProtocolError):
    """Content no state makes valid, e.g. a token id outside the vocabulary (422)."""

    status = 422


class TooLarge(ProtocolError):
    """A body or upload over the configured limit (413)."""

    status = 413


class Unauthorized(ProtocolError):
    """A missing or unknown bearer token (401)."""

    status = 401


class Forbidden(ProtocolError):
    """A known token whose role may not call the route, or a sampler acting as another (403)."""

    status = 403


class TooMany(ProtocolError):
    """A limit on how many of something may exist at once, e.g. registered samplers, or how
    often it may happen, e.g. registrations (429; `retry_after` seconds, when known)."""

    status = 429

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def printable(text: str, limit: int = 200) -> str:
    """`text` safe for a log line or a terminal: control characters (escape sequences,
    newlines) become '?', and it is at most `limit` characters."""
    return "".join(ch if ch.isprintable() else "?" for ch in text[:limit])


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplerInfo(_Wire):
    """sampler -> broker (register): who is joining the swarm."""

    name: str = Field(pattern=NAME_PATTERN, description="human-readable, unique per host")
    hardware: str = Field(
        "",
        max_length=200,
        description="free text, e.g. 'cpu x2' or 'H200' (control characters become '?')",
    )
    backend: Literal["hf", "vllm", "openai"] = "hf"
    max_batch: int = Field(64, ge=1, le=65536, description="most prompts it generates at once")
    tokenizer: str = Field(
        pattern=SHA256_PATTERN,
        description="fingerprint of the sampler's tokenizer (RunTokenizer.fingerprint); the "
        "broker refuses one that is not the run's",
    )
    task: str = Field(min_length=1, max_length=MAX_TASK_NAME, description="the task it runs")
    cost_per_hour: float | None = Field(
        None,
        ge=0.0,
        le=1e6,
        description="what running this sampler costs an hour (any currency, the same for "
        "all): `echorl status` names the cheapest samplers that keep the trainer busy",
    )
    peer_url: str | None = Field(
        None,
        pattern=PEER_URL_PATTERN,
        description="where it serves the weights it holds to peers the broker sends there "
        "(http://host:port); None: it fetches, never serves",
    )

    @field_validator("hardware")
    @classmethod
    def _printable(cls, text: str) -> str:
        return printable(text)


class TrainerHello(_Wire):
    """trainer -> broker (at start): the trainer's tokenizer and task, refused unless the run's."""

    tokenizer: str = Field(pattern=SHA256_PATTERN)
    task: str = Field(min_length=1, max_length=MAX_TASK_NAME)
    batch_prompts: int = Field(ge=1, le=65536)
    group_size: int = Field(ge=1, le=MAX_GROUP_SIZE)


class RunInfo(_Wire):
    """broker -> anyone: what the run is, as the broker was started with it."""

    task: str
    tokenizer: str
    mode: Literal["sync", "async"]
    max_staleness: int
    batch_prompts: int
    group_size: int
    latest_version: int


class Job(_Wire):
    """broker -> sampler (lease): one prompt to be answered `group_size` times."""

    job_id: int = Field(ge=0, le=MAX_ID)
    task: str = Field(min_length=1, max_length=MAX_TASK_NAME)
    seed: int = Field(
        ge=0, le=2**63 - 1, description="the task's problem seed; the prompt follows from it"
    )
    prompt: str = Field(max_length=1_000_000, description="the task's text, for people")
    prompt_ids: list[Id] = Field(
        min_length=1,
        max_length=MAX_PROMPT_TOKENS,
        description="the prompt as the run's tokenizer encodes it in the run's prompt format: "
        "what the sampler generates from and the trainer trains on (nobody re-encodes)",
    )
    group_size: int = Field(ge=1, le=MAX_GROUP_SIZE)
    required_version: int | None = Field(
        None, ge=0, description="sync mode: generate with exactly this version"
    )
    lease_deadline: float = Field(
        description="unix time after which the job is leased to someone else"
    )


class Turn(_Wire):
    """One model turn of a multi-turn episode: completion tokens [start, end)."""

    start: int = Field(ge=0, le=MAX_COMPLETION_TOKENS)
    end: int = Field(ge=1, le=MAX_COMPLETION_TOKENS)
    version: int = Field(ge=0, le=MAX_ID, description="policy version that generated the turn")


def turn_mask(length: int, spans: list[tuple[int, int]]) -> list[int]:
    """1 on tokens inside the model's [start, end) spans, 0 on the environment's."""
    mask = [0] * length
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
    return mask


class Completion(_Wire):
    """One of a group's completions, as a sampler reports it. A multi-turn episode lists its
    model `turns`; every token outside them is the environment's (log-prob 0, no loss)."""

    token_ids: list[Id] = Field(min_length=1, max_length=MAX_COMPLETION_TOKENS)
    logprobs: list[float] = Field(
        min_length=1,
        max_length=MAX_COMPLETION_TOKENS,
        description="behaviour log-prob of each token",
    )
    finished: bool = Field(description="stopped at eos (False: cut at max_new_tokens)")
    turns: list[Turn] | None = Field(
        None, min_length=1, max_length=1024, description="multi-turn only: the model's spans"
    )

    @field_validator("logprobs")
    @classmethod
    def _logprobs_are_logprobs(cls, lps: list[float]) -> list[float]:
        if min(lps) >= MIN_LOGPROB and max(lps) <= 0.0 and not math.isnan(sum(lps)):
            return lps  # the common case, checked in C
        for i, lp in enumerate(lps):
            if not (MIN_LOGPROB <= lp <= 0.0):  # also false for NaN
                raise ValueError(
                    f"logprobs[{i}] = {lp}: log-probs must be finite, >= {MIN_LOGPROB:g} and <= 0 "
                    "(a sampled token's)"
                )
        return lps

    @model_validator(mode="after")
    def _lengths_agree(self) -> Completion:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.logprobs)} log-probs")
        if self.turns is not None:
            if self.turns[0].start != 0:
                raise ValueError("an episode starts with a model turn at token 0")
            at = 0
            for k, t in enumerate(self.turns):
                if t.start < at or t.end <= t.start or t.end > len(self.token_ids):
                    raise ValueError(
                        f"turns[{k}] = [{t.start}, {t.end}) is out of order or out of the "
                        f"{len(self.token_ids)} tokens"
                    )
                at = t.end
        return self

    @property
    def spans(self) -> list[tuple[int, int]]:
        """The model's [start, end) spans (all of a single-turn completion; each turn of an
        episode): the one definition of what the loss trains on and the audit checks (`mask`),
        what the verifier reads (each span decoded) and where a stop token may only end."""
        if self.turns is None:
            return [(0, len(self.token_ids))]
        return [(t.start, t.end) for t in self.turns]

    @property
    def mask(self) -> list[int]:
        """1 on the model's tokens, 0 on the environment's."""
        return turn_mask(len(self.token_ids), self.spans)


class ScoredGroup(_Wire):
    """The one shape of a rollout: a GRPO group for one prompt, from the sampler's push to the
    trainer's batch (and the co-located loop's, which makes it in process).

    sampler -> broker (push): `rewards` are the sampler's own scores, kept only to compare;
    broker -> trainer (pull): `rewards` are the broker's, recomputed where trust lives."""

    job_id: int = Field(ge=0, le=MAX_ID)
    version: int = Field(
        ge=0,
        le=MAX_ID,
        description="policy version that produced every token (the oldest, if several)",
    )
    prompt_ids: list[Id] = Field(min_length=1, max_length=MAX_PROMPT_TOKENS)
    completions: list[Completion] = Field(min_length=1, max_length=MAX_GROUP_SIZE)
    rewards: list[float] = Field(min_length=1, max_length=MAX_GROUP_SIZE)
    gen_seconds: float = Field(0.0, ge=0.0, le=86400.0)
    sampler: str | None = Field(
        None, max_length=64, description="who generated it: filled in by the broker on a pull"
    )
    reward_parts: dict[str, tuple[float, int]] | None = Field(
        None,
        max_length=32,
        description="a dataset task's reward functions: name -> (sum, count) over the group, "
        "filled in by the broker with its rewards (a sampler's are not read)",
    )

    @model_validator(mode="after")
    def _oldest_version(self) -> ScoredGroup:
        versions = [t.version for c in self.completions for t in c.turns or []]
        if versions and min(versions) != self.version:
            raise ValueError(
                f"version {self.version}, but the oldest turn was generated by {min(versions)}: "
                "a group is as stale as its oldest token"
            )
        return self

    @model_validator(mode="after")
    def _one_reward_each(self) -> ScoredGroup:
        if len(self.rewards) != len(self.completions):
            raise ValueError(f"{len(self.rewards)} rewards for {len(self.completions)} completions")
        if not all(math.isfinite(r) for r in self.rewards):
            raise ValueError("rewards must be finite")
        return self

    def check_against(self, job: JobState, vocab_size: int, latest_version: int) -> None:
        """The rules that need broker state (`Arrival.check_against`)."""
        Arrival.of(self).check_against(job, vocab_size, latest_version)

    @property
    def tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)


@dataclass(frozen=True)
class Arrival:
    """A pushed group as the broker keeps it: what the store checks against the job, and the
    group's JSON, stored as it is (the verifier parses its completions in its own process).
    Made where the push is parsed, off the server's process (`broker/intake.py`), so the
    server never builds a big group's token lists."""

    job_id: int
    version: int
    versions: frozenset[int]  # of every token: the group's and its turns'
    prompt_ids: tuple[int, ...]
    group_size: int
    max_token: tuple[int, int]  # the largest token id, and the completion that holds it
    tokens: int  # completion tokens, all completions (the broker's measure of a sampler's speed)
    body: str  # the group's JSON without the rewards (see broker.store.WIRE)
    claimed: str  # the sampler's rewards, as JSON

    @classmethod
    def of(cls, group: ScoredGroup) -> Arrival:
        return cls(
            job_id=group.job_id,
            version=group.version,
            versions=frozenset(
                [group.version, *(t.version for c in group.completions for t in c.turns or [])]
            ),
            prompt_ids=tuple(group.prompt_ids),
            group_size=len(group.completions),
            max_token=max((max(c.token_ids), k) for k, c in enumerate(group.completions)),
            tokens=group.tokens,
            body=group.model_dump_json(exclude={"rewards", "sampler", "reward_parts"}),
            claimed=json.dumps(group.rewards),
        )

    def check_against(self, job: JobState, vocab_size: int, latest_version: int) -> None:
        """The rules that need broker state (the job as leased, the vocabulary, the latest
        version); raises the error of the tree that says what is wrong."""
        if self.group_size != job.group_size:
            raise ProtocolError(
                f"job {self.job_id} was leased with G = {job.group_size}, "
                f"got {self.group_size} completions"
            )
        if list(self.prompt_ids) != job.prompt_ids:
            raise ProtocolError(
                f"job {self.job_id}: prompt_ids are not the job's prompt (generate from the "
                "ids the lease carried; never re-encode the text)"
            )
        if (newest := max(self.versions)) > latest_version:
            raise ProtocolError(
                f"version {newest} is newer than the latest published ({latest_version})"
            )
        if (bad := self.max_token[0]) >= vocab_size:
            raise Unprocessable(
                f"completions[{self.max_token[1]}]: token id {bad} is outside the vocabulary "
                f"(size {vocab_size})"
            )


class JobState(_Wire):
    """What the broker checks a pushed group against: the job as it was leased."""

    group_size: int
    prompt_ids: list[int]


class LoraSpec(_Wire):
    """The shape of an adapter-only version: what a sampler needs to apply it."""

    rank: int = Field(ge=1, le=512)
    alpha: float = Field(gt=0.0, le=1e4)
    targets: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.]{1,100}$")]] = Field(
        min_length=1, max_length=64
    )


class WeightVersion(_Wire):
    """broker -> sampler (latest version): what a sampler needs to decide whether to pull.
    A `lora` version holds an adapter alone, applied on full version `base`."""

    version: int = Field(ge=0, le=MAX_ID)
    sha256: str = Field(pattern=SHA256_PATTERN)
    size_bytes: int = Field(ge=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    kind: Literal["full", "lora"] = "full"
    base: int | None = Field(None, ge=0, le=MAX_ID)
    lora: LoraSpec | None = None
    # A delta against version `delta_base` (the 16-bit words that changed), for a sampler
    # holding that one: `GET /v1/weights/{version}/delta`, checked by `sha256` once applied.
    delta_base: int | None = Field(None, ge=0, le=MAX_ID)
    delta_bytes: int | None = Field(None, ge=0)


# -- request and reply bodies of the broker's routes (client <-> broker/routes.py) --------------


class RegisterReply(_Wire):
    """broker -> a new sampler: its id, and the credential (a bearer token) every later call
    of this sampler carries instead of the shared enrolment token. Shown once, stored hashed."""

    sampler_id: str
    credential: str
    heartbeat_s: float = Field(
        20.0,
        gt=0,
        description="beat at least this often while generating (a third of the "
        "broker's sampler_timeout), or be marked lost and lose the lease",
    )
    max_body_bytes: int = Field(
        16 << 20, ge=1024, description="the largest push the broker reads (413 beyond)"
    )
    peer_secret: str | None = Field(
        None,
        description="a sampler that serves peers: the secret under which the broker's tickets "
        "for its weights are made (echorl/rollout/peers.py)",
    )


class OperatorRequest(_Wire):
    """The admin enrols an operator: one enrolment token for all of its samplers."""

    name: str = Field(pattern=NAME_PATTERN, description="who runs the samplers, e.g. alice")


class OperatorReply(_Wire):
    name: str
    token: str = Field(description="the operator's enrolment token: shown once, kept as sha256")


class LostRequest(_Wire):
    """A supervisor's word that its sampler process `name` died."""

    name: str = Field(pattern=NAME_PATTERN)


class RevokeReply(_Wire):
    returned: int  # leased jobs handed back to the queue


class HeartbeatReply(_Wire):
    latest_version: int


class LeaveReply(_Wire):
    returned: int  # leased jobs handed back to the queue


class AckReply(_Wire):
    consumed: int  # groups newly consumed (re-acking is a no-op)


class SamplerStatus(_Wire):
    id: str
    name: str
    hardware: str
    backend: str
    max_batch: int
    last_seen: float
    version_held: int | None
    tokens_per_s: float | None  # measured by the broker: its delivered groups' tokens over time
    state: Literal["alive", "lost", "left", "revoked", "quarantined"]
    reason: str | None = None  # why it was quarantined
    # The trainer's audit of its consumed tokens (decayed sums, recent reports weigh most):
    audited_tokens: int = 0
    logprob_mean_abs: float = 0.0  # mean |trainer - sampler| log-prob per token
    logprob_kl: float = 0.0  # mean (sampler - trainer): an estimate of KL(sampler || trainer)
    logprob_beyond: float = 0.0  # fraction of tokens beyond the audit tolerance
    cost_per_hour: float | None = None  # as it told at registration
    # What the broker trusts it with (broker/standing.py), and why: "proven", or "newcomer:
    # 40 of 128 tokens audited" (its jobs beyond the budget, its groups scored after proven ones).
    standing: str = ""
    # Its account (broker/swarm.py ACCOUNT): groups pushed and their completion tokens; of
    # them consumed (and tokens), dropped stale, refused, set aside flat; jobs taken back from
    # it (sync's cancelled work), leases it let lapse; jobs it holds now.
    pushed: int = 0
    pushed_tokens: int = 0
    consumed: int = 0
    consumed_tokens: int = 0
    stale: int = 0
    refused: int = 0
    flat: int = 0
    cancelled: int = 0
    lapsed: int = 0
    leased: int = 0
    fetch_s: float | None = None  # a version's download and load, the median of its last ones
    spent: float | None = None  # cost_per_hour x the time it has been registered
    cost_per_mtoken: float | None = None  # spent per million tokens the trainer consumed
    parked: bool = False  # broker.activation = cheapest: not handed jobs while others cover


class Capacity(_Wire):
    """How well the swarm is provisioned (broker/capacity.py): the trainer's pace, the
    tokens/s it needs and the swarm makes, how long a version takes to reach every sampler,
    the staleness at which all of that overlaps with training, and the cheapest samplers
    that cover the need (of those that told their cost)."""

    train_s: float  # the trainer's compute per step (recent average)
    step_s: float | None  # wall time per step
    trainer_busy: float | None  # train_s / step_s
    step_tokens: float  # completion tokens per step
    needed_tokens_per_s: float  # step_tokens / train_s: the trainer never waits
    swarm_tokens_per_s: float  # the alive samplers' measured speeds, summed
    dissemination_s: float | None  # a version's fetch and load, the median sampler's
    staleness_to_overlap: int | None  # the smallest max_staleness that hides both
    max_staleness: int  # the run's (0 in sync)
    keep: list[str] = []  # the cheapest samplers (names) whose speed covers the need
    keep_cost_per_hour: float | None = None
    keep_tokens_per_s: float | None = None


class StatusReply(_Wire):
    mode: Literal["sync", "async"]
    latest_version: int
    samplers: list[SamplerStatus]  # the most relevant (alive, then quarantined...): `limit`
    sampler_counts: dict[str, int] = {}  # every sampler the broker knows, by state
    jobs: dict[str, int]  # by state
    rollouts: dict[str, int]  # by state
    ready_by_version: dict[int, int]
    verifier: dict[
        str, int
    ] = {}  # completions scored 0 by kind (timeout, crash, memory, error); refused groups
    verifier_busy: float = 0.0  # fraction of the verifier workers' time spent scoring
    verifier_error: str | None = None  # the first exception a verifier raised, its last line
    audits: dict[str, int] = {}  # consumed groups' audits by state (open, leased, done, missed)
    auditors: int = 0  # auditors alive
    wasted: dict[str, int] = {}  # sync's cancelled work: cancelled_jobs, wasted_groups, _tokens
    # Versions fetched, by where the broker sent the sampler: "broker" or "peer" (fan-out)
    weight_sources: dict[str, int] = {}
    capacity: Capacity | None = None  # None until the trainer has reported a step


class HeartbeatRequest(_Wire):
    version_held: int | None = Field(None, ge=0, le=MAX_ID)
    sha256_held: str | None = Field(
        None,
        pattern=SHA256_PATTERN,
        description="the sha256 of `version_held`'s weights: a resumed trainer re-publishes "
        "numbers with other weights, and the broker counts a sampler as holding only the "
        "weights it publishes now",
    )
    fetch_s: float | None = Field(
        None,
        ge=0.0,
        le=1e6,
        description="seconds `version_held` took to fetch and load, told once it is loaded "
        "(the broker's capacity figures)",
    )


# A long poll is held at most this long: under any client's read timeout, and short enough
# that a process asked to stop is not kept waiting.
MAX_WAIT_S = 10.0


class Took(_Wire):
    """How long a version took to arrive whole from the source the broker named for it."""

    version: int = Field(ge=0)
    seconds: float = Field(gt=0, le=86_400)
    served: float | None = Field(
        None,
        ge=0,
        le=1e12,
        description="bytes/s this sampler passed that version on to its peers at, all of "
        "them together (None: it served nobody)",
    )


class SourceRequest(_Wire):
    """sampler -> broker: where do I fetch this version?"""

    failed: str | None = Field(
        None,
        pattern=PEER_URL_PATTERN,
        description="the peer named last time, which did not deliver (no answer, a cut, "
        "wrong bytes): it is not named again for this version",
    )
    took: Took | None = Field(
        None,
        description="the last version fetched whole from a named source, and its seconds: "
        "how the broker finds peers too slow to pass versions on (a slow uplink)",
    )


class WeightSource(_Wire):
    """broker -> sampler: fetch the version from this peer, showing it the ticket; or, with
    url None, from the broker (`GET /v1/weights/{version}`)."""

    url: str | None = Field(None, pattern=PEER_URL_PATTERN)
    ticket: str | None = Field(None, pattern=TICKET_PATTERN)
    min_rate: float | None = Field(
        None,
        ge=0,
        le=1e12,
        description="bytes/s: a peer slower than this once the sampler has read from it "
        "for a few seconds is left for the broker, unreported (it may be passing on a slow "
        "arrival); a quarter of the median rate samplers got versions from the broker at",
    )


class LeaseRequest(HeartbeatRequest):
    """sampler -> broker: jobs, please. Also a heartbeat, with the version held."""

    sampler_id: str = Field(max_length=64)
    n: int = Field(1, ge=1, le=1024)
    wait_s: float = Field(
        0.0,
        ge=0.0,
        le=MAX_WAIT_S,
        description="long poll: when no job is admitted, wait up to this long for one "
        "(a new version or a returned lease) before answering with none",
    )


class LeaseReply(_Wire):
    jobs: list[Job]
    latest_version: int
    # The weights of `latest_version` (sha256 and size), so that a sampler already holding
    # them need not ask; None before the first publish.
    latest: WeightVersion | None = None
    # broker.activation = cheapest: cheaper samplers cover the trainer's need, so this one is
    # handed no jobs until woken (it fetches no version meanwhile).
    parked: bool = False


class PushRequest(_Wire):
    sampler_id: str = Field(max_length=64)
    group: ScoredGroup


class PushReply(_Wire):
    """The group is stored (durably) and will be scored by the broker's verifiers; it reaches
    the trainer once scored."""

    stored: bool  # False: this job's group was already stored (idempotent retry)


class PushManyRequest(_Wire):
    """sampler -> broker: several groups in one request, stored in one transaction."""

    sampler_id: str = Field(max_length=64)
    groups: list[ScoredGroup] = Field(min_length=1, max_length=1024)


class PushResult(_Wire):
    job_id: int
    stored: bool  # False: already stored, or refused
    refused: str | None = None  # why this group was refused; it changed nothing


class PushManyReply(_Wire):
    results: list[PushResult]


class PullRequest(_Wire):
    n: int = Field(ge=1, le=65536)
    step: int = Field(ge=0, le=MAX_ID, description="the trainer's step; sync pulls version == step")
    request_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="a retry with the same id gets the same groups (its first answer was lost)",
    )
    wait_s: float = Field(
        0.0,
        ge=0.0,
        le=MAX_WAIT_S,
        description="long poll: when no group is ready, wait up to this long for a push",
    )


class PullReply(_Wire):
    groups: list[ScoredGroup]  # with the broker's rewards, the only ones to train on
    dropped_stale: int
    auditors: int = 0  # auditors alive: the trainer leaves the audits it would pay for to them
    wasted_tokens: int = 0  # completion tokens generated for cancelled work so far (sync)
    flat_refilled: int = 0  # flat groups set aside so far, their place given to fresh prompts
    verifier_failures: int = 0  # completions scored 0 because the task's verifier failed
    verifier_error: str | None = None  # the first exception it raised, its last line


class AckRequest(_Wire):
    job_ids: list[Id] = Field(max_length=65536)
    step: int = Field(ge=0, le=MAX_ID)
    train_s: float | None = Field(
        None, ge=0.0, le=1e6, description="the step's compute seconds (for capacity figures)"
    )
    tokens: int | None = Field(
        None, ge=0, le=1 << 40, description="completion tokens the step trained on"
    )
    idle_s: float | None = Field(
        None, ge=0.0, le=1e6, description="seconds the step waited for its groups (blocked)"
    )


class GroupAudit(_Wire):
    """trainer -> broker: its log-probs of a consumed group's model tokens against the
    sampler's behaviour log-probs (sums over the group's tokens)."""

    job_id: Id
    tokens: int = Field(ge=0, le=MAX_GROUP_SIZE * MAX_COMPLETION_TOKENS)
    abs_delta: float = Field(ge=0.0, le=1e12)  # sum of |trainer - sampler|
    kl: float = Field(ge=-1e12, le=1e12)  # sum of (sampler - trainer)
    beyond: int = Field(ge=0, le=MAX_GROUP_SIZE * MAX_COMPLETION_TOKENS)  # |delta| > tolerance
    # Scored under the very weights of the group's version (the trainer's current ones, or
    # those it kept for that version): judged against 0, never against other samplers' groups.
    exact: bool = False
    # The trainer's log-prob of each completion token (0 at the environment's), for one group
    # a step: the dashboard's drill-down draws them beside the sampler's.
    logprobs: list[Annotated[list[float], Field(max_length=MAX_COMPLETION_TOKENS)]] | None = Field(
        None, max_length=MAX_GROUP_SIZE
    )

    @field_validator("logprobs")
    @classmethod
    def _token_logprobs(cls, rows: list[list[float]] | None) -> list[list[float]] | None:
        for i, row in enumerate(rows or []):
            if row and not (min(row) >= MIN_LOGPROB and max(row) <= 0.0):  # NaN fails too
                raise ValueError(f"logprobs[{i}]: log-probs must be >= {MIN_LOGPROB:g} and <= 0")
        return rows


class AuditReport(_Wire):
    step: Id
    groups: list[GroupAudit] = Field(max_length=65536)


class AuditLeaseRequest(_Wire):
    """auditor -> broker: consumed groups to audit, please (the trainer's token)."""

    auditor: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    n: int = Field(ge=1, le=4096)
    wait_s: float = Field(
        0.0, ge=0.0, le=MAX_WAIT_S, description="long poll: wait this long for audits to open"
    )


class AuditLease(_Wire):
    """Consumed groups of one version nobody has audited, leased to the auditor that asked."""

    version: int | None  # the weights to audit them under (None: nothing to audit now)
    groups: list[ScoredGroup]
    latest_version: int


class AuditReply(_Wire):
    quarantined: dict[str, str]  # sampler id -> why, for samplers quarantined by this report


MetricName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_./-]{1,64}$")]


class TrainerMetrics(_Wire):
    """trainer -> broker: a step's numbers as the trainer logged them (reward, held-out eval,
    its busy and idle seconds, ...), for the dashboard's training view."""

    step: int = Field(ge=0, le=MAX_ID)
    metrics: dict[MetricName, float] = Field(max_length=256)

    @field_validator("metrics")
    @classmethod
    def _finite(cls, metrics: dict[str, float]) -> dict[str, float]:
        for name, value in metrics.items():
            if not math.isfinite(value):
                raise ValueError(f"metrics[{name!r}] = {value}: not finite")
        return metrics


class TrainerMetricsReply(_Wire):
    step: int


class RewindRequest(_Wire):
    """trainer -> broker (resume): where the trainer's checkpoint left off."""

    step: int = Field(ge=0, le=MAX_ID, description="steps the checkpoint completed")
    consumed: list[Id] = Field(
        max_length=1 << 24, description="job ids of every group the checkpoint trained on"
    )


class RewindReply(_Wire):
    returned: int  # groups consumed or pulled after the checkpoint, ready again
    regenerated: int  # groups of forgotten versions, deleted; their jobs are queued again
    leases_returned: int
    latest_version: int  # the trainer publishes latest_version + 1 next (its own v_step if -1)
