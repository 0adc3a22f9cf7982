"""Dishonest samplers among honest ones, as real processes: one reports made-up log-probs,
one samples from perturbed weights, one sends right answers it never sampled. The trainer's
audit (its own log-probs of every token trained on, against the sampler's) gets each of them
quarantined within a few steps; the honest samplers, one of them generating in bfloat16
beside the fp32 trainer (`sampler.dtype`), never are; each one's mismatch is logged per
step and shown by `echorl status`; and the run still learns."""

import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import mean

import pytest

from tests.integration.conftest import (
    SAMPLED,
    SAMPLER,
    TRAINER,
    free_port,
    pass1,
    query,
    read_jsonl,
    start_broker,
    start_trainer,
    status_cli,
    stop_broker,
    wait_until,
)

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).parents[1] / "fixtures" / "dishonest_sampler.py"
HONEST, DISHONEST = ("honest", "bf16"), ("fake", "perturbed", "fabricate")
RUN = [
    "-o",
    "broker.mode=async",
    "-o",
    "train.batch_prompts=10",
    "-o",
    "train.group_size=4",
    "-o",
    "train.eval_prompts=50",
    "-o",
    SAMPLED,
    "-o",
    "broker.max_leased_per_sampler=4",  # every sampler gets a share of each batch
]
# Stated bound: each dishonest sampler is quarantined within this many trainer steps of
# its first group trained on (min_tokens = 128 audited tokens: 10-15 of its groups of
# 3-token answers, with five samplers sharing 10 groups a step).
WITHIN_STEPS = 15


def start(mode, url, model):
    env = os.environ | {"ECHORL_SAMPLER_TOKEN": SAMPLER}
    script = [] if mode in HONEST else [str(FIXTURE), mode]
    cmd = [sys.executable, *(script or ["-m", "echorl.cli"]), "sampler", "--broker", url]
    cmd += ["--model", str(model), "--name", mode, "--threads", "1", "--jobs-per-lease", "2"]
    if mode == "bf16":  # honest, in other numerics than the trainer's
        cmd += ["-o", "sampler.dtype=bfloat16"]
    return subprocess.Popen(
        [*cmd, *RUN], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def start_auditor(url, model, metrics):
    env = os.environ | {"ECHORL_TRAINER_TOKEN": TRAINER}
    cmd = [sys.executable, "-m", "echorl.cli", "auditor", "--broker", url, "--model", str(model)]
    cmd += ["--name", "auditor-0", "--threads", "1", "--metrics", str(metrics), *RUN]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def run_swarm(tmp_path, model, steps, *trainer_args, auditor=False):
    broker, url = start_broker(tmp_path / "b", free_port(), *RUN)
    samplers = [start(mode, url, model) for mode in (*HONEST, *DISHONEST)]
    if auditor:
        samplers.append(start_auditor(url, model, tmp_path / "auditor.jsonl"))
    # Every sampler in before the first version: a liar that starts late (its script imports
    # more) would otherwise find a 40-step run on 2 cores over and never be audited.
    registered = lambda: query(tmp_path / "b", "SELECT COUNT(*) FROM samplers")[0][0] == 5  # noqa: E731
    wait_until(registered, timeout=180, what="the five samplers registered")
    trainer = start_trainer(
        url, model, tmp_path / "t", "-o", f"train.steps={steps}", *RUN, *trainer_args
    )
    try:
        out = trainer.communicate(timeout=1200)[0]
        assert trainer.returncode == 0, out
        status = status_cli(url)
    finally:
        for s in samplers:
            if s.poll() is None:
                s.terminate()
        names = (*HONEST, *DISHONEST, "auditor")
        logs = {mode: s.communicate(timeout=60)[0] for mode, s in zip(names, samplers)}
        stop_broker(broker)
    states = dict(query(tmp_path / "b", "SELECT name, state FROM samplers"))
    return states, logs, out + status, read_jsonl(tmp_path / "t" / "metrics.jsonl")


def check(tmp_path, states, logs, out, records, within=WITHIN_STEPS, quarantined_at=None):
    """The swarm's outcome; `quarantined_at`: the steps at which liars were quarantined
    (default: those the trainer logged)."""
    got = {m: states.get(m) for m in DISHONEST}
    assert got == dict.fromkeys(DISHONEST, "quarantined"), (states, out, logs)
    assert all(states[m] != "quarantined" for m in HONEST), (states, out)
    for mode in DISHONEST:  # told why, and it stopped (exit 2)
        assert "quarantined" in logs[mode], logs[mode][-2000:]
    # Within the stated number of steps of its first group trained on.
    first = {}
    for sid, step in query(
        tmp_path / "b",
        "SELECT sampler_id, MIN(consumed_step) FROM rollouts "
        "WHERE consumed_step IS NOT NULL GROUP BY sampler_id",
    ):
        first[sid] = step
    named = dict(query(tmp_path / "b", "SELECT name, id FROM samplers"))
    if quarantined_at is None:
        quarantined_at = [r["step"] for r in records if r.get("audit/quarantined")]
    assert len(quarantined_at) >= 1
    last_q = max(quarantined_at)
    for mode in DISHONEST:
        assert named[mode] not in first or last_q - first[named[mode]] <= within + 1, (
            mode,
            first,
            quarantined_at,
        )
    # Every sampler's log-prob mismatch is logged per step, and shown by `echorl status`;
    # the bf16 sampler's is the larger of the honest ones' (numerics, not dishonesty).
    logged = {k.split("/")[1] for r in records for k in r if k.startswith("mismatch/")}
    assert {named[m] for m in HONEST} <= logged, logged
    mean = {
        m: [
            r[f"mismatch/{named[m]}/mean_abs"]
            for r in records
            if f"mismatch/{named[m]}/mean_abs" in r
        ]
        for m in HONEST
    }
    mean = {m: sum(v) / len(v) for m, v in mean.items()}
    assert mean["bf16"] > 2 * mean["honest"], mean
    figures = query(
        tmp_path / "b",
        "SELECT name, state, audit_abs / MAX(audit_tokens, 1), audit_kl / MAX(audit_tokens, 1), "
        "audit_beyond / MAX(audit_tokens, 1) FROM samplers",
    )
    print(f"logged mean |dlp| {mean}; excess (abs, signed, beyond) {figures}")
    assert "log-prob mismatch" in out and all(named[m] in out for m in HONEST), out[-3000:]
    train = [r["reward/mean"] for r in records if "reward/mean" in r]
    evals = pass1(records)
    return train, evals


def honest_rewards(tmp_path):
    """The honest samplers' rewards, pooled per trainer step that consumed them."""
    by_step = {}
    for step, rewards in query(
        tmp_path / "b",
        "SELECT r.consumed_step, r.rewards FROM rollouts r JOIN samplers s "
        "ON s.id = r.sampler_id WHERE r.consumed_step IS NOT NULL AND s.name IN (?, ?)",
        *HONEST,
    ):
        by_step.setdefault(step, []).extend(json.loads(rewards))
    return [mean(by_step[s]) for s in sorted(by_step)]


@pytest.mark.long  # ~50 s, 40 steps of a 5-sampler swarm
def test_dishonest_samplers_are_quarantined_and_honest_ones_are_not(tmp_path, warm_add):
    states, logs, out, records = run_swarm(tmp_path, warm_add, steps=40)
    _, evals = check(tmp_path, states, logs, out, records)
    # The run is not harmed. 40 steps with three liars in the swarm are too few for a held-out
    # rise to be steady (sampled pass@1 on 50 problems: 0.53 -> 0.59 in one run, 0.53 ->
    # 0.53 in another; greedy 0.78 -> 0.92 on one CPU, 0.82 -> 0.72 on another): it must not
    # fall, and the honest samplers' own rewards must not either. The 200-step run (`slow`)
    # asserts that it learns. "Must not fall" allows 2.5 sigma of the difference of two means
    # of 10 steps' honest rewards (a step's varies by about 0.13 around 0.75, so the
    # difference by about 0.06): with no slack it failed CI at 0.7456 -> 0.745.
    assert evals[-1] >= evals[0] - 0.05, evals
    honest = honest_rewards(tmp_path)
    assert mean(honest[-10:]) >= mean(honest[:10]) - 0.15, honest


# slow (~1.5 min): the default suite's 15 minutes; the test above runs the same swarm.
@pytest.mark.slow
def test_an_auditor_takes_the_extra_passes_off_the_trainer_and_catches_every_liar(
    tmp_path, warm_add
):
    """`echorl auditor` alive: the trainer audits only what its update's own pass covers
    (on-policy groups); the auditor audits the rest (flat and stale groups) under their own
    version's weights once no step can consume them, and every dishonest sampler is still
    quarantined, at most 3 steps later than the trainer alone is allowed (the staleness
    bound + 1 versions before a version is final, and the auditor's lease and pass)."""
    states, logs, out, records = run_swarm(tmp_path, warm_add, 40, auditor=True)
    train = [r for r in records if "reward/mean" in r]
    assert all(r["broker/auditors"] == 1 for r in train[5:]), [r["broker/auditors"] for r in train]
    # The trainer's share: a third of the batch (10 groups a step) or less; measured ~2.
    audited = [r["audit/groups"] for r in train[5:]]
    assert sum(audited) < 0.35 * 10 * len(audited), audited
    by_auditor = read_jsonl(tmp_path / "auditor.jsonl")
    assert sum(r["auditor/groups"] for r in by_auditor) >= 100, by_auditor
    assert all(0 < r["auditor/lag"] <= 6 for r in by_auditor), by_auditor  # final versions
    assert "auditor-0: stopped after" in logs["auditor"], logs["auditor"]
    assert "auditors alive: 1" in out and "audits: " in out, out[-2000:]  # echorl status
    # The auditor's quarantines, at the step the trainer had reached (its latest version).
    at = [r["version"] + r["auditor/lag"] for r in by_auditor if r["auditor/quarantined"]]
    check(tmp_path, states, logs, out, records, within=WITHIN_STEPS + 3, quarantined_at=at)
    # Every consumed group audited once, by one of them; only the last versions, which no
    # later step made final, left open (or a version whose weights went before the auditor).
    audits = dict(query(tmp_path / "b", "SELECT state, COUNT(*) FROM audits GROUP BY state"))
    consumed = query(tmp_path / "b", "SELECT COUNT(*) FROM rollouts WHERE state = 'consumed'")
    assert sum(audits.values()) == consumed[0][0], audits
    assert audits["done"] >= 0.8 * consumed[0][0], audits


@pytest.mark.slow
def test_200_steps_with_dishonest_samplers_still_learn(tmp_path, warm_add):
    states, logs, out, records = run_swarm(tmp_path, warm_add, steps=200)
    train, evals = check(tmp_path, states, logs, out, records)
    assert sum(train[-20:]) / 20 >= sum(train[:20]) / 20 + 0.1, train
    assert evals[-1] >= evals[0] + 0.06, evals  # sampled pass@1


@pytest.mark.slow
def test_a_spot_check_of_a_quarter_still_quarantines_every_dishonest_sampler(tmp_path, warm_add):
    """quarantine.audit_fraction = 0.25: flat and stale groups are audited one in four, so
    a dishonest sampler's audited tokens add up to min_tokens up to 4x later."""
    states, logs, out, records = run_swarm(
        tmp_path, warm_add, 100, "-o", "quarantine.audit_fraction=0.25"
    )
    audited = [r["audit/groups"] for r in records if "audit/groups" in r]
    assert sum(audited) < 0.8 * 10 * len(audited), audited  # a spot check, not the batch
    check(tmp_path, states, logs, out, records, within=4 * WITHIN_STEPS)
