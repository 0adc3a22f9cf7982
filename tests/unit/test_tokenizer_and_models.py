import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from echorl.models import (
    PRESETS,
    build_byte_tokenizer,
    build_tiny_model,
    load_policy,
    load_tokenizer,
)
from echorl.tasks import TASKS, take


def task_texts():
    for task in TASKS.values():
        for p in take(task, 20, seed=3) + take(task, 5, seed=3, split="eval"):
            yield p.prompt + task.demonstration(p)


def test_byte_tokenizer_round_trips_every_task_and_odd_text():
    tok = build_byte_tokenizer()
    texts = [*task_texts(), "  two  spaces\tand tab\n", "ünïcode ✓ 漢字"]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1
    assert len(tok) == 258


def test_saved_tiny_model_loads_through_auto_classes(tiny_saved):
    # The real AutoTokenizer path (it picks Qwen2's byte-level class) must give the same ids.
    auto = AutoTokenizer.from_pretrained(tiny_saved, local_files_only=True)
    ours = build_byte_tokenizer()
    for text in task_texts():
        assert (
            auto(text, add_special_tokens=False)["input_ids"]
            == ours(text, add_special_tokens=False)["input_ids"]
        )
        assert auto.decode(auto(text, add_special_tokens=False)["input_ids"]) == text
    model = AutoModelForCausalLM.from_pretrained(tiny_saved, local_files_only=True)
    fresh, _ = build_tiny_model("1m", seed=0)
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name


def test_load_tokenizer_survives_the_char_level_trap(tiny_saved, tmp_path):
    # A Qwen2 folder with a character-level tokenizer: AutoTokenizer alone drops spaces.
    chars = ["<pad>", "<eos>", *[chr(i) for i in range(32, 127)]]
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<eos>"])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>"
    ).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text((tiny_saved / "config.json").read_text())
    loaded = load_tokenizer(tmp_path)
    text = "12 + 34 = 46"
    assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text


@pytest.mark.parametrize(
    "preset,lo,hi", [("1m", 0.5e6, 1.5e6), ("10m", 7e6, 13e6), ("50m", 40e6, 60e6)]
)
def test_presets_have_their_advertised_size(preset, lo, hi):
    from echorl.models.tiny import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(preset, 258))
    n = sum(p.numel() for p in model.parameters())
    assert lo <= n <= hi, f"{preset}: {n} parameters"
    assert set(PRESETS) == {"1m", "10m", "50m"}


def test_build_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    a, _ = build_tiny_model("1m", seed=5)
    after = torch.rand(1)
    b, _ = build_tiny_model("1m", seed=5)
    c, _ = build_tiny_model("1m", seed=6)
    assert torch.equal(after, expected)
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])


def test_load_policy_refuses_a_folder_without_a_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_policy(tmp_path)


def test_load_policy_reads_generation_tokens(tiny_saved):
    model, tok = load_policy(tiny_saved)
    assert not model.training
    assert model.generation_config.eos_token_id == tok.eos_token_id == 1
    assert json.loads((tiny_saved / "config.json").read_text())["model_type"] == "qwen2"
