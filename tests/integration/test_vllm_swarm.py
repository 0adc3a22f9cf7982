"""A decoupled async run with a vLLM sampler beside an HF sampler on one broker: both samplers'
groups are trained on, the trainer's log-prob audit finds both honest, and held-out pass@1
is kept (its rise in 40 steps is not steady: see SLACK).
Skipped where vLLM is not installed; run with the vLLM environment:

    .venv-engines/bin/python -m pytest -m vllm tests/integration/test_vllm_swarm.py
"""

import os

import pytest

pytest.importorskip("vllm")

from tests.integration.conftest import (  # noqa: E402
    SAMPLED,
    free_port,
    pass1,
    query,
    read_jsonl,
    start_broker,
    start_sampler,
    start_trainer,
    stop_broker,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB (CPU build): the 1m model needs little


RUN = [
    *("-o", "broker.mode=async"),
    *("-o", "train.batch_prompts=8"),
    *("-o", "train.group_size=4"),
    *("-o", "train.eval_prompts=100"),
    *("-o", "train.eval_every=0"),  # held-out sampled pass@1 before and after
    *("-o", SAMPLED),
    *("-o", "broker.max_leased_per_sampler=4"),  # both samplers get a share of each batch
]


# Held-out sampled pass@1 over the 40 steps (100 problems x 8 samples). Measured from a
# warm-up at 0.484, full weights added +0.074 and +0.080; from today's warm-up (0.686) three
# runs gave +0.004, -0.069 and +0.025 (a 500-step warm-up, 0.346: +0.000), while the train
# reward rose in two of them: 40 steps of 8 prompts are too few for a held-out rise to be
# steady, so learning is asserted where it is (test_decoupled.py, test_learning.py: the audit
# here shows vLLM's groups are the same signal, log-probs equal the trainer's to ~4e-7).
# Here pass@1 must not fall by more than SLACK, 3 sigma of the difference of two estimates
# of 800 samples at p = 0.7 (sqrt(2 * 0.21 / 800) = 0.023; 0.03 had failed on noise): a
# collapse (LoRA at lr 3e-3: pass@1 to 0) fails it by far. LoRA at lr 1e-3 adds little in
# 40 steps (+0.019, +0.003); its learning is asserted by test_lora_run.py.
SLACK = 0.07

LORA = [*("-o", "model.lora.rank=8"), *("-o", "optim.lr=1e-3")]


@pytest.mark.parametrize("weights", ["full", "lora"])
def test_a_vllm_sampler_beside_an_hf_sampler_is_trained_on_and_audited_exact(
    tmp_path, warm_add, weights
):
    """Async, one broker, the HF sampler and the vLLM sampler (fp32) side by side, 40 steps
    from the warmed-up model on `add`. Both samplers' groups are trained on, the trainer's
    audit finds both honest (log-prob mismatch at numerical noise), and held-out sampled
    pass@1 is kept (see SLACK). lora: every version after v0 an adapter, applied by both
    (peft; vLLM's LoRA), the audit exact for stale groups too."""
    run = RUN + (LORA if weights == "lora" else [])
    broker, url = start_broker(tmp_path / "b", free_port(), *run)
    lease = ("--jobs-per-lease", "4")
    samplers = {
        "hf": start_sampler(url, warm_add, "hf", *lease, *run),
        "vllm": start_sampler(
            url, warm_add, "vllm", "--backend", "vllm", "-o", "sampler.dtype=float32", *lease, *run
        ),
    }
    try:
        # The vLLM engine starts in 30-90 s on 2 busy cores: train once both have registered.
        def registered():
            for name, proc in samplers.items():
                assert proc.poll() is None, (name, proc.communicate()[0][-3000:])
            return len(query(tmp_path / "b", "SELECT id FROM samplers")) == 2

        wait_until(registered, 600, "both samplers to register")
        trainer = start_trainer(url, warm_add, tmp_path / "t", "-o", "train.steps=40", *run)
        out = trainer.communicate(timeout=1200)[0]
        assert trainer.returncode == 0, out
    finally:
        for proc in samplers.values():
            proc.terminate()
        logs = {name: proc.communicate(timeout=120)[0] for name, proc in samplers.items()}
        stop_broker(broker)
    rows = query(
        tmp_path / "b",
        "SELECT s.name, s.backend, s.state, COUNT(*), s.audit_abs / MAX(s.audit_tokens, 1), "
        "s.audit_kl / MAX(s.audit_tokens, 1) FROM rollouts r JOIN samplers s "
        "ON r.sampler_id = s.id WHERE r.state = 'consumed' GROUP BY s.id",
    )
    by_name = {r[0]: r[1:] for r in rows}
    assert set(by_name) == {"hf", "vllm"}, (rows, logs["vllm"][-3000:])
    for name, (backend, state, consumed, excess_abs, excess_kl) in by_name.items():
        assert backend == name and state == "left" and consumed >= 20, by_name  # never quarantined
        assert abs(excess_abs) < 0.05 and abs(excess_kl) < 0.05, by_name
    records = read_jsonl(tmp_path / "t" / "metrics.jsonl")
    ids = dict(query(tmp_path / "b", "SELECT name, id FROM samplers"))
    for name in ("hf", "vllm"):  # the mismatch per sampler, logged at the steps it served
        logged = [
            r[f"mismatch/{ids[name]}/mean_abs"]
            for r in records
            if f"mismatch/{ids[name]}/mean_abs" in r
        ]
        assert logged and max(logged) < (1e-3 if weights == "lora" else 0.5), (name, logged)
    train = [r["reward/mean"] for r in records if "reward/mean" in r]
    first, last = sum(train[:10]) / 10, sum(train[-10:]) / 10
    if weights == "lora":
        kinds = [r["perf/publish_bytes"] for r in records if "perf/publish_bytes" in r]
        assert all(b < 0.1 * kinds[0] for b in kinds[1:]), kinds[:3]
    print(f"per sampler (backend, state, consumed, excess |dlp|, excess kl): {by_name}")
    evals = pass1(records)
    print(f"train reward, first 10 steps {first:.3f}, last 10 {last:.3f}; pass@1 {evals}")
    assert evals[-1] >= evals[0] - SLACK, (evals, train)
