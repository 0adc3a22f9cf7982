import torch

from echorl.config import SamplingConfig
from echorl.sampler.backends.hf import HFBackend
from echorl.trainer.batch import Sequence, collate, token_logprobs

PROMPTS = ["12+34=", "5+5=", "rev:abcdefg=", "3 5 7>22:"]


def sample(tiny, params, n=4, seed=3, max_new=12):
    model, tok = tiny
    return HFBackend(model, tok).generate(PROMPTS, n, params, max_new, seed)


def trainer_logprobs(tiny, groups, temperature=1.0):
    model, tok = tiny
    seqs = [
        Sequence(tok(p, add_special_tokens=False)["input_ids"], c.token_ids, c.logprobs, 0.0)
        for p, group in zip(PROMPTS, groups)
        for c in group
    ]
    batch = collate(seqs, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature)
    return batch, logp


def test_behaviour_logprobs_match_the_trainer_at_temperature_one(tiny):
    groups = sample(tiny, SamplingConfig(temperature=1.0))
    assert [len(g) for g in groups] == [4, 4, 4, 4]
    batch, logp = trainer_logprobs(tiny, groups)
    mask = batch.loss_mask.bool()
    assert mask.sum() > 100
    assert torch.allclose(logp[mask], batch.behaviour_logp[mask], atol=1e-4)


def test_behaviour_logprobs_at_other_temperatures_match_scaled_logits(tiny):
    groups = sample(tiny, SamplingConfig(temperature=0.7))
    batch, logp = trainer_logprobs(tiny, groups, temperature=0.7)
    mask = batch.loss_mask.bool()
    assert torch.allclose(logp[mask], batch.behaviour_logp[mask], atol=1e-4)


def test_top_p_renormalises_the_sampling_distribution(tiny):
    # Under top-p the kept tokens have more mass than under the full softmax.
    groups = sample(tiny, SamplingConfig(temperature=1.0, top_p=0.5))
    batch, logp = trainer_logprobs(tiny, groups)
    mask = batch.loss_mask.bool()
    assert (batch.behaviour_logp[mask] > logp[mask] + 1e-3).all()
    assert (batch.behaviour_logp[mask] <= 0).all()


def test_same_seed_same_tokens_other_seed_other_tokens(tiny):
    a = sample(tiny, SamplingConfig(), seed=1)
    b = sample(tiny, SamplingConfig(), seed=1)
    c = sample(tiny, SamplingConfig(), seed=2)
    ids = lambda gs: [c.token_ids for g in gs for c in g]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)


def test_greedy_is_deterministic_and_stops_at_eos(tiny):
    _, tok = tiny
    groups = sample(tiny, SamplingConfig(temperature=0.0), n=2, max_new=5)
    for g in groups:
        assert g[0].token_ids == g[1].token_ids
        c = g[0]
        assert len(c.token_ids) <= 5
        assert c.finished == (c.token_ids[-1] == tok.eos_token_id)
        assert tok.eos_token_id not in c.token_ids[:-1]
        assert len(c.logprobs) == len(c.token_ids)


def test_real_rollouts_satisfy_the_wire_protocol(tiny):
    from echorl.config import SamplingConfig
    from echorl.sampler.rollout import rollout, to_wire
    from echorl.tasks import get_task, take

    model, tok = tiny
    task = get_task("countdown")
    groups = rollout(
        HFBackend(model, tok), task, take(task, 3, seed=0), 4, SamplingConfig(), seed=0
    )
    for job_id, g in enumerate(groups):
        wire = to_wire(g, job_id)
        wire.check_against(vocab_size=len(tok), group_size=4, latest_version=0)
        assert wire.claimed_rewards == g.rewards
        assert wire.tokens == sum(len(c.token_ids) for c in g.completions)


def test_proximal_policy_or_behaviour_as_the_old_policy(tiny):
    """Decoupled PPO (proximal) vs clipping to the sampler's log-probs, on a sampler whose
    log-probs are 0.5 nats below the trainer's on every token."""
    from echorl.config import RunConfig
    from echorl.trainer.update import build_optimizer, build_scheduler, train_on_batch

    model, _ = tiny
    groups = sample(tiny, SamplingConfig(temperature=1.0))
    batch, logp = trainer_logprobs(tiny, groups)
    batch.behaviour_logp = (logp - 0.5) * batch.loss_mask
    batch.advantages = torch.tensor([1.0, -1.0] * (len(batch) // 2))
    metrics = {}
    for proximal in (True, False):
        cfg = RunConfig.model_validate({"loss": {"proximal": proximal, "is_cap": 2.0}})
        m = model.__class__(model.config)
        m.load_state_dict(model.state_dict())
        opt = build_optimizer(m, cfg.optim)
        metrics[proximal] = train_on_batch(m, opt, build_scheduler(opt, cfg.optim), batch, cfg)
    on, off = metrics[True], metrics[False]
    # Proximal: ratio 1 at the first step (no clipping), IS weight min(e^0.5, 2) = 1.6487.
    assert on["loss/clip_frac"] == 0.0
    assert abs(on["loss/is_weight_mean"] - 1.6487) < 1e-3
    assert abs(on["rollout/kl_behaviour_old"] + 0.5) < 1e-4
    # Behaviour as the old policy: ratio e^0.5 = 1.65 > 1.28, clipped wherever A > 0; weight 1.
    assert abs(off["loss/is_weight_mean"] - 1.0) < 1e-6
    assert abs(off["loss/clip_frac"] - 0.5) < 0.1
    assert "rollout/kl_behaviour_old" not in off
