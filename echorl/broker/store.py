"""The broker's durable state in one SQLite file (WAL): samplers, jobs, rollouts, versions
(the samplers' and operators' part is `swarm.SwarmBook`, this class's base).

Every method is one transaction, so a crash at any point leaves either the
state before it or the state after it, and a method that returns has made its
change durable (WAL commit; `synchronous="FULL"` also survives power loss).
The store knows nothing of HTTP, auth or weights' bytes: the app maps its
`ProtocolError`s to 4xx answers.

Job lifecycle:   queued --lease--> leased --push--> done
                   ^                  | deadline passed / sampler lost
                   +------------------+  (attempts + 1; parked after max_attempts)
Rollout lifecycle: scoring --verdict--> ready --pull--> pulled --ack(step)--> consumed
                                          ^                |  trainer lease passed, or the
                                          +----------------+  trainer resumed (`rewind`)
                   ready --too stale at pull--> stale (dropped, counted)
                   scoring --refused by the verifier--> deleted, its job queued again
Audit lifecycle (a consumed group's log-prob check):
                   (trainer's report) --> done;   ack --> open --lease--> leased --report--> done
                   open/leased, its version's weights gone before an auditor came --> missed

A pushed group is stored as the sampler sent it, in state `scoring`: `body` is its JSON
without rewards (so that a pull serves it as stored, never re-encoded), `claimed` the
sampler's rewards; the broker's verifier pool fills in `rewards`.

Admission: at most `(latest + max_staleness + 1) * B` groups are ever out
(leased, ready, pulled or consumed), so no job is handed out that the trainer
could not consume within the staleness bound. Sync mode is the case
`max_staleness = 0` with every job pinned to the latest version, which is why
async with `max_staleness = 0` reproduces it exactly.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from echorl.broker.standing import is_proven, proven_sql
from echorl.broker.swarm import ACCOUNT, RETRY, SwarmBook, quarantined, tally
from echorl.protocol import (
    MAX_PROMPT_TOKENS,
    Arrival,
    Job,
    JobState,
    NotFound,
    ProtocolError,
    ScoredGroup,
)
from echorl.seeding import derive_seed
from echorl.tasks import Problem, is_heldout

log = logging.getLogger("echorl.broker")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS run (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS samplers (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, hardware TEXT NOT NULL, backend TEXT NOT NULL,
    max_batch INTEGER NOT NULL, registered_at REAL NOT NULL, last_seen REAL NOT NULL,
    version_held INTEGER, tokens_per_s REAL, secret TEXT NOT NULL, barred_until REAL NOT NULL,
    audit_total INTEGER NOT NULL DEFAULT 0, audit_tokens REAL NOT NULL DEFAULT 0,
    audit_abs REAL NOT NULL DEFAULT 0,
    audit_kl REAL NOT NULL DEFAULT 0, audit_beyond REAL NOT NULL DEFAULT 0, reason TEXT,
    state TEXT NOT NULL
        CHECK (state IN ('alive', 'lost', 'left', 'revoked', 'quarantined')),
    operator TEXT NOT NULL DEFAULT '', address TEXT NOT NULL DEFAULT '',
    delivered INTEGER NOT NULL DEFAULT 0, cost_per_hour REAL);
-- An operator enrols samplers with a token of its own (the admin issues it): what the audit
-- finds and what a hoarding lease costs stay with the operator whatever identities it makes.
CREATE TABLE IF NOT EXISTS operators (
    name TEXT PRIMARY KEY, secret TEXT NOT NULL UNIQUE, created_at REAL NOT NULL,
    barred_until REAL NOT NULL DEFAULT 0, audit_total INTEGER NOT NULL DEFAULT 0,
    audit_tokens REAL NOT NULL DEFAULT 0, audit_abs REAL NOT NULL DEFAULT 0,
    audit_kl REAL NOT NULL DEFAULT 0, audit_beyond REAL NOT NULL DEFAULT 0, reason TEXT,
    state TEXT NOT NULL CHECK (state IN ('active', 'quarantined', 'revoked')));
CREATE TABLE IF NOT EXISTS jobs (
    job_id INTEGER PRIMARY KEY, task TEXT NOT NULL, seed INTEGER NOT NULL, prompt TEXT NOT NULL,
    prompt_ids TEXT NOT NULL, group_size INTEGER NOT NULL, required_version INTEGER,
    state TEXT NOT NULL CHECK (state IN ('queued', 'leased', 'done', 'parked')),
    lease_owner TEXT, lease_deadline REAL, attempts INTEGER NOT NULL DEFAULT 0,
    extra INTEGER NOT NULL DEFAULT 0,  -- leased to a newcomer, beyond the budget
    leased_at REAL, lease_held INTEGER);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state, job_id);
CREATE TABLE IF NOT EXISTS rollouts (
    job_id INTEGER PRIMARY KEY REFERENCES jobs (job_id), version INTEGER NOT NULL,
    sampler_id TEXT NOT NULL, body TEXT NOT NULL, claimed TEXT NOT NULL, rewards TEXT,
    created_at REAL NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('scoring', 'ready', 'pulled', 'consumed', 'stale')),
    pull_deadline REAL, pull_request TEXT, consumed_step INTEGER,
    tokens INTEGER NOT NULL DEFAULT 0);  -- completion tokens (a sampler's measured speed)
CREATE INDEX IF NOT EXISTS rollouts_by_state ON rollouts (state, version);
CREATE INDEX IF NOT EXISTS rollouts_by_sampler ON rollouts (sampler_id, created_at);
CREATE TABLE IF NOT EXISTS audits (
    job_id INTEGER PRIMARY KEY REFERENCES jobs (job_id), lease_deadline REAL,
    state TEXT NOT NULL CHECK (state IN ('open', 'leased', 'done', 'missed')));
CREATE INDEX IF NOT EXISTS audits_by_state ON audits (state, job_id);
-- The trainer's log-prob of each token of a few groups (one a step, the last TOKENS_KEPT):
-- the dashboard's drill-down draws them beside the sampler's.
CREATE TABLE IF NOT EXISTS trainer_logprobs (
    job_id INTEGER PRIMARY KEY REFERENCES jobs (job_id), logprobs TEXT NOT NULL);
-- The trainer's logged numbers of its last METRICS_KEPT steps: the dashboard's training view.
CREATE TABLE IF NOT EXISTS trainer_metrics (step INTEGER PRIMARY KEY, metrics TEXT NOT NULL);
"""

METRICS_KEPT = 2000

# Columns added since a data dir could first have been made: (table, column, definition).
MIGRATIONS = (
    ("samplers", "operator", "TEXT NOT NULL DEFAULT ''"),
    ("samplers", "address", "TEXT NOT NULL DEFAULT ''"),
    ("samplers", "delivered", "INTEGER NOT NULL DEFAULT 0"),
    ("jobs", "extra", "INTEGER NOT NULL DEFAULT 0"),
    ("samplers", "cost_per_hour", "REAL"),
    ("jobs", "leased_at", "REAL"),
    ("jobs", "lease_held", "INTEGER"),  # its sampler's last delivered group's version then
    ("rollouts", "tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("rollouts", "parts", "TEXT"),  # a dataset task's rewards, one by one (sums, counts)
    ("rollouts", "flat", "INTEGER NOT NULL DEFAULT 0"),  # set aside by dynamic sampling
    # Each sampler's account (`SwarmBook.account`): what it pushed and what became of it.
    *(("samplers", column, "INTEGER NOT NULL DEFAULT 0") for column in ACCOUNT),
)

WIRE = {"rewards", "sampler", "reward_parts"}  # what a stored body leaves out: added when served


def served(body: str, rewards: str, sampler_id: str, parts: str | None = None) -> str:
    """A stored group's JSON as the trainer gets it: the body with the broker's rewards (and
    a dataset task's rewards one by one) and the id of the sampler that pushed it (a JSON
    object, so the keys go before its '}')."""
    tail = f',"reward_parts":{parts}' if parts else ""
    return f'{body[:-1]},"rewards":{rewards},"sampler":{json.dumps(sampler_id)}{tail}}}'


def _with_rewards(
    body: str, rewards: str, sampler_id: str, parts: str | None = None
) -> ScoredGroup:
    return ScoredGroup.model_validate_json(served(body, rewards, sampler_id, parts))


@dataclass(frozen=True)
class Admission:
    """How many jobs may be out at once, and whether they are pinned to a version."""

    batch: int  # B: groups the trainer consumes per step
    max_staleness: int  # 0 in sync mode
    pin_version: bool  # sync: every job carries required_version = the latest version
    spare: int = 0  # sync: jobs leased beyond B per version (broker.overprovision)


@dataclass(frozen=True)
class Probation:
    """What a sampler may lease by what it has proven. Unproven, it is a newcomer: its jobs
    are extra, beyond the admission budget, and all newcomers together hold at most
    `newcomers` of them, so no identity the trainer has not checked ever holds a job the
    trainer waits for (fresh identities that never push, or push one junk group and then
    hoard, cannot stall it). Proven: the trainer audited `proven_tokens` of its tokens
    without quarantining it (the audit recomputes their log-probs: real compute, which an
    identity cannot fake); with the audit off (`proven_tokens` 0), a group of it was
    scored. Either way it holds at most `first` jobs, one more per group it delivered; a
    lease of it that runs out halves that count (a lapse costs some standing, not all)."""

    first: int = 1
    newcomers: int = 1
    proven_tokens: int = 0

    def proven(self, delivered: int, audited_tokens: float) -> bool:
        return is_proven(self.proven_tokens, delivered, audited_tokens)


SPEED_GROUPS = 64  # a sampler's speed is measured over its last this many groups (a few leases)
STEADY_GROUPS = 8  # ... of them generated on a version held at lease time, if this many


def delivered_speed(spans: list[tuple[float, float, int]]) -> float | None:
    """Tokens per second of busy time, from (leased at, pushed at, tokens) of a sampler's
    groups: their tokens over the union of their lease-to-push spans, so the jobs of one lease
    generated together, or leases that overlap, count their time once. What the broker saw,
    which no claim moves: a sampler can look slower than it is (it waited), never faster
    than the groups it delivered. None while the spans are too short to time."""
    busy, end = 0.0, float("-inf")
    for start, stop, _ in sorted(spans):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    if busy < 1e-3:
        return None
    return sum(tokens for _, _, tokens in spans) / busy


def fair_share(n: int, speed: float | None, fastest: float | None) -> int:
    """Jobs for a sampler that asked for `n`, by its measured speed (tokens/s) against the
    fastest alive sampler's: below half of it, the same fraction of `n` (at least 1), so a
    lease takes a slow sampler about as long as a fast one's; otherwise `n` (speeds within 2x
    are measurement noise and machine load as much as hardware). Unmeasured: `n`."""
    if not speed or not fastest or speed >= fastest / 2:
        return n
    return max(1, round(n * speed / fastest))


ProblemFn = Callable[[int], Problem]  # job seed -> problem (the task's own `problem`)
EncodeFn = Callable[[str], list[int]]  # prompt text -> ids in the run's tokenizer and format


class BrokerStore(SwarmBook):
    def __init__(
        self,
        path: str | Path,
        task: str,
        problem: ProblemFn,
        encode: EncodeFn,
        run_seed: int = 0,
        vocab_size: int = 1 << 20,
        synchronous: str = "NORMAL",
        max_attempts: int = 5,
        refill_flat: int = 0,
        read_only: bool = False,
    ):
        """`refill_flat`: dynamic sampling (DAPO): up to that many flat groups (every reward
        equal: no advantage) of one version are set aside as scored, never served, and their
        jobs' place in the budget goes to fresh prompts; 0 = off. `read_only`: a finished
        run's store, shown (`echorl dashboard`): opened so that nothing can write it."""
        assert synchronous in ("NORMAL", "FULL"), (
            f"synchronous must be NORMAL or FULL, not {synchronous}"
        )
        self.task, self.problem, self.encode, self.run_seed = task, problem, encode, run_seed
        self.vocab_size, self.max_attempts, self.refill_flat = vocab_size, max_attempts, refill_flat
        # One connection shared by the server's threads; the lock serialises its transactions.
        self.lock = threading.RLock()
        self._batching = False  # a `batch` transaction is open (read by the lock's holder)
        self.path, self.read_only = Path(path), read_only
        # The dashboard's reads: a read-only connection per thread (WAL: they see what is
        # committed and never wait for the writers' lock).
        self._readers = threading.local()
        if read_only:
            self.db = self._connect_read_only()
        else:
            self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute(f"PRAGMA synchronous={synchronous}")
            self.db.execute("PRAGMA foreign_keys=ON")
            self.db.executescript(SCHEMA)
            for table, column, definition in MIGRATIONS:
                if column not in {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
            self._tx(
                lambda c: c.execute(
                    "INSERT OR IGNORE INTO meta VALUES ('cursor', 0), ('latest_version', -1), "
                    "('cancelled_jobs', 0), ('wasted_groups', 0), ('wasted_tokens', 0), "
                    "('flat_refilled', 0)"
                )
            )
            # Consumed groups are most of the table and only ever grow: counted, not scanned.
            self._tx(
                lambda c: c.execute(
                    "INSERT OR IGNORE INTO meta SELECT 'consumed', COUNT(*) FROM rollouts "
                    "WHERE state = 'consumed'"
                )
            )
        self._latest: int = self.db.execute(
            "SELECT value FROM meta WHERE key = 'latest_version'"
        ).fetchone()[0]
        # Completion tokens generated for nothing (sync's cancelled groups): every pull says it.
        self.wasted_tokens: int = self.wasted()["wasted_tokens"]
        self.flat_refilled: int = self.db.execute(
            "SELECT value FROM meta WHERE key = 'flat_refilled'"
        ).fetchone()[0]

    def _tx(self, fn):
        """Run `fn(cursor)` in one IMMEDIATE transaction (writers serialise, readers never
        block); inside `batch` on this thread, on a savepoint of the batch's transaction."""
        with self.lock:
            cur = self.db.cursor()
            begin, commit, undo = (
                ("SAVEPOINT call", "RELEASE call", "ROLLBACK TO call; RELEASE call")
                if self._batching
                else ("BEGIN" if self.read_only else "BEGIN IMMEDIATE", "COMMIT", "ROLLBACK")
            )
            cur.execute(begin)
            try:
                out = fn(cur)
            except BaseException:
                for statement in undo.split("; "):
                    cur.execute(statement)
                raise
            cur.execute(commit)
            return out

    @contextmanager
    def batch(self):
        """Every method called in the block (on this thread) in one transaction, committed at
        its end: group commit. Each is still all or nothing (its own savepoint); a failure
        of the commit itself undoes them all."""
        with self.lock:
            cur = self.db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            self._batching = True
            try:
                yield
                cur.execute("COMMIT")
            except BaseException:
                if self.db.in_transaction:
                    cur.execute("ROLLBACK")
                raise
            finally:
                self._batching = False

    def _connect_read_only(self) -> sqlite3.Connection:
        uri = f"{self.path.resolve().as_uri()}?mode=ro"
        return sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)

    def _read(self, fn):
        """`fn(cursor)` on this thread's read-only connection, in one snapshot: for what
        only looks (the dashboard), off the writers' lock."""
        db = getattr(self._readers, "db", None)
        if db is None:
            db = self._readers.db = self._connect_read_only()
        cur = db.cursor()
        cur.execute("BEGIN")
        try:
            return fn(cur)
        finally:
            cur.execute("COMMIT")

    def close(self) -> None:
        self.db.close()

    # -- versions -----------------------------------------------------------------------------

    def latest_version(self) -> int:
        """The newest published version; -1 before the trainer publishes v0. (Kept in memory:
        every lease reads it, never waiting for the store's lock.)"""
        return self._latest

    def set_latest_version(self, version: int, cancel_older: bool = False) -> tuple[int, int]:
        """Publish `version`. `cancel_older` (sync, where a group of an older version can
        never be consumed): jobs still leased for an older version go back to the queue
        (no attempt counted, no penalty: the sampler did nothing wrong) and groups of older
        versions not yet pulled are dropped, their tokens counted as wasted. Returns
        (jobs cancelled, groups dropped)."""

        def fn(c):
            latest = c.execute("SELECT value FROM meta WHERE key = 'latest_version'").fetchone()[0]
            if version != latest + 1:
                raise ProtocolError(f"version {version} is not the next one (latest is {latest})")
            c.execute("UPDATE meta SET value = ? WHERE key = 'latest_version'", (version,))
            if not cancel_older:
                return 0, 0, 0
            taken_back = "t.state = 'leased' AND t.required_version < ?"
            tally(c, "cancelled", "jobs", "lease_owner", taken_back, (version,))
            cancelled = c.execute(
                "UPDATE jobs SET state = 'queued', lease_owner = NULL, lease_deadline = NULL, "
                "required_version = NULL, extra = 0 "
                "WHERE state = 'leased' AND required_version < ?",
                (version,),
            ).rowcount
            older = "FROM rollouts WHERE state IN ('scoring', 'ready') AND version < ?"
            late = "t.state IN ('scoring', 'ready') AND t.version < ?"
            tally(c, "stale", "rollouts", "sampler_id", late, (version,))
            (tokens,) = c.execute(
                "SELECT COALESCE(SUM(json_array_length(c.value, '$.token_ids')), 0) "
                f"FROM (SELECT body {older}) r, json_each(r.body, '$.completions') c",
                (version,),
            ).fetchone()
            dropped = c.execute(
                f"UPDATE rollouts SET state = 'stale' WHERE job_id IN (SELECT job_id {older})",
                (version,),
            ).rowcount
            c.executemany(
                "UPDATE meta SET value = value + ? WHERE key = ?",
                [
                    (cancelled, "cancelled_jobs"),
                    (dropped, "wasted_groups"),
                    (tokens, "wasted_tokens"),
                ],
            )
            return cancelled, dropped, tokens

        cancelled, dropped, tokens = self._tx(fn)
        self._latest = version
        self.wasted_tokens += tokens
        return cancelled, dropped

    def wasted(self) -> dict[str, int]:
        """Sync's cancelled work so far (`set_latest_version`)."""
        return self._tx(lambda c: self._wasted(c.execute))

    @staticmethod
    def _wasted(q) -> dict[str, int]:
        """Jobs taken back from samplers, and the groups (and their completion tokens) that
        arrived for a version no step could consume any more."""
        keys = ("cancelled_jobs", "wasted_groups", "wasted_tokens")
        marks = ", ".join("?" * len(keys))
        return dict(q(f"SELECT key, value FROM meta WHERE key IN ({marks})", keys).fetchall())

    # -- jobs ---------------------------------------------------------------------------------

    def check_run(self, identity: dict[str, str]) -> None:
        """The run this data dir serves (task, tokenizer, prompt format): recorded on first
        start, compared on every later one. ValueError names what differs, so a broker is
        never restarted on jobs whose prompt ids another tokenizer or format made."""
        columns = {r[1] for r in self.db.execute("PRAGMA table_info(jobs)")}
        columns |= {r[1] for r in self.db.execute("PRAGMA table_info(rollouts)")}
        columns |= {r[1] for r in self.db.execute("PRAGMA table_info(samplers)")}
        if not {"claimed", "rewards", "secret", "barred_until", "audit_total"} <= columns:
            raise ValueError(
                "this data dir was written by an older echorl (no prompt ids, or no scoring): "
                "start the broker on a fresh data dir"
            )

        def fn(c):
            if not self.read_only:
                c.executemany("INSERT OR IGNORE INTO run VALUES (?, ?)", identity.items())
            return dict(c.execute("SELECT key, value FROM run").fetchall())

        recorded = self._tx(fn)
        for key, value in identity.items():
            if recorded[key] != value:
                raise ValueError(
                    f"this data dir belongs to a run with {key} {recorded[key][:64]!r}, not "
                    f"{value[:64]!r}: start the broker on a fresh data dir (or with that run's "
                    "config)"
                )

    def first_job(self) -> tuple[Problem, list[int]]:
        """Job 0's problem and prompt ids, made as a lease would make them (nothing stored):
        the check, at start, that the task and the tokenizer can serve the run."""
        _, problem = self._problem_for(0)
        ids = self.encode(problem.query)
        if not ids:
            raise ValueError(f"the prompt {problem.prompt[:80]!r} encodes to no tokens")
        if max(ids) >= self.vocab_size:
            raise ValueError(f"its prompt encodes to id {max(ids)} >= vocab size {self.vocab_size}")
        return problem, ids

    def _problem_for(self, job_id: int) -> tuple[int, Problem]:
        """The job's problem: a deterministic function of (run seed, job id), never held out."""
        for attempt in range(1000):
            seed = derive_seed(self.run_seed, "job", job_id, attempt)
            problem = self.problem(seed)
            if not is_heldout(problem):
                return seed, problem
        raise AssertionError(f"job {job_id}: 1000 draws were all held-out problems")

    def lease(
        self,
        sampler_id: str,
        n: int,
        group_size: int,
        now: float,
        lease_seconds: float,
        required_version: int | None = None,
        admit: Admission | None = None,
        max_held: int | None = None,
        probation: Probation | None = None,
        by_speed: bool = False,
        fastest: float | None = None,
    ) -> list[Job]:
        """Up to `n` jobs for `sampler_id`: queued ones first, then new ones from the cursor.
        With `admit`, no more than the admission budget, read in the same transaction; with
        `max_held`, no more than that many leased to this sampler at once (one that hoards
        leases and never pushes cannot take every admitted job); with `probation`, fewer
        while it has delivered little (`Probation`); with `by_speed`, fewer the slower it is
        than the fastest alive sampler (`fair_share`), or than `fastest` tokens/s if given
        (cost-aware activation's fastest working sampler: a parked one is no yardstick)."""

        def fn(c):
            nonlocal n, required_version
            row = c.execute(
                "SELECT s.state, MAX(s.barred_until, COALESCE(o.barred_until, 0)), s.delivered, "
                "s.audit_total FROM samplers s LEFT JOIN operators o ON o.name = s.operator "
                "WHERE s.id = ?",
                (sampler_id,),
            ).fetchone()
            if row is not None and row[0] == "quarantined":
                raise quarantined(c, sampler_id)
            if row is None or row[0] != "alive":
                raise ProtocolError(f"sampler {sampler_id!r} is not registered and alive")
            if row[1] > now:  # a lease of it (or its operator's) ran out unpushed: it waits
                return []
            held = c.execute(
                "SELECT COUNT(*) FROM jobs WHERE state = 'leased' AND lease_owner = ?",
                (sampler_id,),
            ).fetchone()[0]
            if by_speed:
                # The fastest among proven samplers: a fresh identity's claim of 1e9 tokens/s
                # shrank every honest sampler's lease to one job.
                # Without probation every identity is trusted: all alive samplers count.
                proven = "" if probation is None else f"AND {proven_sql(probation.proven_tokens)}"
                mine, top = c.execute(
                    "SELECT tokens_per_s, (SELECT MAX(tokens_per_s) FROM samplers "
                    f"WHERE state = 'alive' {proven}) FROM samplers WHERE id = ?",
                    (sampler_id,),
                ).fetchone()
                n = fair_share(n, mine, top if fastest is None else fastest)
            newcomer = probation is not None and not probation.proven(row[2], row[3])
            if max_held is not None:
                n = min(n, max_held - held)
            if probation is not None:
                n = min(n, probation.first + row[2] - held)  # grows with what it delivered
            if admit is not None:
                latest = c.execute(
                    "SELECT value FROM meta WHERE key = 'latest_version'"
                ).fetchone()[0]
                # A newcomer's jobs are extra: all of them together are few, and the budget
                # stays the trainer's whatever fresh identities do with them.
                if newcomer and latest >= 0:
                    n = min(n, probation.newcomers - self._newcomers_held(c))
                else:
                    n = min(n, self._budget(c, latest, admit))
                if admit.pin_version:
                    required_version = latest
            elif newcomer:
                n = min(n, probation.newcomers - self._newcomers_held(c))
            if n <= 0:
                return []
            # A job returned to the queue that the trainer waits for (a lapsed or lost
            # sampler's) is never a newcomer's: fresh identities took each such job and held
            # it a lease period, step after step (a proven sampler's one lapse: 46% of its
            # rate). A newcomer takes only queued jobs that were extra, or fresh ones.
            only_extra = "AND extra = 1" if newcomer else ""
            queued = [
                r[0]
                for r in c.execute(
                    f"SELECT job_id FROM jobs WHERE state = 'queued' {only_extra} "
                    "ORDER BY job_id LIMIT ?",
                    (n,),
                )
            ]
            fresh = self._create_jobs(c, n - len(queued), group_size)
            deadline = now + lease_seconds
            return [
                self._lease_one(c, job_id, sampler_id, now, deadline, required_version, newcomer)
                for job_id in queued + fresh
            ]

        return self._tx(fn)

    def _create_jobs(self, c, count: int, group_size: int) -> list[int]:
        """`count` new queued jobs from the cursor, each with its problem's prompt encoded
        once (the ids every sampler generates from); their ids."""
        cursor = c.execute("SELECT value FROM meta WHERE key = 'cursor'").fetchone()[0]
        fresh = range(cursor, cursor + count)
        made = []
        for job_id in fresh:
            try:  # the task's and the template's own code: a failure parks this job alone
                seed, problem = self._problem_for(job_id)
                prompt, ids = problem.prompt, self.encode(problem.query)
                if not ids or len(ids) > MAX_PROMPT_TOKENS:
                    raise ValueError(
                        f"its prompt encodes to {len(ids)} ids (1 to {MAX_PROMPT_TOKENS} allowed)"
                    )
                if max(ids) >= self.vocab_size:
                    raise ValueError(f"its prompt encodes to ids beyond the vocab ({max(ids)})")
                state = "queued"
                made.append(job_id)
            except Exception as e:
                log.error("job %d cannot be made, parked: %s: %s", job_id, type(e).__name__, e)
                seed, prompt, ids, state = 0, f"(cannot be made: {e})"[:1000], [], "parked"
            c.execute(
                "INSERT INTO jobs (job_id, task, seed, prompt, prompt_ids, group_size, state) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (job_id, self.task, seed, prompt, json.dumps(ids), group_size, state),
            )
        c.execute("UPDATE meta SET value = ? WHERE key = 'cursor'", (fresh.stop,))
        return made

    @staticmethod
    def _lease_one(
        c,
        job_id: int,
        sampler_id: str,
        now: float,
        deadline: float,
        required_version: int | None,
        extra: bool = False,
    ) -> Job:
        c.execute(
            "UPDATE jobs SET state = 'leased', lease_owner = ?, leased_at = ?, lease_deadline = ?, "
            "required_version = ?, extra = ?, "
            "lease_held = (SELECT version FROM rollouts WHERE sampler_id = ? "
            "ORDER BY created_at DESC LIMIT 1) WHERE job_id = ?",
            (sampler_id, now, deadline, required_version, int(extra), sampler_id, job_id),
        )
        task, seed, prompt, prompt_ids, g = c.execute(
            "SELECT task, seed, prompt, prompt_ids, group_size FROM jobs WHERE job_id = ?",
            (job_id,),
        ).fetchone()
        return Job(
            job_id=job_id,
            task=task,
            seed=seed,
            prompt=prompt,
            prompt_ids=json.loads(prompt_ids),
            group_size=g,
            required_version=required_version,
            lease_deadline=deadline,
        )

    @staticmethod
    def _newcomers_held(c) -> int:
        """Jobs leased to samplers that had delivered nothing yet (beyond the budget)."""
        return c.execute(
            "SELECT COUNT(*) FROM jobs WHERE state = 'leased' AND extra = 1"
        ).fetchone()[0]

    @staticmethod
    def _budget(c, latest: int, admit: Admission) -> int:
        """Jobs that may still be leased: what steps up to `latest + max_staleness` can consume,
        less what is already out (leased, but for newcomers' extra jobs, or a group ready,
        pulled or consumed)."""
        if latest < 0:
            return 0
        out = c.execute(
            "SELECT (SELECT COUNT(*) FROM jobs WHERE state = 'leased' AND extra = 0) + "
            "(SELECT COUNT(*) FROM rollouts WHERE state IN ('scoring', 'ready', 'pulled')) + "
            "(SELECT value FROM meta WHERE key = 'consumed')"
        ).fetchone()[0]
        return (latest + admit.max_staleness + 1) * admit.batch + admit.spare - out

    # -- rollouts (the replay buffer) ----------------------------------------------------------

    def push(self, sampler_id: str, group: Arrival | ScoredGroup, now: float) -> int | None:
        """Store `group` for a job the caller holds, durably, to be scored. Returns the job's
        problem seed (what the verifier needs), or None (and stores nothing) when the job's
        group was already stored: pushing twice is harmless."""

        def fn(c):
            seed = self._push_one(c, sampler_id, group, now)
            self._measure(c, sampler_id)
            return seed

        return self._tx(fn)

    def refused_push(self, sampler_id: str, n: int = 1) -> None:
        """`n` groups of this sampler's refused before the store (parsing, or a single push's
        refusal, which left no write)."""
        self._tx(lambda c: self._refused(c, sampler_id, n))

    @staticmethod
    def _refused(c, sampler_id: str, n: int) -> None:
        c.execute("UPDATE samplers SET refused = refused + ? WHERE id = ?", (n, sampler_id))

    def push_many(
        self, sampler_id: str, groups: list[Arrival | ScoredGroup], now: float
    ) -> list[int | None | str]:
        """Store many groups in one transaction (one commit). Each result is what `push` would
        say (the seed, or None) or the refusal's reason, in which case that group changed
        nothing."""

        def fn(c):
            results: list[int | None | str] = []
            for group in groups:
                try:
                    results.append(self._push_one(c, sampler_id, group, now))
                except ProtocolError as e:
                    results.append(str(e))
            if refused := sum(isinstance(r, str) for r in results):
                self._refused(c, sampler_id, refused)
            self._measure(c, sampler_id)
            return results

        return self._tx(fn)

    def _push_one(self, c, sampler_id: str, group: Arrival | ScoredGroup, now: float) -> int | None:
        """Store `group` (its rewards are the sampler's claims) in state `scoring`."""
        group = group if isinstance(group, Arrival) else Arrival.of(group)
        # Every check comes before the first write, so a refused group leaves no trace.
        row = c.execute(
            "SELECT state, lease_owner, group_size, required_version, prompt_ids, seed FROM jobs "
            "WHERE job_id = ?",
            (group.job_id,),
        ).fetchone()
        if row is None:
            raise NotFound(f"unknown job {group.job_id}")
        state, owner, group_size, required, prompt_ids, seed = row
        who = c.execute("SELECT state FROM samplers WHERE id = ?", (sampler_id,)).fetchone()
        if who is not None and who[0] == "quarantined":
            raise quarantined(c, sampler_id)
        if c.execute("SELECT 1 FROM rollouts WHERE job_id = ?", (group.job_id,)).fetchone():
            return None
        if state != "leased" or owner != sampler_id:
            raise ProtocolError(f"job {group.job_id} is not leased to sampler {sampler_id!r}")
        latest = c.execute("SELECT value FROM meta WHERE key = 'latest_version'").fetchone()[0]
        job = JobState(group_size=group_size, prompt_ids=json.loads(prompt_ids))
        group.check_against(job, vocab_size=self.vocab_size, latest_version=latest)
        if required is not None and group.versions != {required}:
            raise ProtocolError(
                f"job {group.job_id} requires version {required}, "
                f"the group was generated by {sorted(group.versions)}"
            )
        c.execute(
            "INSERT INTO rollouts (job_id, version, sampler_id, body, claimed, created_at, state, "
            "tokens) VALUES (?, ?, ?, ?, ?, ?, 'scoring', ?)",
            (group.job_id, group.version, sampler_id, group.body, group.claimed, now, group.tokens),
        )
        c.execute(
            "UPDATE samplers SET pushed = pushed + 1, pushed_tokens = pushed_tokens + ? "
            "WHERE id = ?",
            (group.tokens, sampler_id),
        )
        c.execute(
            "UPDATE jobs SET state = 'done', lease_deadline = NULL WHERE job_id = ?",
            (group.job_id,),
        )
        return seed

    @staticmethod
    def _measure(c, sampler_id: str) -> None:
        """The sampler's speed as the broker saw it (`delivered_speed`), never as it claims:
        over its groups generated on the version of the group it had delivered last when it
        leased them (it needed no download), when it has STEADY_GROUPS of those (a lease
        that began with a version's download timed the link too: a sampler that fetched
        each version for a few jobs looked slow by the fetch); else over all its groups.
        What it delivered, not the version it tells it holds: told, a sampler could pick
        which of its leases time it (a group's version is checked by the audit)."""
        spans = c.execute(
            "SELECT j.leased_at, r.created_at, r.tokens, r.version = j.lease_held "
            "FROM rollouts r JOIN jobs j ON j.job_id = r.job_id "
            "WHERE r.sampler_id = ? AND j.leased_at IS NOT NULL "
            f"ORDER BY r.created_at DESC LIMIT {SPEED_GROUPS}",
            (sampler_id,),
        ).fetchall()
        steady = [span[:3] for span in spans if span[3]]
        spans = steady if len(steady) >= STEADY_GROUPS else [span[:3] for span in spans]
        if (speed := delivered_speed(spans)) is not None:
            c.execute("UPDATE samplers SET tokens_per_s = ? WHERE id = ?", (speed, sampler_id))

    def scored(
        self, verdicts: list[tuple[int, float, list[float] | None, dict | None]]
    ) -> tuple[int, int, int]:
        """The verifier's verdicts, in one transaction: (job id, the group's created_at, the
        broker's rewards, or None when it refused the group; a dataset task's rewards one by
        one, or None). A scored group becomes ready (a flat one, under dynamic sampling, is
        set aside while its version has had fewer than `refill_flat`: its place is taken by
        a fresh prompt's job); a
        refused one is deleted and its job queued again (an attempt counted). A verdict for a
        group no longer scoring (a resumed trainer deleted it) changes nothing. Returns
        (ready, refused, samplers whose first delivered group this was)."""

        def fn(c):
            ready = refused = promoted = flat = 0
            for job_id, created, rewards, parts in verdicts:
                if rewards is None:
                    tally(
                        c,
                        "refused",
                        "rollouts",
                        "sampler_id",
                        "t.job_id = ? AND t.state = 'scoring' AND t.created_at = ?",
                        (job_id, created),
                    )
                    gone = c.execute(
                        "DELETE FROM rollouts WHERE job_id = ? AND state = 'scoring' "
                        "AND created_at = ?",
                        (job_id, created),
                    ).rowcount
                    if gone:
                        c.execute(
                            f"UPDATE jobs SET {RETRY} WHERE job_id = ?", (self.max_attempts, job_id)
                        )
                    refused += gone
                    continue
                state = "ready"
                if self.refill_flat and len(set(rewards)) == 1:
                    (set_aside,) = c.execute(
                        "SELECT COUNT(*) FROM rollouts WHERE state = 'stale' AND flat = 1 "
                        "AND version = (SELECT version FROM rollouts WHERE job_id = ?)",
                        (job_id,),
                    ).fetchone()
                    state = "stale" if set_aside < self.refill_flat else "ready"
                if c.execute(
                    f"UPDATE rollouts SET state = '{state}', flat = {int(state == 'stale')}, "
                    "rewards = ?, parts = ? WHERE job_id = ? AND state = 'scoring' "
                    "AND created_at = ?",
                    (json.dumps(rewards), parts and json.dumps(parts), job_id, created),
                ).rowcount:
                    ready += state == "ready"
                    flat += state == "stale"
                    if state == "stale":
                        c.execute(
                            "UPDATE samplers SET flat = flat + 1 WHERE id = "
                            "(SELECT sampler_id FROM rollouts WHERE job_id = ?)",
                            (job_id,),
                        )
                    (delivered,) = c.execute(  # a delivered group: its sampler may hold more
                        "UPDATE samplers SET delivered = delivered + 1 WHERE id = "
                        "(SELECT sampler_id FROM rollouts WHERE job_id = ?) RETURNING delivered",
                        (job_id,),
                    ).fetchone() or (0,)
                    promoted += delivered == 1
            if flat:
                c.execute("UPDATE meta SET value = value + ? WHERE key = 'flat_refilled'", (flat,))
            return ready, refused, promoted, flat

        *counts, flat = self._tx(fn)
        self.flat_refilled += flat
        return tuple(counts)

    def scoring(self) -> list[tuple[int, float, int, ScoredGroup]]:
        """Groups stored but not yet scored (a restarted broker scores them again): job id,
        created_at, problem seed and the group."""
        rows = self._tx(
            lambda c: c.execute(
                "SELECT r.job_id, r.created_at, j.seed, r.body, r.claimed, r.sampler_id "
                "FROM rollouts r JOIN jobs j USING (job_id) WHERE r.state = 'scoring' "
                "ORDER BY r.job_id"
            ).fetchall()
        )
        return [(j, t, seed, _with_rewards(b, claims, sid)) for j, t, seed, b, claims, sid in rows]

    def pull(
        self,
        n: int,
        now: float,
        lease_seconds: float,
        version: int | None = None,
        min_version: int = 0,
        request_id: str | None = None,
        raw: bool = False,
    ) -> tuple[list[ScoredGroup] | list[str], int]:
        """Up to `n` ready groups for the trainer, leased until `now + lease_seconds`.

        sync: `version` = v takes exactly the groups of version v (older ones can never be
        consumed and are dropped as stale). async: groups older than `min_version`
        (= step - max_staleness) are dropped; of the rest, those of `min_version` come first
        (the last step they may be used at: taking them wastes no generation), then the
        freshest. A repeated `request_id` (a retry whose answer was
        lost) gets the same groups again. Every pull renews the lease of the groups pulled
        before it: the one trainer still holds them while it pulls the rest of a batch (a
        partial batch's groups whose lease ran out meanwhile were offered again, and trained
        twice). Returns the groups (`raw`: their JSON, as served) and how many this call
        dropped."""
        make = served if raw else _with_rewards

        def fn(c):
            c.execute(
                "UPDATE rollouts SET pull_deadline = ? WHERE state = 'pulled'",
                (now + lease_seconds,),
            )
            select = "SELECT job_id, body, rewards, sampler_id, parts FROM rollouts r "
            if request_id is not None:
                rows = c.execute(
                    select + "WHERE state = 'pulled' AND pull_request = ? ORDER BY job_id",
                    (request_id,),
                ).fetchall()
                if rows:
                    return [make(*r[1:]) for r in rows], 0
            floor = min_version if version is None else version
            tally(
                c,
                "stale",
                "rollouts",
                "sampler_id",
                "t.state = 'ready' AND t.version < ?",
                (floor,),
            )
            dropped = c.execute(
                "UPDATE rollouts SET state = 'stale' WHERE state = 'ready' AND version < ?",
                (floor,),
            ).rowcount
            if version is None:
                # Groups at the bound first (next step they would be dropped: generated for
                # nothing), then the freshest.
                rows = c.execute(
                    select + "WHERE state = 'ready' "
                    "ORDER BY version = ? DESC, version DESC, job_id LIMIT ?",
                    (min_version, n),
                )
            else:
                rows = c.execute(
                    select + "WHERE state = 'ready' AND version = ? ORDER BY job_id LIMIT ?",
                    (version, n),
                )
            rows = rows.fetchall()
            c.executemany(
                "UPDATE rollouts SET state = 'pulled', pull_deadline = ?, pull_request = ? "
                "WHERE job_id = ?",
                [(now + lease_seconds, request_id, r[0]) for r in rows],
            )
            return [make(*r[1:]) for r in rows], dropped

        return self._tx(fn)

    def origins(self, job_ids: list[int]) -> list[tuple[int, str, str]]:
        """Each group's version, its sampler's operator ('' for the shared token) and the
        broker's rewards (JSON)."""
        marks = ", ".join("?" * len(job_ids))
        return self._tx(
            lambda c: c.execute(
                "SELECT r.version, COALESCE(s.operator, ''), r.rewards FROM rollouts r "
                "LEFT JOIN samplers s "
                f"ON s.id = r.sampler_id WHERE r.job_id IN ({marks})",
                job_ids,
            ).fetchall()
        )

    def consumed_tail(self, steps: int) -> list[tuple[int, int, str]]:
        """(step, version, rewards JSON) of the groups consumed in the last `steps` steps."""
        return self._read(
            lambda c: c.execute(
                "SELECT consumed_step, version, rewards FROM rollouts WHERE state = 'consumed' "
                "AND consumed_step > (SELECT COALESCE(MAX(consumed_step), 0) FROM rollouts "
                "WHERE state = 'consumed') - ? ORDER BY consumed_step",
                (steps,),
            ).fetchall()
        )

    def trainer_logged(self, step: int, metrics: dict[str, float]) -> None:
        """The trainer's numbers of `step` (a resumed run's again: the last word stands);
        only the last METRICS_KEPT steps are kept."""

        def fn(c):
            c.execute(
                "INSERT OR REPLACE INTO trainer_metrics VALUES (?, ?)", (step, json.dumps(metrics))
            )
            c.execute("DELETE FROM trainer_metrics WHERE step <= ?", (step - METRICS_KEPT,))

        self._tx(fn)

    def trainer_metrics(self, n: int) -> list[dict]:
        """The trainer's numbers of its last `n` steps, oldest first (each with its step)."""
        rows = self._read(
            lambda c: c.execute(
                "SELECT step, metrics FROM trainer_metrics ORDER BY step DESC LIMIT ?", (n,)
            ).fetchall()
        )
        return [{"step": step} | json.loads(m) for step, m in reversed(rows)]

    def recent_groups(self, sampler_id: str, n: int) -> list[dict]:
        """A sampler's `n` most recent groups: job, version, state, rewards, when, and
        whether the trainer sent its log-probs of the group's tokens."""
        rows = self._read(
            lambda c: c.execute(
                "SELECT job_id, version, state, rewards, created_at, consumed_step, flat, "
                "t.job_id IS NOT NULL FROM rollouts LEFT JOIN trainer_logprobs t USING (job_id) "
                "WHERE sampler_id = ? ORDER BY created_at DESC LIMIT ?",
                (sampler_id, n),
            ).fetchall()
        )
        keys = ("job_id", "version", "state", "rewards", "created_at", "consumed_step", "flat")
        keys += ("trainer_logprobs",)
        return [dict(zip(keys, r)) | {"rewards": json.loads(r[3] or "null")} for r in rows]

    def group_detail(self, job_id: int) -> dict | None:
        """One stored group with its job's prompt text and, where the trainer sent them, its
        log-probs of the group's tokens: the dashboard's drill-down."""
        row = self._read(
            lambda c: c.execute(
                "SELECT r.body, r.rewards, r.claimed, r.sampler_id, r.state, r.consumed_step, "
                "j.prompt, t.logprobs FROM rollouts r JOIN jobs j USING (job_id) "
                "LEFT JOIN trainer_logprobs t USING (job_id) WHERE r.job_id = ?",
                (job_id,),
            ).fetchone()
        )
        keys = ("body", "rewards", "claimed", "sampler_id", "state", "consumed_step", "prompt")
        return None if row is None else dict(zip((*keys, "trainer_logprobs"), row))

    def ack(self, job_ids: list[int], step: int) -> int:
        """Mark pulled groups consumed at trainer `step`; a group is consumed at most once.
        Returns how many were newly consumed (re-acking is a no-op)."""

        def fn(c):
            done = 0
            for job_id in job_ids:
                state = c.execute(
                    "SELECT state FROM rollouts WHERE job_id = ?", (job_id,)
                ).fetchone()
                if state is None:
                    raise NotFound(f"job {job_id} has no stored group")
                if state[0] == "consumed":
                    continue
                if state[0] != "pulled":
                    raise ProtocolError(
                        f"job {job_id}'s group is {state[0]}, not pulled; pull it first"
                    )
                c.execute(
                    "UPDATE rollouts SET state = 'consumed', consumed_step = ? WHERE job_id = ?",
                    (step, job_id),
                )
                c.execute(
                    "UPDATE samplers SET consumed = consumed + 1, consumed_tokens = "
                    "consumed_tokens + r.tokens FROM (SELECT sampler_id, tokens FROM rollouts "
                    "WHERE job_id = ?) r WHERE samplers.id = r.sampler_id",
                    (job_id,),
                )
                # Open for an auditor, unless the trainer's report (sent before the ack)
                # already audited it.
                c.execute("INSERT OR IGNORE INTO audits VALUES (?, NULL, 'open')", (job_id,))
                done += 1
            c.execute("UPDATE meta SET value = value + ? WHERE key = 'consumed'", (done,))
            return done

        return self._tx(fn)

    def counts(self) -> dict[str, dict]:
        """Jobs by state, rollouts by state, and ready groups by version (for status and metrics)."""
        return self._tx(lambda c: self._counts(c.execute))

    @staticmethod
    def _counts(q) -> dict[str, dict]:
        return {
            "jobs": dict(q("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()),
            "rollouts": dict(
                q(
                    "SELECT CASE WHEN flat THEN 'flat' ELSE state END, COUNT(*) FROM rollouts "
                    "GROUP BY 1"
                ).fetchall()
            ),
            "ready_by_version": dict(
                q(
                    "SELECT version, COUNT(*) FROM rollouts WHERE state = 'ready' GROUP BY version"
                ).fetchall()
            ),
            "audits": dict(q("SELECT state, COUNT(*) FROM audits GROUP BY state").fetchall()),
            "wasted": BrokerStore._wasted(q),
        }

    def rewind(self, step: int, consumed: set[int], keep_version: int) -> dict[str, int]:
        """The trainer resumed from its checkpoint after `step` steps, having consumed exactly
        `consumed`; whatever it trained on since died with it.

        Groups consumed (or pulled) since become ready again. Versions after `step` are
        forgotten: groups they generated are deleted and their jobs queued again, since a new
        lineage of weights will reuse those numbers. v_step itself is the checkpoint's own
        weights, so its groups stay; the latest version becomes `keep_version` (`step`, or
        `step - 1` when v_step's file is gone and the trainer re-publishes the same weights). Every lease is returned, as its
        sampler may hold forgotten weights. Returns the counts and the new latest version."""

        def fn(c):
            latest = c.execute("SELECT value FROM meta WHERE key = 'latest_version'").fetchone()[0]
            if latest < step - 1:
                raise ProtocolError(
                    f"the broker's latest version is {latest}, behind the checkpoint's step "
                    f"{step}: is this the broker (and data dir) the run used?"
                )
            here = {r[0] for r in c.execute("SELECT job_id FROM rollouts WHERE state = 'consumed'")}
            if missing := consumed - here:
                raise ProtocolError(
                    f"{len(missing)} groups the checkpoint consumed (e.g. job {min(missing)}) "
                    "are not consumed at this broker"
                )
            returned = [(job_id,) for job_id in sorted(here - consumed)]
            # Their samplers' accounts forget the consumption too (it is counted again when
            # the resumed trainer consumes them).
            c.executemany(
                "UPDATE samplers SET consumed = consumed - 1, consumed_tokens = consumed_tokens "
                "- (SELECT tokens FROM rollouts WHERE job_id = ?1) "
                "WHERE id = (SELECT sampler_id FROM rollouts WHERE job_id = ?1)",
                returned,
            )
            c.executemany(
                "UPDATE rollouts SET state = 'ready', consumed_step = NULL WHERE job_id = ?",
                returned,
            )
            pulled = c.execute(
                "UPDATE rollouts SET state = 'ready', pull_deadline = NULL, pull_request = NULL "
                "WHERE state = 'pulled'"
            ).rowcount
            orphans = [
                (r[0],) for r in c.execute("SELECT job_id FROM rollouts WHERE version > ?", (step,))
            ]
            c.executemany("DELETE FROM rollouts WHERE job_id = ?", orphans)
            c.executemany("DELETE FROM audits WHERE job_id = ?", orphans)
            c.executemany("DELETE FROM trainer_logprobs WHERE job_id = ?", orphans)
            c.execute("DELETE FROM trainer_metrics WHERE step > ?", (step,))
            c.executemany("UPDATE jobs SET state = 'queued' WHERE job_id = ?", orphans)
            leases = c.execute(
                "UPDATE jobs SET state = 'queued', lease_owner = NULL, lease_deadline = NULL, "
                "required_version = NULL WHERE state = 'leased'"
            ).rowcount
            c.execute("UPDATE meta SET value = ? WHERE key = 'latest_version'", (keep_version,))
            # Weights of forgotten versions are nobody's to pass on (peers are named by it).
            c.execute(
                "UPDATE samplers SET version_held = NULL WHERE version_held > ?", (keep_version,)
            )
            c.execute(
                "UPDATE meta SET value = (SELECT COUNT(*) FROM rollouts WHERE state = 'consumed') "
                "WHERE key = 'consumed'"
            )
            return {
                "returned": len(returned) + pulled,
                "regenerated": len(orphans),
                "leases_returned": leases,
                "latest_version": keep_version,
            }

        counts = self._tx(fn)
        self._latest = keep_version
        return counts

    def referenced_versions(self) -> set[int]:
        """Versions that leased sync jobs still require, and the versions of groups leased to
        auditors (their weights must stay downloadable)."""
        return self._tx(
            lambda c: {
                r[0]
                for r in c.execute(
                    "SELECT DISTINCT required_version FROM jobs WHERE state = 'leased' "
                    "AND required_version IS NOT NULL UNION SELECT DISTINCT r.version "
                    "FROM audits a JOIN rollouts r USING (job_id) WHERE a.state = 'leased'"
                )
            }
        )

    # -- auditors -----------------------------------------------------------------------------

    def lease_audits(
        self, n: int, now: float, lease_seconds: float, final_below: int, stored: set[int]
    ) -> tuple[int | None, list[str]]:
        """Up to `n` consumed groups nobody has audited yet, all of one version, leased to an
        auditor until `now + lease_seconds`: the oldest version below `final_below` (versions
        whose groups can no longer be consumed, so an auditor fetches each version's weights
        once) with open audits, or leased ones whose lease ran out. A version whose weights
        are no longer `stored` cannot be audited exactly: its open audits become `missed`.
        Returns the version and the groups' JSON as served (None, [] when there is nothing)."""

        def fn(c):
            due = (
                "FROM audits a JOIN rollouts r USING (job_id) WHERE r.version < ? AND "
                "(a.state = 'open' OR (a.state = 'leased' AND a.lease_deadline < ?))"
            )
            while True:
                row = c.execute(f"SELECT MIN(r.version) {due}", (final_below, now)).fetchone()
                version = row[0]
                if version is None:
                    return None, []
                if version in stored:
                    break
                c.execute(
                    f"UPDATE audits SET state = 'missed', lease_deadline = NULL WHERE job_id IN "
                    f"(SELECT a.job_id {due} AND r.version = ?)",
                    (final_below, now, version),
                )
            rows = c.execute(
                f"SELECT a.job_id, r.body, r.rewards, r.sampler_id, r.parts {due} AND r.version = ? "
                "ORDER BY a.job_id LIMIT ?",
                (final_below, now, version, n),
            ).fetchall()
            c.executemany(
                "UPDATE audits SET state = 'leased', lease_deadline = ? WHERE job_id = ?",
                [(now + lease_seconds, r[0]) for r in rows],
            )
            return version, [served(*r[1:]) for r in rows]

        return self._tx(fn)
