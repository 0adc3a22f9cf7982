import math

import pytest
import torch

from echorl.config import LossConfig
from echorl.trainer.losses import (
    LossInputs,
    cispo_loss,
    gspo_loss,
    k3_kl,
    masked_mean,
    ppo_clip_loss,
)

L = math.log


def inputs(logp, old, behaviour, adv, mask, ref=None):
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    lp = t(logp).requires_grad_(True)
    return LossInputs(lp, t(old), t(behaviour), t(adv), t(mask), None if ref is None else t(ref))


def test_ppo_clip_with_truncated_importance_weight_by_hand():
    # Token 1: ratio 0.5/0.4 = 1.25 (inside 1.28), IS weight 0.4/0.4 = 1   -> -1.25
    # Token 2: ratio 1, IS weight 0.6/0.3 = 2, capped at 1.5              -> -1.5
    # Token 3: masked out; garbage there must not leak (inf, nan).
    inp = inputs(
        [[L(0.5), L(0.6), -math.inf]],
        [[L(0.4), L(0.6), 0.0]],
        [[L(0.4), L(0.3), math.nan]],
        [1.0],
        [[1, 1, 0]],
    )
    loss, m = ppo_clip_loss(inp, LossConfig(clip_low=0.2, clip_high=0.28, is_cap=1.5))
    assert loss.item() == pytest.approx(-1.375, abs=1e-6)
    assert m["loss/is_weight_mean"] == pytest.approx(1.25, abs=1e-6)
    assert m["loss/is_clip_frac"] == pytest.approx(0.5)
    assert m["loss/clip_frac"] == 0.0
    loss.backward()
    g = inp.logp.grad[0]
    # d/dlogp of -w * r * A / n_tokens = -w * r * A / 2
    assert g[0].item() == pytest.approx(-1.25 / 2, abs=1e-6)
    assert g[1].item() == pytest.approx(-1.5 / 2, abs=1e-6)
    assert g[2].item() == 0.0


def test_clip_higher_bounds_are_asymmetric_and_pessimistic():
    cfg = LossConfig(clip_low=0.2, clip_high=0.28, is_cap=2.0)
    # A > 0, ratio 1.5 -> clipped to 1.28; no gradient through the clipped branch.
    inp = inputs([[L(0.75)]], [[L(0.5)]], [[L(0.5)]], [1.0], [[1]])
    loss, m = ppo_clip_loss(inp, cfg)
    assert loss.item() == pytest.approx(-1.28, abs=1e-6)
    assert m["loss/clip_frac"] == 1.0
    loss.backward()
    assert inp.logp.grad.item() == 0.0
    # A < 0, ratio 0.5 -> min(-0.5, -0.8) = -0.8, loss +0.8.
    loss, _ = ppo_clip_loss(inputs([[L(0.25)]], [[L(0.5)]], [[L(0.5)]], [-1.0], [[1]]), cfg)
    assert loss.item() == pytest.approx(0.8, abs=1e-6)


def test_identity_when_sampler_and_trainer_agree():
    lp = [[L(0.3), L(0.9)]]
    loss, m = ppo_clip_loss(inputs(lp, lp, lp, [2.0], [[1, 1]]), LossConfig())
    assert loss.item() == pytest.approx(-2.0, abs=1e-6)
    assert m["loss/is_weight_mean"] == pytest.approx(1.0)
    assert m["loss/approx_kl_old"] == pytest.approx(0.0, abs=1e-7)


def test_token_mean_and_sequence_mean_differ_as_defined():
    # ratio = w = 1, so the per-token loss is -A: row 1 [-2, -2], row 2 [-5].
    lp = [[L(0.5), L(0.5)], [L(0.5), 0.0]]
    base = dict(logp=lp, old=lp, behaviour=lp, adv=[2.0, 5.0], mask=[[1, 1], [1, 0]])
    tok, _ = ppo_clip_loss(inputs(**base), LossConfig(aggregation="token_mean"))
    seq, _ = ppo_clip_loss(inputs(**base), LossConfig(aggregation="seq_mean"))
    assert tok.item() == pytest.approx(-9 / 3)
    assert seq.item() == pytest.approx((-2 - 5) / 2)


def test_k3_kl_by_hand_and_in_the_loss():
    assert k3_kl(torch.tensor(L(0.5)), torch.tensor(L(0.25))).item() == pytest.approx(
        0.5 + math.log(2) - 1, abs=1e-6
    )
    assert k3_kl(torch.tensor(-1.0), torch.tensor(-1.0)).item() == 0.0
    lp = [[L(0.5)]]
    loss, m = ppo_clip_loss(
        inputs(lp, lp, lp, [0.0], [[1]], ref=[[L(0.25)]]), LossConfig(kl_coef=0.1)
    )
    assert m["loss/kl_ref"] == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1), abs=1e-6)


def test_masked_mean_skips_empty_rows():
    x = torch.tensor([[1.0, 3.0], [9.0, 9.0]])
    m = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert masked_mean(x, m, "seq_mean").item() == 2.0
    assert masked_mean(x, m, "token_mean").item() == 2.0


def test_the_kl_reference_is_the_runs_starting_policy(tiny_saved):
    """Loaded from the run's version 0, frozen; also what a resumed run gets (not its checkpoint)."""
    from echorl.config import load_config
    from echorl.models import load_policy
    from echorl.trainer.colocated import reference

    assert reference(tiny_saved, load_config(None, [])) is None  # KL off: no second model
    ref = reference(tiny_saved, load_config(None, ["loss.kl_coef=0.1"]))
    start, _ = load_policy(tiny_saved)
    assert not any(p.requires_grad for p in ref.parameters())
    assert all(
        torch.equal(a, b) for a, b in zip(ref.state_dict().values(), start.state_dict().values())
    )


def test_gspo_clips_a_sequences_ratio_by_hand():
    """Sequence A: token ratios 1.25 and 0.8, geometric mean 1 (inside the band), A = 1:
    l = -1 a token; its gradient -s*A, over 2 tokens and 2 sequences: -0.25 each. Sequence
    B: ratio 2, clipped at 1.28 (A > 0: no gradient), IS weight 2 capped at 1.5: l = -1.92.
    The loss is the mean of the sequences' means: (-1 - 1.92) / 2."""
    inp = inputs(
        [[L(0.5), L(0.4)], [L(0.5), -math.inf]],
        [[L(0.4), L(0.5)], [L(0.25), 0.0]],
        [[L(0.4), L(0.5)], [L(0.125), math.nan]],
        [1.0, 1.0],
        [[1, 1], [1, 0]],
    )
    cfg = LossConfig(type="gspo", seq_clip_low=0.2, seq_clip_high=0.28, is_cap=1.5)
    loss, m = gspo_loss(inp, cfg)
    assert loss.item() == pytest.approx(-1.46, abs=1e-6)
    assert m["loss/clip_frac"] == pytest.approx(0.5)  # one sequence of two
    assert m["loss/is_weight_mean"] == pytest.approx(1.25, abs=1e-6)
    assert m["loss/seq_ratio_mean"] == pytest.approx(1.5, abs=1e-6)
    loss.backward()
    assert inp.logp.grad.flatten().tolist() == pytest.approx([-0.25, -0.25, 0.0, 0.0], abs=1e-6)


def test_cispo_keeps_every_tokens_gradient_and_clips_its_weight_by_hand():
    """Token 1: ratio 1.25 (inside), weight 1.25. Token 2: ratio 2, weight clipped to 1.28,
    IS weight 2 capped at 1.5: PPO would give it no gradient; CISPO's is -1.5 * 1.28 * A."""
    inp = inputs(
        [[L(0.5), L(0.6), -math.inf]],
        [[L(0.4), L(0.3), 0.0]],
        [[L(0.4), L(0.15), math.nan]],
        [1.0],
        [[1, 1, 0]],
    )
    loss, m = cispo_loss(inp, LossConfig(type="cispo", clip_low=0.2, clip_high=0.28, is_cap=1.5))
    assert loss.item() == pytest.approx((-1.25 * L(0.5) - 1.92 * L(0.6)) / 2, abs=1e-6)
    assert m["loss/clip_frac"] == pytest.approx(0.5) and m["loss/is_clip_frac"] == 0.5
    loss.backward()
    assert inp.logp.grad[0].tolist() == pytest.approx([-1.25 / 2, -1.92 / 2, 0.0], abs=1e-6)
    ppo, _ = ppo_clip_loss(inp, LossConfig(clip_low=0.2, clip_high=0.28, is_cap=1.5))
    inp.logp.grad = None
    ppo.backward()
    assert inp.logp.grad[0, 1].item() == 0.0  # the token PPO's clip silences


EXAMPLE = "examples/custom_algorithm.py"


def test_your_own_loss_and_advantage_by_import_path():
    """examples/custom_algorithm.py's REINFORCE and rank advantages, by hand: what the trainer
    calls when loss.type / advantage.type name them."""
    from echorl.config import load_config
    from echorl.trainer.advantages import compute_advantages
    from echorl.trainer.losses import loss_fn

    cfg = load_config(None, [f"loss.type={EXAMPLE}:reinforce", f"advantage.type={EXAMPLE}:rank"])
    # w = exp(logp - behaviour): 0.5/0.25 = 2 (capped at 1.5), 0.3/0.3 = 1; A = 2; token mean
    # of -1.5 * 2 and -1 * 2 = -2.5. Gradient of token 1: -(1.5/2) * w * A / 2 = -1.5 d logp.
    inp = inputs([[L(0.5), L(0.3)]], [[0.0, 0.0]], [[L(0.25), L(0.3)]], [2.0], [[1, 1]])
    loss, metrics = loss_fn(cfg.loss.type)(inp, LossConfig(is_cap=1.5))
    assert loss.item() == pytest.approx(-2.5) and metrics["loss/policy"] == pytest.approx(-2.5)
    loss.backward()
    assert inp.logp.grad[0].tolist() == pytest.approx([-1.5, -1.0])
    rewards = torch.tensor([[0.0, 1.0, 1.0, 5.0], [2.0, 2.0, 2.0, 2.0]])
    adv = compute_advantages(rewards, cfg.advantage)
    assert adv.flatten().tolist() == pytest.approx([-1.0, 0.0, 0.0, 1.0] + [0.0] * 4)


def test_a_bad_loss_or_advantage_is_named(tmp_path):
    from echorl.config import AdvantageConfig, ConfigError, load_config
    from echorl.trainer.advantages import compute_advantages
    from echorl.trainer.losses import loss_fn

    with pytest.raises(ConfigError, match="unknown loss 'ppo': one of ppo_clip, gspo, cispo"):
        load_config(None, ["loss.type=ppo"])
    with pytest.raises(ConfigError, match="unknown advantage 'gae'"):
        load_config(None, ["advantage.type=gae"])
    with pytest.raises(ValueError, match="loss.type: .* has no function 'nope'"):
        loss_fn(f"{EXAMPLE}:nope")
    (tmp_path / "bad.py").write_text("def flat(rewards, cfg):\n    return rewards.mean()\n")
    with pytest.raises(ValueError, match="not a tensor shaped like the rewards"):
        compute_advantages(torch.ones(2, 4), AdvantageConfig(type=f"{tmp_path}/bad.py:flat"))
