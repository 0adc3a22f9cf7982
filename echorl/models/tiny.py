"""The built-in tiny model: a randomly initialised Qwen2-architecture causal LM.

Presets are sized for CPUs: `1m` trains a task in minutes on two cores, `10m`
and `50m` are for benchmarks and bigger machines. The model is an ordinary
Hugging Face model; `save_tiny_model` writes a folder that `load_policy` (and
any transformers user) reads like a downloaded checkpoint.

    python -c "from echorl.models import save_tiny_model; save_tiny_model('runs/tiny', '1m')"
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from echorl.models.loading import suppress
from echorl.models.tokenizer import build_byte_tokenizer

# name -> (hidden, layers, heads, kv heads, mlp width); parameter counts in docs/benchmarks.md.
PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "1m": (128, 4, 4, 2, 384),
    "10m": (320, 8, 8, 4, 960),
    "50m": (576, 13, 9, 3, 1728),
}
MAX_POSITIONS = 512


def small_config(
    arch: str,
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    mlp: int,
    **extra,
) -> PretrainedConfig:
    """A small causal-LM config of `arch` (qwen2, qwen3, llama): untied embeddings,
    `MAX_POSITIONS` positions, float32, no bos; `extra` fields on top."""
    from transformers import LlamaConfig, Qwen3Config

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        bos_token_id=None,
        dtype="float32",
    )
    if arch == "qwen2":  # derives head_dim from the hidden size
        return Qwen2Config(**kwargs, **extra)
    if arch in ("qwen3", "llama"):  # Qwen3's head_dim defaults to 128 whatever the width
        config_class = Qwen3Config if arch == "qwen3" else LlamaConfig
        return config_class(head_dim=hidden // heads, **kwargs, **extra)
    raise ValueError(f"unknown architecture {arch!r}; choose qwen3, llama or qwen2")


def tiny_config(preset: str, vocab_size: int) -> Qwen2Config:
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny-model preset {preset!r}; choose one of {sorted(PRESETS)}")
    return small_config(
        "qwen2", vocab_size, *PRESETS[preset], rope_theta=10000.0, pad_token_id=0, eos_token_id=1
    )


def build_tiny_model(
    preset: str = "1m", seed: int = 0
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Return a freshly initialised tiny model (eval mode, float32) and its byte tokenizer."""
    tokenizer = build_byte_tokenizer()
    config = tiny_config(preset, vocab_size=len(tokenizer))
    # Seed a private generator so building a model never disturbs the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return suppress(model, tokenizer).eval(), tokenizer


def save_tiny_model(path: str | Path, preset: str = "1m", seed: int = 0) -> Path:
    """Build a tiny model and save it (weights as safetensors, config, tokenizer) to `path`."""
    path = Path(path)
    model, tokenizer = build_tiny_model(preset, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
