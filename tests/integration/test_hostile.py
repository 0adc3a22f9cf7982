"""An outside tester's attacks on a real broker process (issue 24): each was a reproduction
that worked against the broker before its fix; each test asserts the numbers that show it no
longer does."""

import hashlib

import httpx
import pytest
import torch

from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import ScoredGroup
from echorl.trainer.batch import batch_from_groups
from tests.integration.conftest import TRAINER, as_, group, query, register, wait_until

pytestmark = pytest.mark.integration

CODEC = RunTokenizer.builtin()
EOS = 1


def publish(url, version, blob):
    headers = as_(TRAINER) | {"X-Sha256": hashlib.sha256(blob).hexdigest()}
    return httpx.put(f"{url}/v1/weights/{version}", content=blob, headers=headers)


def lease(url, sid, n=1):
    return httpx.post(f"{url}/v1/jobs/lease", json={"sampler_id": sid, "n": n}, headers=as_(sid))


def right_answer(job) -> str:
    a, b = job["prompt"][:-1].split("+")
    return str(int(a) + int(b))


def test_reward_laundering_through_turns_is_refused(broker):
    """A single-turn task's completion that marks the right answer as environment tokens
    behind a lone eos (the model's only token) is refused, whole push or in a batch, and
    changes nothing; a group that is accepted trains on exactly the tokens it was scored on."""
    url, data = broker
    publish(url, 0, b"w")
    sid = register(url, "launderer")
    (job,) = lease(url, sid).json()["jobs"]
    answer = CODEC.encode(right_answer(job))
    laundered = {
        "token_ids": [EOS, *answer],
        "logprobs": [-0.01] * (1 + len(answer)),
        "finished": True,
        "turns": [{"start": 0, "end": 1, "version": 0}],  # the model said only eos
    }
    body = group(job) | {"completions": [laundered, laundered], "rewards": [1.0, 1.0]}

    r = httpx.post(f"{url}/v1/rollouts", json={"sampler_id": sid, "group": body}, headers=as_(sid))
    assert r.status_code == 422 and "turns on a single-turn task" in r.text, r.text
    r = httpx.post(
        f"{url}/v1/rollouts/batch", json={"sampler_id": sid, "groups": [body]}, headers=as_(sid)
    )
    assert r.status_code == 200
    (result,) = r.json()["results"]
    assert not result["stored"] and "turns on a single-turn task" in result["refused"]
    assert query(data, "SELECT COUNT(*) FROM rollouts") == [(0,)]
    assert query(data, "SELECT state FROM jobs WHERE job_id = ?", job["job_id"]) == [("leased",)]

    # The honest answer to the same job: stored, scored and pulled; every token the verifier
    # read is a token the loss (and the audit, which uses the same mask) trains on.
    ids = [*answer, EOS]
    honest = {"token_ids": ids, "logprobs": [-0.5] * len(ids), "finished": True}
    body |= {"completions": [honest, honest], "rewards": [1.0, 1.0]}
    r = httpx.post(f"{url}/v1/rollouts", json={"sampler_id": sid, "group": body}, headers=as_(sid))
    assert r.status_code == 200 and r.json() == {"stored": True}

    def pulled():
        reply = httpx.post(
            f"{url}/v1/batches/pull", json={"n": 1, "step": 0, "wait_s": 2}, headers=as_(TRAINER)
        )
        return reply.json()["groups"]

    (g,) = wait_until(pulled, timeout=60, what="the honest group scored")
    g = ScoredGroup.model_validate(g)
    assert g.rewards == [1.0, 1.0]
    batch = batch_from_groups([g], torch.zeros(1, 2), pad_id=0)
    assert (
        batch.loss_mask.sum().item() == sum(len(c.token_ids) for c in g.completions) == 2 * len(ids)
    )
