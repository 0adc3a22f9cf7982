"""LoRA versions: adapters alone on the wire, applied by the HF backend exactly as the trainer
computes them, stored by the broker only on a full base it then keeps."""

import asyncio
import copy

import pytest
import torch
from safetensors.torch import save

from echorl.broker.weights import WeightStore
from echorl.config import LoraSettings, SamplingConfig
from echorl.models import build_tiny_model
from echorl.models.lora import (
    add_lora,
    base_state,
    load_for_training,
    save_policy,
    spec_of,
    spec_of_model,
    version_state,
)
from echorl.protocol import BadRequest
from echorl.rollout.backend import Adapters
from echorl.rollout.hf import HFBackend
from echorl.trainer.weights import stream_safetensors

CONTEXTS = [[19, 18, 12, 24, 18, 30], [24, 26, 12, 20, 19, 30]]
GREEDY = SamplingConfig(temperature=0.0)


def perturb(model, seed: int, scale: float = 0.05) -> None:
    """Train-like noise on the adapters (B starts at 0: the adapter is then a no-op)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(scale * torch.randn(p.shape, generator=gen))


def test_an_adapter_version_moves_under_5_percent_of_a_full_one_on_the_10m_preset():
    model, _ = build_tiny_model("10m")
    full = stream_safetensors(model.state_dict())[1]
    lora = add_lora(model, spec_of(LoraSettings(rank=8)))
    adapter = stream_safetensors(*version_state(lora, base=0))[1]
    assert adapter / full < 0.05, f"{adapter} of {full} bytes"
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert trainable * 4 < adapter < trainable * 4 + 65536  # the adapters and a header, no more


def test_version_0_of_a_lora_run_is_the_plain_model_and_adapters_start_as_no_ops():
    model, _ = build_tiny_model("1m")
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    lora = add_lora(model, spec_of(LoraSettings(rank=4, targets=["q_proj", "v_proj"])))
    state = base_state(lora)
    assert state.keys() == plain.keys()
    assert all(torch.equal(state[k], plain[k]) for k in plain)
    tensors, meta = version_state(lora, base=0)
    assert meta["echorl.kind"] == "lora" and meta["echorl.base"] == "0"
    assert all(".lora_A." in k or ".lora_B." in k for k in tensors)
    assert spec_of_model(lora).targets == ["q_proj", "v_proj"]


def test_a_target_the_model_lacks_is_named():
    model, _ = build_tiny_model("1m")
    with pytest.raises(ValueError, match="model.lora.targets"):
        add_lora(model, spec_of(LoraSettings(rank=4, targets=["wq"])))


def same(ours, theirs, tol=1e-5) -> bool:
    """The same tokens, and log-probs within `tol` (peft's adapter-off path may sum in
    another order than the plain model: a few 1e-7 apart)."""
    return len(ours) == len(theirs) and all(
        a.token_ids == b.token_ids and max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < tol
        for a, b in zip(ours, theirs)
    )


def test_the_hf_backend_applies_adapters_as_the_trainer_computes_them():
    model, tok = build_tiny_model("1m")
    sampler = HFBackend(copy.deepcopy(model), tok, keep_adapters=2)
    base = sampler.generate_ids(CONTEXTS, GREEDY, 8, 0)
    trainer_model = add_lora(model, spec_of(LoraSettings(rank=8)))
    trainer = HFBackend(trainer_model, tok)
    spec = spec_of_model(trainer_model)
    outputs = {}
    for version in (1, 2, 3):
        perturb(trainer_model, version)
        sampler.load_adapter(version, version_state(trainer_model)[0], spec)
        ours, theirs = (
            trainer.generate_ids(CONTEXTS, GREEDY, 8, 0),
            sampler.generate_ids(CONTEXTS, GREEDY, 8, 0),
        )
        assert same(ours, theirs)
        outputs[version] = [c.logprobs for c in theirs]
    assert outputs[1] != outputs[3]
    assert sampler.adapters == [2, 3]  # keep_adapters = 2: v1 was dropped
    sampler.use_adapter(2)  # resident: no download, the same function as before
    assert [c.logprobs for c in sampler.generate_ids(CONTEXTS, GREEDY, 8, 0)] == outputs[2]
    sampler.use_adapter(None)  # the full weights alone
    assert same(sampler.generate_ids(CONTEXTS, GREEDY, 8, 0), base)
    with pytest.raises(KeyError, match="not resident"):
        sampler.use_adapter(1)
    sampler.load_weights(base_state(trainer_model))  # a new full version drops the adapters
    assert sampler.adapters == [] and same(sampler.generate_ids(CONTEXTS, GREEDY, 8, 0), base)


def test_adapters_keep_the_newest_and_replace_a_version_published_again():
    slots = Adapters(keep=2)
    assert slots.add(1, "a") == [] and slots.add(2, "b") == []
    assert slots.add(3, "c") == ["a"] and list(slots.held) == [2, 3]
    assert slots.add(3, "c2") == ["c"] and slots.handle == "c2"
    assert slots.use(2) == "b" and slots.use(None) is None
    assert slots.clear() == ["b", "c2"] and slots.held == {}


def test_a_lora_checkpoint_resumes_the_adapters_and_the_merged_policy_loads_alone(tmp_path):
    from echorl.models import load_policy, save_tiny_model

    folder = save_tiny_model(tmp_path / "base", "1m")
    settings = LoraSettings(rank=4)
    model, tok = load_for_training(folder, None, settings)
    perturb(model, 0)
    model.save_pretrained(tmp_path / "ckpt")  # what a checkpoint holds: the adapters
    again, _ = load_for_training(folder, tmp_path / "ckpt", settings)
    assert [n for n, p in again.named_parameters() if p.requires_grad]
    ids = torch.tensor([CONTEXTS[0]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, again(ids).logits, atol=1e-6)
        save_policy(model, tok, tmp_path / "policy")
        merged, _ = load_policy(tmp_path / "policy")
        assert torch.allclose(model(ids).logits, merged(ids).logits, atol=1e-4)
    assert (tmp_path / "policy" / "adapter" / "adapter_config.json").is_file()


def upload(store: WeightStore, version: int, tensors: dict, meta: dict) -> None:
    import hashlib

    blob = save(tensors, metadata=meta)

    async def chunks():
        yield blob

    asyncio.run(store.receive(version, hashlib.sha256(blob).hexdigest(), chunks()))


def test_the_broker_stores_an_adapter_only_on_a_full_base_and_keeps_that_base(tmp_path):
    model, _ = build_tiny_model("1m")
    lora = add_lora(model, spec_of(LoraSettings(rank=4)))
    adapter, meta = version_state(lora, base=0)
    store = WeightStore(tmp_path, keep=2)
    with pytest.raises(BadRequest, match="base v0 is not a stored full version"):
        upload(store, 1, adapter, meta)
    assert store.versions() == []  # refused: nothing stored
    upload(store, 0, base_state(lora), {"format": "pt"})
    with pytest.raises(BadRequest, match="echorl.lora"):
        upload(store, 1, adapter, meta | {"echorl.lora": '{"rank": 0}'})
    for v in range(1, 6):
        upload(store, v, adapter, meta)
        store.retain(v, referenced=set())
    assert store.versions() == [0, 4, 5]  # v0 stays: the kept adapters apply on it
    info = store.describe(5)
    assert (info.kind, info.base, info.lora.rank) == ("lora", 0, 4)
    assert store.describe(0).kind == "full" and store.describe(0).base is None
    assert info.size_bytes < store.describe(0).size_bytes / 5
