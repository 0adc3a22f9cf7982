"""Schemathesis against the broker's OpenAPI schema: generated requests never get a 5xx.

Runs in-process on the ASGI app (every route, bounded examples per route), with the
trainer token so requests reach the handlers rather than stopping at auth.
"""

import schemathesis
from hypothesis import HealthCheck, given, settings

from echorl.broker.app import create_app
from echorl.config import load_config
from echorl.protocol import MAX_WAIT_S
from tests.integration.conftest import SAMPLER, TRAINER

EXAMPLES_PER_ROUTE = 20  # x 20 routes
SHORT_POLL_S = 0.05  # a valid long-poll wait_s is cut to this: the handlers run, nobody waits


def test_no_generated_request_makes_the_broker_fail(tmp_path):
    cfg = load_config(
        None,
        [
            f"broker.trainer_token={TRAINER}",
            f"broker.sampler_token={SAMPLER}",
            "train.group_size=2",
            f"broker.data_dir={tmp_path}",
        ],
    )
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(cfg))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12
    seen: dict[str, set[int]] = {}

    def fuzz(op):
        @given(case=op.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_ROUTE,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case):
            # Long polls (lease, pull, audit) would wait out up to MAX_WAIT_S on an empty broker,
            # most of the test's time: a valid wait is shortened (invalid ones stay, for the 422).
            wait = case.body.get("wait_s") if isinstance(case.body, dict) else None
            if type(wait) in (int, float) and 0 <= wait <= MAX_WAIT_S:
                case.body["wait_s"] = min(wait, SHORT_POLL_S)
            response = case.call(
                headers={"Authorization": f"Bearer {TRAINER}"}, timeout=MAX_WAIT_S + 20
            )
            seen.setdefault(f"{op.method.upper()} {op.path}", set()).add(response.status_code)
            assert response.status_code < 500, (
                case.method,
                case.path,
                case.body,
                response.text[:300],
            )

        check()

    for op in operations:
        fuzz(op)
    assert len(seen) == len(operations)
