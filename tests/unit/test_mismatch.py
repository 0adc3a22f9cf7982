"""The per-sampler log-prob mismatch the trainer logs each step, from its audit of the batch."""

import pytest

from echorl.protocol import GroupAudit, ScoredGroup
from echorl.trainer.decoupled import mismatch_by_sampler


def group(job_id, sampler):
    return ScoredGroup.model_construct(job_id=job_id, sampler=sampler)


def test_mismatch_is_summed_per_sampler_over_its_tokens():
    groups = [group(1, "a"), group(2, "a"), group(3, "b")]
    audits = [
        GroupAudit(job_id=1, tokens=10, abs_delta=1.0, kl=0.5, beyond=0),
        GroupAudit(job_id=2, tokens=30, abs_delta=1.0, kl=-0.1, beyond=0),
        GroupAudit(job_id=3, tokens=4, abs_delta=8.0, kl=8.0, beyond=2),
    ]
    out = mismatch_by_sampler(groups, audits)
    assert out["mismatch/a/mean_abs"] == pytest.approx(2.0 / 40)
    assert out["mismatch/a/kl"] == pytest.approx(0.4 / 40)
    assert out["mismatch/b/mean_abs"] == pytest.approx(2.0)
    assert set(out) == {f"mismatch/{s}/{k}" for s in "ab" for k in ("mean_abs", "kl")}


def test_no_audit_no_figures():
    assert mismatch_by_sampler([group(1, "a")], []) == {}
