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

EXAMPLES_PER_ROUTE = 20  # x 20 routes; the long polls may wait their wait_s


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
            # A long poll may be held MAX_WAIT_S: the read timeout must outlast it.
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
