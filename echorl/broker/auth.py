"""Who may call what: bearer tokens per role, checked by one FastAPI dependency.

Two roles, each with its own token (from the config or $ECHORL_TRAINER_TOKEN /
$ECHORL_SAMPLER_TOKEN): `sampler` (register, lease, push, download weights) and
`trainer` (publish, pull, ack, rewind), which is also the admin and may call every
route. `--insecure-no-auth` lets every call through as the trainer (local demos).
"""

from __future__ import annotations

import hmac
import os

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from echorl.config import BrokerConfig
from echorl.protocol import Forbidden, Unauthorized

_bearer = HTTPBearer(auto_error=False)


class Auth:
    def __init__(self, cfg: BrokerConfig):
        tokens = {
            "trainer": cfg.trainer_token or os.environ.get("ECHORL_TRAINER_TOKEN"),
            "sampler": cfg.sampler_token or os.environ.get("ECHORL_SAMPLER_TOKEN"),
        }
        if not cfg.insecure_no_auth and not all(tokens.values()):
            raise ValueError(
                "broker.trainer_token and broker.sampler_token are required "
                "(or set ECHORL_TRAINER_TOKEN / ECHORL_SAMPLER_TOKEN, or --insecure-no-auth)"
            )
        self.tokens = {role: t for role, t in tokens.items() if t}  # never logged
        self.insecure = cfg.insecure_no_auth

    def role(self, token: str | None) -> str:
        """The role `token` belongs to; Unauthorized if none."""
        if self.insecure:
            return "trainer"
        if token is None:
            raise Unauthorized("missing bearer token")
        for role, known in self.tokens.items():
            if hmac.compare_digest(token.encode(), known.encode()):
                return role
        raise Unauthorized("unknown token")


def require(role: str):
    """A route dependency: the caller holds `role`'s token (or the trainer's, the admin's)."""

    def check(request: Request, cred: HTTPAuthorizationCredentials | None = Depends(_bearer)):
        who = request.app.state.broker.auth.role(cred.credentials if cred else None)
        if who != role and who != "trainer":
            raise Forbidden(f"the {who} role may not call this route")
        return who

    return Depends(check)


SAMPLER, TRAINER = require("sampler"), require("trainer")
