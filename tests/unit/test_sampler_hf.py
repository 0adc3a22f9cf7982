import torch

from echorl.config import SamplingConfig
from echorl.rollout.hf import HFBackend
from echorl.trainer.batch import Row, collate, token_logprobs

PROMPTS = ["12+34=", "5+5=", "rev:abcdefg=", "3 5 7>22:"]


def prompt_ids(tiny, params=SamplingConfig()):
    model, tok = tiny
    return HFBackend(model, tok).codec.encode_prompts(PROMPTS, params)


def sample(tiny, params, n=4, seed=3, max_new=12):
    """`n` completions of each prompt, as one list per prompt."""
    model, tok = tiny
    backend = HFBackend(model, tok)
    contexts = [ids for ids in backend.codec.encode_prompts(PROMPTS, params) for _ in range(n)]
    flat = backend.generate_ids(contexts, params, max_new, seed)
    assert len(flat) == len(PROMPTS) * n
    return [flat[i * n : (i + 1) * n] for i in range(len(PROMPTS))]


def trainer_logprobs(tiny, groups, temperature=1.0):
    model, tok = tiny
    rows = [
        Row(ids, c.token_ids, c.logprobs, c.mask, 0.0)
        for ids, group in zip(prompt_ids(tiny), groups)
        for c in group
    ]
    batch = collate(rows, tok.pad_token_id)
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
    from echorl.protocol import JobState, ScoredGroup
    from echorl.rollout.generate import rollout
    from echorl.rollout.scoring import score_group
    from echorl.tasks import get_task, take

    model, tok = tiny
    backend = HFBackend(model, tok)
    task = get_task("countdown")
    problems = take(task, 3, seed=0)
    params = SamplingConfig()
    ids = backend.codec.encode_prompts([p.prompt for p in problems], params)
    groups = rollout(backend, task, problems, ids, 4, params, seed=0, job_ids=[7, 8, 9])
    assert [g.job_id for g in groups] == [7, 8, 9]
    for g, problem, prompt in zip(groups, problems, ids):
        # The group is what a sampler pushes: it survives the wire's validation unchanged.
        wire = ScoredGroup.model_validate_json(g.model_dump_json())
        assert wire == g
        assert wire.prompt_ids == prompt and wire.version == 0
        wire.check_against(
            JobState(group_size=4, prompt_ids=prompt),
            vocab_size=backend.codec.vocab_size,
            latest_version=0,
        )
        # Its rewards are the sampler's claims: what the broker's scoring gives the same tokens.
        assert wire.rewards == score_group(task, problem, wire.completions, backend.codec)
        assert wire.tokens == sum(len(c.token_ids) for c in g.completions)


def test_proximal_policy_or_behaviour_as_the_old_policy(tiny):
    """Decoupled PPO (proximal) vs clipping to the sampler's log-probs, on a sampler whose
    log-probs are 0.5 nats below the trainer's on every token."""
    from echorl.config import RunConfig
    from echorl.models.loading import suppress
    from echorl.trainer.update import build_optimizer, build_scheduler, train_on_batch

    model, tok = tiny
    groups = sample(tiny, SamplingConfig(temperature=1.0))
    batch, logp = trainer_logprobs(tiny, groups)
    batch.behaviour_logp = (logp - 0.5) * batch.loss_mask
    batch.advantages = torch.tensor([1.0, -1.0] * (len(batch) // 2))
    metrics = {}
    for proximal in (True, False):
        cfg = RunConfig.model_validate({"loss": {"proximal": proximal, "is_cap": 2.0}})
        m = suppress(model.__class__(model.config), tok)  # as every role's model is
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


def test_a_special_token_other_than_eos_is_never_emitted_and_never_counted(tiny):
    """The decode drops special tokens, so a completion holding a pad would be scored on
    other text than the loss trains on (and the broker refuses it). The model's output
    layer suppresses them (`models.loading.suppress`): with pad's logit raised by 50, an
    unsuppressed model emits almost nothing but pad; this one never does, and the trainer's
    log-probs, of the same suppressed distribution, equal the sampler's."""
    model, tok = tiny
    assert model._echorl_suppressed == [tok.pad_token_id] != [tok.eos_token_id]
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    head.bias.data[tok.pad_token_id] = 50.0
    groups = sample(tiny, SamplingConfig(temperature=1.0))
    ids = [t for g in groups for c in g for t in c.token_ids]
    assert len(ids) > 100 and tok.pad_token_id not in ids
    batch, logp = trainer_logprobs(tiny, groups)
    mask = batch.loss_mask.bool()
    assert torch.allclose(logp[mask], batch.behaviour_logp[mask], atol=1e-4)
    hooks = dict(head._forward_hooks)
    head._forward_hooks.clear()  # unsuppressed: the pad it was kept from
    try:
        loud = [
            t for g in sample(tiny, SamplingConfig(temperature=1.0)) for c in g for t in c.token_ids
        ]
    finally:
        head._forward_hooks.update(hooks)
    assert loud.count(tok.pad_token_id) > 0.9 * len(loud)
