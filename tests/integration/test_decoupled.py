"""The decoupled system as separate processes: a broker, 2 samplers and a trainer."""

import json
import os
import sqlite3
import subprocess
import sys

import pytest

from echorl.models import save_tiny_model
from tests.integration.conftest import (
    SAMPLER,
    TRAINER,
    free_port,
    start_broker,
    start_sampler,
    stop_broker,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode,bound", [("sync", 0), ("async", 1)])
def test_protocol_holds_end_to_end(tmp_path, mode, bound):
    model = save_tiny_model(tmp_path / "v0", "1m", seed=0)
    run = [
        "-o",
        "task.name=add",
        "-o",
        "train.group_size=4",
        "-o",
        "train.batch_prompts=4",
        "-o",
        f"broker.mode={mode}",
        "-o",
        f"broker.max_staleness={bound}",
    ]
    broker, url = start_broker(tmp_path / "b", free_port(), *run)
    env = os.environ | {"ECHORL_SAMPLER_TOKEN": SAMPLER, "ECHORL_TRAINER_TOKEN": TRAINER}
    samplers = [start_sampler(url, model, f"s{k}", "--jobs-per-lease", "2", *run) for k in range(2)]
    try:
        trainer = subprocess.run(
            [
                sys.executable,
                "-m",
                "echorl.cli",
                "trainer",
                "--broker",
                url,
                "--model",
                str(model),
                "--out",
                str(tmp_path / "t"),
                "-o",
                "train.steps=4",
                "-o",
                "train.drop_flat_groups=false",
                *run,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    finally:
        for s in samplers:
            s.terminate()
        outs = [s.communicate(timeout=30)[0] for s in samplers]
        stop_broker(broker)
    assert all(s.returncode == 0 for s in samplers), outs
    records = [
        json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["rollout/staleness_max"] <= bound
        if mode == "sync":
            assert r["rollout/versions"] == [r["step"] - 1]
    with sqlite3.connect(tmp_path / "b" / "broker.sqlite") as db:
        consumed = db.execute(
            "SELECT job_id, version, consumed_step FROM rollouts WHERE state = 'consumed'"
        ).fetchall()
    assert len(consumed) == 16 and len({j for j, _, _ in consumed}) == 16
    assert all(0 <= step - version <= bound for _, version, step in consumed)
    assert (tmp_path / "t" / "reward_curve.png").is_file()
