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


def test_stale_groups_are_scored_under_their_own_version_in_recycled_buffers(tiny):
    import torch

    from echorl.protocol import Completion
    from echorl.trainer.audit import PastVersions
    from echorl.trainer.batch import batch_from_groups, token_logprobs

    model, tok = tiny
    c = Completion(token_ids=[20, 21, 1], logprobs=[-0.5] * 3, finished=True)
    groups = [
        ScoredGroup(job_id=v, version=v, prompt_ids=[5, 6, 7], completions=[c, c], rewards=[1, 0])
        for v in (0, 1, 2)
    ]
    batch = batch_from_groups(groups, torch.zeros(3, 2), tok.pad_token_id)
    past, states, expected = PastVersions(keep=2), [], []
    for v in range(4):  # versions 0..3, each a step away from the last
        if v:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
        past.record(model, v)
        states.append({k: t.clone() for k, t in model.state_dict().items()})
        expected.append(token_logprobs(model, batch)[0])
        if v == 1:
            v0_buffers = {id(t) for t in past.held[0].values()}
    assert sorted(past.held) == [1, 2, 3]  # v0 fell out of the window ...
    assert {id(t) for t in past.held[3].values()} == v0_buffers  # ... and v3 lives in its buffers
    groups[0] = groups[0].model_copy(update={"version": 3})  # v3 is the policy: its pass stands
    logp = past.logprobs(model, groups, batch, expected[3], 1.0)
    torch.testing.assert_close(logp[0:2], expected[3][0:2])
    torch.testing.assert_close(logp[2:4], expected[1][2:4])  # exactly as that version scored it
    torch.testing.assert_close(logp[4:6], expected[2][4:6])
    assert all(torch.equal(states[3][k], t) for k, t in model.state_dict().items())  # put back


def test_the_audit_sends_the_trainers_logprob_of_each_token_of_the_first_group():
    """The first group's audit carries the policy's log-prob of each completion token, as a
    plain forward pass gives it (prompts and completions of different lengths, padded)."""
    import torch

    from echorl.models.tiny import build_tiny_model
    from echorl.trainer.audit import audit_batch
    from echorl.trainer.batch import batch_from_groups, token_logprobs

    model, tok = build_tiny_model("1m", seed=0)

    def scored(job_id, prompt, completions):
        return ScoredGroup.model_validate(
            {
                "job_id": job_id,
                "version": 0,
                "prompt_ids": prompt,
                "completions": [
                    {"token_ids": c, "logprobs": [-1.0] * len(c), "finished": True}
                    for c in completions
                ],
                "rewards": [0.0] * len(completions),
            }
        )

    groups = [scored(7, [5, 6, 7], [[40, 41], [42, 43, 44, 45]]), scored(8, [9], [[50], [51]])]
    batch = batch_from_groups(groups, torch.zeros(2, 2), pad_id=0)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    audits = audit_batch(groups, batch, logp)
    assert audits[1].logprobs is None  # one group a step
    for c, got in zip(groups[0].completions, audits[0].logprobs):
        ids = torch.tensor([groups[0].prompt_ids + c.token_ids])
        with torch.no_grad():
            full = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        p = len(groups[0].prompt_ids)
        want = [full[p + k - 1, t].item() for k, t in enumerate(c.token_ids)]
        assert got == pytest.approx(want, abs=2e-4)
