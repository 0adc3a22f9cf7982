"""Who may call what: bearer tokens, checked by one FastAPI dependency per kind of route.

Four kinds of caller:

- the trainer (`broker.trainer_token` or $ECHORL_TRAINER_TOKEN): publish, pull, ack,
  rewind, status, revoke; it is also the admin and may call every route;
- enrolment (`broker.sampler_token` or $ECHORL_SAMPLER_TOKEN, shared by the swarm, or an
  operator's own token, issued by the admin: `echorl samplers enrol NAME`): may register a
  sampler and read the run, nothing else. What the audit finds and what hoarding costs stay
  with an operator, whatever identities it registers; the shared token has no such memory;
  registrations are rate-limited per token and per client address (`RateLimit`);
- a viewer (`broker.viewer_token` or $ECHORL_VIEWER_TOKEN, optional): the dashboard at /ui,
  nothing else;
- a registered sampler: registration returns a credential of its own, and every later call
  carries it. It may act only as itself (a push, lease, heartbeat or leave naming another
  sampler is 403), and a revoked or departed sampler's credential is refused (401).

Credentials are random, shown once, and kept only as sha256 hashes (here in memory, in
the store on disk). `--insecure-no-auth` lets every call through as the trainer (local
demos).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from echorl.config import BrokerConfig
from echorl.protocol import Forbidden, Unauthorized

_bearer = HTTPBearer(auto_error=False)


@dataclass(frozen=True)
class Caller:
    role: str  # "trainer", "enrol" or "sampler"
    sampler_id: str | None = None  # the sampler whose credential this is
    operator: str = ""  # enrolment with an operator's own token: its name ('' = shared)

    def acts_as(self, sampler_id: str) -> None:
        """A sampler may act only as itself (the trainer, as admin, as anyone)."""
        if self.role == "sampler" and sampler_id != self.sampler_id:
            raise Forbidden("this credential belongs to another sampler")


def new_credential() -> tuple[str, str]:
    """(a new sampler credential, its hash: what is stored)."""
    token = secrets.token_urlsafe(32)
    return token, digest(token)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Auth:
    def __init__(
        self,
        cfg: BrokerConfig,
        samplers: dict[str, str],
        revoked: set[str] = frozenset(),
        operators: dict[str, str] | None = None,
    ):
        tokens = {
            "trainer": cfg.trainer_token or os.environ.get("ECHORL_TRAINER_TOKEN"),
            "enrol": cfg.sampler_token or os.environ.get("ECHORL_SAMPLER_TOKEN"),
        }
        if not cfg.insecure_no_auth and not all(tokens.values()):
            raise ValueError(
                "broker.trainer_token and broker.sampler_token are required "
                "(or set ECHORL_TRAINER_TOKEN / ECHORL_SAMPLER_TOKEN, or --insecure-no-auth)"
            )
        # The dashboard's read-only viewers, when the run names a token for them.
        tokens["viewer"] = cfg.viewer_token or os.environ.get("ECHORL_VIEWER_TOKEN")
        self.tokens = {role: t for role, t in tokens.items() if t}  # never logged
        self.insecure = cfg.insecure_no_auth
        self.samplers = dict(samplers)  # credential hash -> sampler id
        self.secrets = {sid: secret for secret, sid in self.samplers.items()}  # and back
        self.revoked = set(revoked)  # credential hashes the admin revoked
        self.operators = dict(operators or {})  # enrolment token hash -> operator name

    def admit(self, sampler_id: str, secret: str) -> None:
        self.samplers[secret] = sampler_id
        self.secrets[sampler_id] = secret

    def forget(self, sampler_id: str, revoked: bool = False) -> None:
        """The sampler left, was revoked or forgotten: its credential is refused from now on."""
        secret = self.secrets.pop(sampler_id, None)
        if secret is not None:
            self.samplers.pop(secret, None)
            if revoked:
                self.revoked.add(secret)

    def identify(self, token: str | None) -> Caller:
        """Who `token` belongs to; Unauthorized if nobody."""
        if self.insecure:
            return Caller("trainer")
        if token is None:
            raise Unauthorized("missing bearer token")
        for role, known in self.tokens.items():
            if hmac.compare_digest(token.encode(), known.encode()):
                return Caller(role)
        secret = digest(token)
        if operator := self.operators.get(secret):
            return Caller("enrol", operator=operator)
        sampler_id = self.samplers.get(secret)  # a dict lookup of a hash: no timing leak
        if sampler_id is None:
            if secret in self.revoked:
                raise Unauthorized("this sampler was revoked by the run's admin")
            raise Unauthorized("unknown token (a sampler that has left registers again)")
        return Caller("sampler", sampler_id)


def require(*roles: str):
    """A route dependency: the caller holds one of `roles` (the trainer, the admin, always
    passes); the route gets the `Caller`."""

    # async: a dependency FastAPI runs on the event loop, not with a hop to a thread
    async def check(
        request: Request, cred: HTTPAuthorizationCredentials | None = Depends(_bearer)
    ) -> Caller:
        caller = request.app.state.broker.auth.identify(cred.credentials if cred else None)
        if caller.role not in roles and caller.role != "trainer":
            raise Forbidden(f"the {caller.role} role may not call this route")
        return caller

    return Depends(check)


ENROL = require("enrol")  # register
SAMPLER = require("sampler")  # every call of a registered sampler
ANYONE = require("enrol", "sampler")  # read the run
TRAINER = require()


class RateLimit:
    """Token buckets by key: `per_s` calls a second after a burst of `burst` (rate 0: no
    limit). Keys idle long enough to be full again are forgotten, so the table stays small."""

    def __init__(self, per_s: float, burst: float):
        self.rate, self.burst = per_s, max(1.0, burst)
        self.buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, when)

    def take(self, key: str, now: float) -> float:
        """Take one call for `key`: 0, or the seconds until one is allowed (nothing taken)."""
        if not self.rate:
            return 0.0
        tokens, when = self.buckets.get(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - when) * self.rate)
        if tokens < 1.0:
            return (1.0 - tokens) / self.rate
        self.buckets[key] = (tokens - 1.0, now)
        if len(self.buckets) > 10_000:
            full = self.burst / self.rate
            self.buckets = {k: v for k, v in self.buckets.items() if now - v[1] < full}
        return 0.0
