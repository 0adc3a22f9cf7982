"""How far the broker trusts each sampler, from what it observed itself, never from what a
sampler says of itself: identities cost nothing, so nothing may be had per identity that
has not been paid for in checked work.

Today standing has two levels. A sampler is *proven* once the trainer has audited
`proven_tokens` of its tokens without quarantining it (the audit recomputes their
log-probs: real compute, which no identity gets for free); with the audit off
(`proven_tokens` = 0), once a group of it was scored. A lapse (a lease that ran out) does
not unprove it. What asks:

- leases (`store.Probation`): an unproven identity's jobs are extra, beyond the trainer's
  budget, and all unproven identities together hold at most `broker.newcomer_jobs`: none
  ever holds a job the trainer waits for;
- verifier turns (`turn`, the key `rollout.verify.VerifierPool` serves in turn): proven
  samplers' groups first, each sampler its own turn; unproven groups after them, one turn
  per operator (every identity of the shared enrolment token shares one) and each
  identity in turn within it, so sybils that each deliver a group cannot stand, one turn
  each, in front of a proven sampler's group, nor a named operator's identities take
  more turns than one.

    standing = Standing(proven_tokens=128)
    standing.observe(store.standing_rows())    # at start, and after each audit report
    key = standing.turn(sampler_id)            # (0, id, id) or (1, operator, id)
"""

from __future__ import annotations

from dataclasses import dataclass, field


def is_proven(proven_tokens: int, delivered: int, audited_tokens: float) -> bool:
    """The one rule (see the module docstring)."""
    if proven_tokens:
        return audited_tokens >= proven_tokens
    return delivered > 0


def proven_sql(proven_tokens: int) -> str:
    """`is_proven` as an SQL condition on a row of the samplers table."""
    return f"audit_total >= {float(proven_tokens)}" if proven_tokens else "delivered > 0"


@dataclass
class Standing:
    """Which samplers are proven, and whose enrolment token (operator) each joined with."""

    proven_tokens: int = 0
    # Probation off (broker.first_lease >= max_leased_per_sampler): the operator trusts every
    # identity it lets in, and every mechanism treats each as proven.
    trust_all: bool = False
    proven: set[str] = field(default_factory=set)
    operators: dict[str, str] = field(default_factory=dict)  # sampler id -> operator ('' shared)

    def trusted(self, sampler_id: str) -> bool:
        """Whether `sampler_id`'s word and work count as a proven sampler's."""
        return self.trust_all or sampler_id in self.proven

    def joined(self, sampler_id: str, operator: str) -> None:
        self.operators[sampler_id] = operator

    def observe(self, rows: list[tuple[str, str, int, float]]) -> list[str]:
        """Take the book's (id, operator, delivered, audited tokens) rows; returns the ids
        proven by them that were not before."""
        new = []
        for sampler_id, operator, delivered, audited in rows:
            self.operators[sampler_id] = operator
            if sampler_id not in self.proven and is_proven(self.proven_tokens, delivered, audited):
                self.proven.add(sampler_id)
                new.append(sampler_id)
        return new

    def forget(self, sampler_id: str) -> None:
        self.proven.discard(sampler_id)
        self.operators.pop(sampler_id, None)

    def describe(self, sampler_id: str, audited: float) -> str:
        """What the status shows: proven, or how far from it and what that withholds."""
        if sampler_id in self.proven:
            return "proven"
        if self.trust_all:
            return "trusted (no probation)"
        who = self.operators.get(sampler_id)  # '' for the shared enrolment token
        newcomer = f"newcomer of operator {who}" if who else "newcomer"
        if self.proven_tokens:
            return f"{newcomer}: {audited:.0f} of {self.proven_tokens} tokens audited"
        return f"{newcomer}: no group delivered"

    def turn(self, sampler_id: str) -> tuple[int, str, str]:
        """The verifier-queue key of a group `sampler_id` pushed: (tier, group, who), served
        lower tier first, then group by group, then who by who in the group."""
        if self.trusted(sampler_id):
            return (0, sampler_id, sampler_id)
        return (1, "operator:" + self.operators.get(sampler_id, ""), sampler_id)
