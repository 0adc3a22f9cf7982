"""The broker's book of the swarm: samplers and operators, their leases' fate, the audit's
verdicts. A part of `BrokerStore` (its base class), in the same SQLite file and the same
transactions; here because it is its own subject.

Sampler lifecycle: alive --silent for sampler_timeout--> lost --a call--> alive
                   alive --leave--> left;  --revoke--> revoked;  --audit--> quarantined
                   left and lost rows are forgotten after a retention (`prune`)
Probation: a sampler the trainer has not audited enough holds few jobs, outside the
trainer's budget (`store.Probation`); a lease of it that runs out unpushed bars it a lease
period and halves the count its leases grow by (`expire`).
Operators: samplers registered with an operator's own enrolment token share its audit sums
and its hoarding bar, so a new identity escapes neither (`_judge_operators`).
"""

from __future__ import annotations

import json
import logging
import statistics
import uuid
from dataclasses import dataclass

from echorl.protocol import (
    Forbidden,
    GroupAudit,
    NotFound,
    ProtocolError,
    SamplerInfo,
    TooMany,
    Unprocessable,
)

log = logging.getLogger("echorl.broker")

# A job tried again: an attempt counted, parked after `max_attempts` (the one parameter).
RETRY = (
    "state = CASE WHEN attempts + 1 >= ? THEN 'parked' ELSE 'queued' END, "
    "attempts = attempts + 1, lease_owner = NULL, lease_deadline = NULL"
)


# A sampler's account, counted as things happen (a status call reads, never scans): groups
# pushed and their completion tokens; of those, consumed by the trainer (and their tokens),
# dropped stale, refused (at push or by the verifier), set aside flat (dynamic sampling);
# jobs taken back from it (sync's cancelled work) and leases it let lapse.
ACCOUNT = (
    "pushed",
    "pushed_tokens",
    "consumed",
    "consumed_tokens",
    "stale",
    "refused",
    "flat",
    "cancelled",
    "lapsed",
)


SPENT = "cost_per_hour * (last_seen - registered_at) / 3600.0"  # NULL where it told no price


def tally(c, column: str, table: str, owner: str, where: str, params: tuple) -> None:
    """Add to each sampler's `column` its rows of `table` (whose `owner` column names it)
    that match `where`: before those rows change state."""
    c.execute(
        f"UPDATE samplers SET {column} = {column} + (SELECT COUNT(*) FROM {table} t "
        f"WHERE t.{owner} = samplers.id AND {where}) "
        f"WHERE id IN (SELECT {owner} FROM {table} t WHERE {where})",
        params * 2,
    )


@dataclass(frozen=True)
class Quarantine:
    """When the trainer's log-probs of a sampler's tokens disagree with the sampler's own
    beyond what honest samplers show (docs/concepts/trust.md, for the measurements)."""

    min_tokens: int  # audited tokens (all of them) before any verdict
    max_mean_abs: float  # mean |trainer - sampler| per token
    max_kl: float  # |mean (sampler - trainer)|: an honest sampler's estimate of KL >= 0 is ~0
    max_beyond: float  # fraction of tokens with |trainer - sampler| > the audit tolerance
    decay: float

    def verdict(
        self, total: int, tokens: float, abs_sum: float, kl: float, beyond: float
    ) -> str | None:
        """Why a sampler is quarantined (None: it is not), from its audited token count and
        its decayed sums."""
        if total < self.min_tokens or tokens <= 0:
            return None
        if abs(kl / tokens) > self.max_kl:
            side = "higher" if kl > 0 else "lower"
            return (
                f"its log-probs are {abs(kl / tokens):.3f} per token {side} than the trainer's, "
                f"beyond what honest samplers show (bound {self.max_kl})"
            )
        if abs_sum / tokens > self.max_mean_abs:
            return (
                f"its log-probs differ from the trainer's by {abs_sum / tokens:.3f} per token "
                f"more than honest samplers' on average (bound {self.max_mean_abs})"
            )
        if beyond / tokens > self.max_beyond:
            return (
                f"{beyond / tokens:.1%} more of its tokens' log-probs are far from the "
                f"trainer's than honest samplers' (bound {self.max_beyond:.1%})"
            )
        return None


def quarantined(c, sampler_id: str) -> Forbidden:
    """The refusal of a quarantined sampler's call, with the reason."""
    row = c.execute("SELECT reason FROM samplers WHERE id = ?", (sampler_id,)).fetchone()
    return Forbidden(f"sampler {sampler_id} is quarantined: {row[0] if row else '?'}")


def _accumulate(c, table: str, key: str, who: str, figures, policy: Quarantine):
    """Add one report's (tokens, |excess|, signed excess, far-off excess) to `who`'s decayed
    sums in `table` (samplers or operators); returns its state and the policy's verdict."""
    tokens, abs_, kl, beyond = figures
    d = policy.decay
    c.execute(
        f"UPDATE {table} SET audit_total = audit_total + ?, "
        "audit_tokens = audit_tokens * ? + ?, audit_abs = audit_abs * ? + ?, "
        f"audit_kl = audit_kl * ? + ?, audit_beyond = audit_beyond * ? + ? WHERE {key} = ?",
        (tokens, d, tokens, d, abs_, d, kl, d, beyond, who),
    )
    state, total, *sums = c.execute(
        "SELECT state, audit_total, audit_tokens, audit_abs, audit_kl, audit_beyond "
        f"FROM {table} WHERE {key} = ?",
        (who,),
    ).fetchone()
    return state, policy.verdict(total, *sums)


class SwarmBook:
    """The samplers' and operators' rows (see the module docstring). Needs the store's
    `_tx(fn)` (one transaction) and `max_attempts`."""

    max_attempts: int

    def register(
        self,
        info: SamplerInfo,
        now: float,
        secret: str = "",
        max_alive: int | None = None,
        operator: str = "",
        address: str = "",
    ) -> str:
        """A new sampler's id. `secret`: the sha256 of its credential (what it authenticates
        with from now on); `operator`: whose enrolment token registered it ('' = the shared
        one). Refused (TooMany) when `max_alive` samplers are alive already, and (Forbidden)
        for an operator the audit quarantined or the admin revoked."""
        sampler_id = uuid.uuid4().hex[:16]

        def fn(c):
            if operator:
                state, reason = c.execute(
                    "SELECT state, reason FROM operators WHERE name = ?", (operator,)
                ).fetchone()
                if state != "active":
                    raise Forbidden(f"operator {operator} is {state}: {reason}")
            alive = c.execute("SELECT COUNT(*) FROM samplers WHERE state = 'alive'").fetchone()[0]
            if max_alive is not None and alive >= max_alive:
                raise TooMany(
                    f"{alive} samplers are registered and alive (broker.max_samplers); "
                    "try again later"
                )
            c.execute(
                "INSERT INTO samplers (id, name, hardware, backend, max_batch, registered_at, "
                "last_seen, secret, barred_until, state, operator, address, cost_per_hour) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0, 'alive', ?, ?, ?)",
                (sampler_id, info.name, info.hardware, info.backend, info.max_batch, now, now)
                + (secret, operator, address, info.cost_per_hour),
            )

        self._tx(fn)
        return sampler_id

    def add_operator(self, name: str, secret: str, now: float) -> None:
        """A new operator, enrolling with the token whose sha256 is `secret` (ProtocolError:
        the name is taken)."""

        def fn(c):
            if c.execute("SELECT 1 FROM operators WHERE name = ?", (name,)).fetchone():
                raise ProtocolError(f"operator {name!r} exists already")
            c.execute(
                "INSERT INTO operators (name, secret, created_at, state) "
                "VALUES (?, ?, ?, 'active')",
                (name, secret, now),
            )

        self._tx(fn)

    def operators(self) -> dict[str, str]:
        """Enrolment token hash -> operator name, of every operator."""
        return dict(self._tx(lambda c: c.execute("SELECT secret, name FROM operators").fetchall()))

    def secrets(self) -> dict[str, str]:
        """Credential hash -> sampler id, of every sampler that may still call (not left, not
        revoked)."""
        rows = self._tx(
            lambda c: c.execute(
                "SELECT secret, id FROM samplers WHERE state IN ('alive', 'lost') AND secret != ''"
            ).fetchall()
        )
        return dict(rows)

    def revoked(self) -> set[str]:
        """Credential hashes of revoked samplers (refused with that reason)."""
        rows = self._tx(
            lambda c: c.execute("SELECT secret FROM samplers WHERE state = 'revoked'").fetchall()
        )
        return {r[0] for r in rows}

    def revoke(self, sampler_id: str) -> int:
        """Revoke a sampler: it may never call again; its leased jobs go back to the queue.
        Returns how many were returned."""
        return self._end(sampler_id, "revoked")

    def lost_by_name(self, name: str, now: float) -> int:
        """The alive samplers named `name` are lost (their process died: its supervisor says
        so), their leased jobs back in the queue at once; how many jobs."""

        def fn(c):
            ids = [
                r[0]
                for r in c.execute(
                    "SELECT id FROM samplers WHERE name = ? AND state = 'alive'", (name,)
                )
            ]
            for sampler_id in ids:
                c.execute("UPDATE samplers SET state = 'lost' WHERE id = ?", (sampler_id,))
            return sum(self._return_leases(c, sampler_id) for sampler_id in ids)

        return self._tx(fn)

    def heartbeat(
        self,
        sampler_id: str,
        now: float,
        version_held: int | None = None,
        foreign: bool = False,
    ) -> None:
        """The sampler is alive, holding `version_held` (None: as last told). A version it
        cannot hold (newer than the latest: a resumed trainer forgot it; or `foreign`:
        other weights under that number) counts as none, and the lease or heartbeat reply
        names the latest, which the sampler then fetches: never an error, which would leave
        it nothing to do but ask again."""

        def fn(c):
            row = c.execute("SELECT state FROM samplers WHERE id = ?", (sampler_id,)).fetchone()
            if row is None:
                raise NotFound(f"unknown sampler {sampler_id!r}; register first")
            if row[0] in ("left", "revoked"):
                raise ProtocolError(f"sampler {sampler_id!r} has {row[0]}; register again")
            if row[0] == "quarantined":
                raise quarantined(c, sampler_id)
            latest = c.execute("SELECT value FROM meta WHERE key = 'latest_version'").fetchone()
            gone = version_held is not None and (foreign or version_held > latest[0])
            c.execute(
                "UPDATE samplers SET last_seen = ?, state = 'alive', version_held = CASE WHEN ? "
                "THEN NULL ELSE COALESCE(?, version_held) END WHERE id = ?",
                (now, gone, version_held, sampler_id),
            )

        self._tx(fn)

    def standing_rows(self) -> list[tuple[str, str, int, float]]:
        """(id, operator, groups delivered, audited tokens) of every sampler alive or lost:
        what `standing.Standing` is made of."""
        return self._tx(
            lambda c: c.execute(
                "SELECT id, operator, delivered, audit_total FROM samplers "
                "WHERE state IN ('alive', 'lost')"
            ).fetchall()
        )

    def leave(self, sampler_id: str) -> int:
        """A sampler leaves: its leased jobs go back to the queue at once (no attempt counted).
        Returns how many were returned."""
        return self._end(sampler_id, "left")

    def _end(self, sampler_id: str, state: str) -> int:
        def fn(c):
            row = c.execute("SELECT state FROM samplers WHERE id = ?", (sampler_id,)).fetchone()
            if row is None:
                raise NotFound(f"unknown sampler {sampler_id!r}")
            if row[0] != "revoked":  # revoked stays revoked
                c.execute("UPDATE samplers SET state = ? WHERE id = ?", (state, sampler_id))
            return self._return_leases(c, sampler_id)

        return self._tx(fn)

    def expire(
        self,
        now: float,
        sampler_timeout: float,
        bar_s: float = 0.0,
        lease_silence_s: float | None = None,
    ) -> tuple[int, int]:
        """Mark silent samplers lost and return expired leases to the queue: those past their
        deadline, and those of a sampler silent for `lease_silence_s` (it beats while it
        works one: a killed process, a pulled cable, releases its jobs in seconds, not a lease
        period). A sampler whose lease lapsed so may lease nothing for `bar_s` (one that
        hoards leases and never pushes holds jobs one lease period, then waits one), and the
        count its leases grow by is halved (one lapse of a proven sampler costs some
        standing, not all: before, it started over as a newcomer); all samplers of its
        operator are barred too (a new identity escapes neither). Returns (leases returned,
        samplers lost)."""
        silent = now - (lease_silence_s if lease_silence_s is not None else float("inf"))

        def fn(c):
            lost = c.execute(
                "UPDATE samplers SET state = 'lost' WHERE state = 'alive' AND last_seen < ?",
                (now - sampler_timeout,),
            ).rowcount
            expired = (
                "SELECT lease_owner FROM jobs WHERE state = 'leased' AND (lease_deadline < ? "
                "OR lease_owner IN (SELECT id FROM samplers WHERE last_seen < ?))"
            )
            # A silent sampler holding jobs died or lost its link: lost now (as its leases
            # go back), not a sampler_timeout later; a beat of it makes it alive again.
            lost += c.execute(
                "UPDATE samplers SET state = 'lost' WHERE state = 'alive' AND last_seen < ? "
                "AND id IN (SELECT lease_owner FROM jobs WHERE state = 'leased')",
                (silent,),
            ).rowcount
            lapsed = (
                "t.state = 'leased' AND (t.lease_deadline < ? OR t.lease_owner IN "
                "(SELECT id FROM samplers WHERE last_seen < ?))"
            )
            tally(c, "lapsed", "jobs", "lease_owner", lapsed, (now, silent))
            c.execute(
                f"UPDATE operators SET barred_until = ? WHERE name IN (SELECT operator FROM "
                f"samplers WHERE operator != '' AND id IN ({expired}))",
                (now + bar_s, now, silent),
            )
            c.execute(
                f"UPDATE samplers SET barred_until = ?, delivered = delivered / 2 "
                f"WHERE id IN ({expired})",
                (now + bar_s, now, silent),
            )
            returned = c.execute(
                f"UPDATE jobs SET {RETRY} "
                "WHERE state = 'leased' AND (lease_deadline < ? OR lease_owner IN "
                "(SELECT id FROM samplers WHERE state != 'alive' OR last_seen < ?))",
                (self.max_attempts, now, silent),
            ).rowcount
            c.execute(
                "UPDATE rollouts SET state = 'ready', pull_deadline = NULL "
                "WHERE state = 'pulled' AND pull_deadline < ?",
                (now,),
            )
            return returned, lost

        return self._tx(fn)

    def prune(self, now: float, retention_s: float) -> list[str]:
        """Forget samplers that left or were lost more than `retention_s` ago (their rows
        would only grow: a swarm that comes and goes, or a flood of register-and-leave);
        quarantined and revoked ones stay. Returns the ids forgotten."""

        def fn(c):
            gone = c.execute(
                "DELETE FROM samplers WHERE state IN ('left', 'lost') AND last_seen < ? "
                "RETURNING id",
                (now - retention_s,),
            ).fetchall()
            return [r[0] for r in gone]

        return self._tx(fn)

    def samplers(self, limit: int = 1_000_000) -> list[dict]:
        """The `limit` samplers most worth showing: the alive ones, then the quarantined and
        revoked (with their reasons), then the most recently seen."""
        cols = (
            "id",
            "name",
            "hardware",
            "backend",
            "max_batch",
            "last_seen",
            "version_held",
            "tokens_per_s",
            "state",
            "reason",
            "audit_total",
            "audit_abs / MAX(audit_tokens, 1)",
            "audit_kl / MAX(audit_tokens, 1)",
            "audit_beyond / MAX(audit_tokens, 1)",
            "cost_per_hour",
            *ACCOUNT,
            "(SELECT COUNT(*) FROM jobs j WHERE j.state = 'leased' AND j.lease_owner = s.id)",
            # What it cost while it was here, and per million tokens the trainer consumed.
            f"{SPENT}",
            f"{SPENT} * 1e6 / NULLIF(consumed_tokens, 0)",
        )
        names = (*cols[:10], "audited_tokens", "logprob_mean_abs", "logprob_kl", "logprob_beyond")
        names += ("cost_per_hour", *ACCOUNT, "leased", "spent", "cost_per_mtoken")
        rank = "CASE state WHEN 'alive' THEN 0 WHEN 'quarantined' THEN 1 WHEN 'revoked' THEN 1 ELSE 2 END"
        rows = self._tx(
            lambda c: c.execute(
                f"SELECT {', '.join(cols)} FROM samplers s ORDER BY {rank}, last_seen DESC LIMIT ?",
                (limit,),
            ).fetchall()
        )
        return [dict(zip(names, r)) for r in rows]

    def sampler_counts(self) -> dict[str, int]:
        """Samplers by state, all of them."""
        return dict(
            self._tx(
                lambda c: c.execute(
                    "SELECT state, COUNT(*) FROM samplers GROUP BY state"
                ).fetchall()
            )
        )

    def audit(
        self, audits: list[GroupAudit], policy: Quarantine, step: int
    ) -> list[tuple[str, str]]:
        """The trainer's check of the groups it trained on at `step`: its own log-probs of
        their tokens against the sampler's. Each group is measured against what honest
        samplers show for the same version: a group of version `step`, or one the trainer
        scored under that version's own weights (`exact`), against 0 (honest: numerics
        only); an older one scored under weights the trainer has since moved to, by as much
        for every honest sampler of that version, against the median inexact group of that
        version in this report (three or more of them; fewer, and it is no evidence). An
        exact group never counts towards a median: a report whose groups of one version come
        mostly from liars must not make the honest ones look off. Each sampler's
        excess over the baselines accumulates (decayed by `policy.decay` per report it
        appears in), and a sampler over the policy's bounds is quarantined: it leases and
        pushes nothing more (403 with the reason), its leases and unconsumed groups go back
        to the queue. A group counts once: one audited before (by the trainer or an
        auditor, or in a report sent again) is skipped. Returns (sampler id, reason) of each
        sampler quarantined now."""

        def fn(c):
            rows = []  # (sampler, version, tokens, abs/token, signed/token, beyond/token)
            for a in audits:
                row = c.execute(
                    "SELECT sampler_id, version FROM rollouts WHERE job_id = ?", (a.job_id,)
                ).fetchone()
                if row is None:
                    continue
                first = c.execute(
                    "INSERT INTO audits VALUES (?, NULL, 'done') ON CONFLICT (job_id) "
                    "DO UPDATE SET state = 'done', lease_deadline = NULL WHERE state != 'done'",
                    (a.job_id,),
                ).rowcount
                if a.logprobs is not None:
                    keep_token_logprobs(c, a)
                if first and a.tokens > 0:
                    sid, version = row
                    t = a.tokens
                    # An exact audit's version is "current": its baseline is 0.
                    key = step if a.exact else version
                    rows.append((sid, key, t, a.abs_delta / t, a.kl / t, a.beyond / t))
            baseline = {}
            for version in {r[1] for r in rows}:
                same = [r[3:] for r in rows if r[1] == version]
                if version == step:
                    baseline[version] = (0.0, 0.0, 0.0)
                elif len(same) >= 3:
                    baseline[version] = tuple(statistics.median(col) for col in zip(*same))
            per: dict[str, list[float]] = {}
            for sid, version, tokens, *figures in rows:
                if version not in baseline:
                    continue
                acc = per.setdefault(sid, [0.0, 0.0, 0.0, 0.0])
                acc[0] += tokens
                for i, (x, b) in enumerate(zip(figures, baseline[version])):
                    acc[i + 1] += (x - b) * tokens
            quarantined = []
            for sid, figures in per.items():
                state, reason = _accumulate(c, "samplers", "id", sid, figures, policy)
                if reason and state not in ("quarantined", "revoked"):
                    self._quarantine(c, sid, reason)
                    quarantined.append((sid, reason))
            return quarantined + self._judge_operators(c, per, policy)

        return self._tx(fn)

    def _judge_operators(self, c, per: dict, policy: Quarantine) -> list[tuple[str, str]]:
        """The audit's excess of each sampler (`per`: id -> tokens and summed excesses), also
        summed over its operator's samplers, old and new: an operator over the bounds is
        quarantined with every sampler it has, and may register none (a liar gains nothing
        by changing identity before its own audited tokens add up)."""
        by_operator: dict[str, list[float]] = {}
        for sid, figures in per.items():
            row = c.execute("SELECT operator FROM samplers WHERE id = ?", (sid,)).fetchone()
            if row and row[0]:
                acc = by_operator.setdefault(row[0], [0.0] * 4)
                acc[:] = [a + f for a, f in zip(acc, figures)]
        quarantined = []
        for name, figures in by_operator.items():
            state, reason = _accumulate(c, "operators", "name", name, figures, policy)
            if not reason or state != "active":
                continue
            reason = f"operator {name}: {reason}"
            c.execute(
                "UPDATE operators SET state = 'quarantined', reason = ? WHERE name = ?",
                (reason, name),
            )
            for (sid,) in c.execute(
                "SELECT id FROM samplers WHERE operator = ? AND state IN ('alive', 'lost')",
                (name,),
            ).fetchall():
                self._quarantine(c, sid, reason)
                quarantined.append((sid, reason))
        return quarantined

    @staticmethod
    def _return_leases(c, sampler_id: str) -> int:
        """`sampler_id`'s leased jobs back to the queue (no attempt counted); how many."""
        return c.execute(
            "UPDATE jobs SET state = 'queued', lease_owner = NULL, lease_deadline = NULL "
            "WHERE state = 'leased' AND lease_owner = ?",
            (sampler_id,),
        ).rowcount

    @staticmethod
    def _quarantine(c, sampler_id: str, reason: str) -> None:
        c.execute(
            "UPDATE samplers SET state = 'quarantined', reason = ? WHERE id = ?",
            (reason, sampler_id),
        )
        SwarmBook._return_leases(c, sampler_id)
        dropped = [
            (r[0],)
            for r in c.execute(
                "SELECT job_id FROM rollouts WHERE sampler_id = ? AND state IN ('scoring', 'ready')",
                (sampler_id,),
            )
        ]
        c.executemany("DELETE FROM rollouts WHERE job_id = ?", dropped)
        c.executemany(
            "UPDATE jobs SET state = 'queued', lease_owner = NULL WHERE job_id = ?", dropped
        )
        log.warning(
            "sampler %s quarantined (%s); %d unconsumed groups dropped",
            sampler_id,
            reason,
            len(dropped),
        )


TOKENS_KEPT = 500  # groups whose trainer log-probs per token are kept (one a step)


def keep_token_logprobs(c, a: GroupAudit) -> None:
    """Keep the trainer's log-probs of the tokens of group `a.job_id` (a row per completion,
    as long as the completion: Unprocessable otherwise, nothing kept), and only the last
    TOKENS_KEPT groups' (a long run's would grow by a group a step)."""
    (body,) = c.execute("SELECT body FROM rollouts WHERE job_id = ?", (a.job_id,)).fetchone()
    lengths = [len(x["token_ids"]) for x in json.loads(body)["completions"]]
    if [len(row) for row in a.logprobs] != lengths:
        raise Unprocessable(
            f"job {a.job_id}: logprobs for completions of {[len(r) for r in a.logprobs]} "
            f"tokens; the group's have {lengths}"
        )
    c.execute(
        "INSERT OR REPLACE INTO trainer_logprobs VALUES (?, ?)",
        (a.job_id, json.dumps(a.logprobs, separators=(",", ":"))),
    )
    c.execute(
        "DELETE FROM trainer_logprobs WHERE job_id <= (SELECT job_id FROM trainer_logprobs "
        "ORDER BY job_id DESC LIMIT 1 OFFSET ?)",
        (TOKENS_KEPT,),
    )
