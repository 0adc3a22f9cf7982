"""A real sampler process on a real broker; the test plays the trainer (sync protocol)."""

import signal
import time

import pytest
import torch

from echorl.client import BrokerClient
from echorl.models import load_policy, save_tiny_model
from echorl.trainer.batch import Row, collate, token_logprobs
from tests.integration.conftest import TRAINER, free_port, start_broker, start_sampler, stop_broker

pytestmark = pytest.mark.integration


def pull_until(trainer, n, step, timeout=90):
    got, t0 = [], time.time()
    while len(got) < n:
        assert time.time() - t0 < timeout, f"only {len(got)} groups for step {step}"
        got += trainer.pull(n - len(got), step).groups
        time.sleep(0.2)
    return got


def test_sampler_follows_published_versions_and_swaps_weights_in_place(tmp_path):
    v0, v1 = (
        save_tiny_model(tmp_path / "v0", "1m", seed=0),
        save_tiny_model(tmp_path / "v1", "1m", seed=1),
    )
    broker, url = start_broker(tmp_path / "b", free_port(), "-o", "task.name=add")
    sampler = start_sampler(url, v0, "s1", "-o", "train.group_size=2", "-o", "task.name=add")
    try:
        with BrokerClient(url, TRAINER) as trainer:
            trainer.publish(0, v0 / "model.safetensors")
            groups = pull_until(trainer, 4, step=0)
            assert all(g.version == 0 and len(g.completions) == 2 for g in groups)
            assert all(len(g.rewards) == 2 for g in groups)
            trainer.ack([g.job_id for g in groups], 0)

            trainer.publish(1, v1 / "model.safetensors")
            later = pull_until(trainer, 2, step=1)
            assert all(g.version == 1 for g in later)
            # The behaviour log-probs are v1's: the sampler swapped its weights in place.
            model, tok = load_policy(v1)
            group = later[0]
            c = group.completions[0]
            # The prompt travelled as ids, encoded once by the broker with the run's tokenizer.
            text = _prompt_of(tmp_path / "b", group.job_id)
            assert group.prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
            row = Row(group.prompt_ids, c.token_ids, c.logprobs, c.mask, 0.0)
            batch = collate([row], tok.pad_token_id)
            with torch.no_grad():
                logp, _ = token_logprobs(model, batch)
            mask = batch.loss_mask.bool()
            assert torch.allclose(logp[mask], batch.behaviour_logp[mask], atol=1e-4)
            for _ in range(100):  # the sampler reports its version and speed after each batch
                (seen,) = trainer.status().samplers
                if seen.version_held == 1:
                    break
                time.sleep(0.1)
            assert seen.version_held == 1 and seen.tokens_per_s > 0 and seen.name == "s1"
    finally:
        sampler.send_signal(signal.SIGTERM)
        out = sampler.communicate(timeout=30)[0]
        stop_broker(broker)
    assert sampler.returncode == 0, out
    assert "s1: stopped after" in out
    import sqlite3

    with sqlite3.connect(tmp_path / "b" / "broker.sqlite") as db:
        assert db.execute("SELECT state FROM samplers").fetchall() == [("left",)]
        assert db.execute("SELECT COUNT(*) FROM jobs WHERE state = 'leased'").fetchone()[0] == 0


def _prompt_of(data_dir, job_id):
    import sqlite3

    with sqlite3.connect(data_dir / "broker.sqlite") as db:
        return db.execute("SELECT prompt FROM jobs WHERE job_id = ?", (job_id,)).fetchone()[0]
