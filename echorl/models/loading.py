"""Loading a policy (causal LM + tokenizer) from a local Hugging Face folder.

Works the same for the built-in tiny model and a user's Qwen2.5/Qwen3 (or any
causal-LM) checkpoint. Never downloads: the hub is switched off before loading.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from echorl.models.tokenizer import never_emitted

log = logging.getLogger(__name__)
ROUND_TRIP_PROBE = "a b  c\n12 + 34 = 46"
SUPPRESSED = -1e4  # the logit of a token never emitted: exp underflows to 0 in every dtype


def suppress(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """Make the model's logits of the tokenizer's special tokens other than eos
    (`tokenizer.never_emitted`) SUPPRESSED, on every forward pass: generation never emits
    one, and every log-prob (the trainer's loss and audit, the reference, an auditor) is
    of the distribution samplers draw from. A hook on the output layer, so wrappers (DDP,
    FSDP2, peft) keep it; vLLM and OpenAI-compatible servers get the same as a logit bias."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    head = model.get_output_embeddings()
    if backend is None or head is None or getattr(model, "_echorl_suppressed", None) is not None:
        return model
    ids = [i for i in never_emitted(backend, tokenizer.eos_token_id) if i < head.out_features]
    model._echorl_suppressed = ids
    if ids:
        head.register_forward_hook(_Suppress(ids))
    return model


class _Suppress:
    """The output layer's forward hook (a class, not a closure: a model stays picklable)."""

    def __init__(self, ids: list[int]):
        self.index = torch.tensor(ids)

    def __call__(self, _module, _inputs, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill(-1, self.index.to(logits.device), SUPPRESSED)


class NotAModelFolder(FileNotFoundError):
    """A model path that is not a local Hugging Face folder."""


def _check_dir(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise NotAModelFolder(
            f"{path} is not a model folder (no config.json); echorl never downloads"
        )
    return path


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the folder's tokenizer exactly as its `tokenizer.json` says.

    `tokenizer.json` is loaded as is with `PreTrainedTokenizerFast` (special tokens and
    the chat template from `tokenizer_config.json`), which is also what the broker reads
    with the `tokenizers` library, so every role gets the same ids. (`AutoTokenizer`
    picks a class from the model type instead: on a Qwen2 folder holding a
    character-level `tokenizer.json` it builds Qwen2's byte-level tokenizer, which
    silently drops spaces.) A folder without `tokenizer.json` falls back on
    `AutoTokenizer`; the broker refuses to start on such a folder (it reads tokenizer.json),
    while the co-located loop can use a fast tokenizer loaded that way.
    """
    path = _check_dir(path)
    if (path / "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tokenizer(ROUND_TRIP_PROBE, add_special_tokens=False)["input_ids"]
    if tokenizer.decode(ids) != ROUND_TRIP_PROBE:
        log.warning("%s: the tokenizer does not round-trip %r", path, ROUND_TRIP_PROBE)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # generation pads on the left
    return tokenizer


def adapter_base(path: str | Path) -> Path | None:
    """The base model folder of a LoRA adapter folder (a LoRA run's checkpoint policy), or
    None where `path` is not an adapter folder."""
    config = Path(path) / "adapter_config.json"
    if (Path(path) / "config.json").is_file() or not config.is_file():
        return None
    return Path(json.loads(config.read_text())["base_model_name_or_path"])


def load_policy(
    path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `(model, tokenizer)` from a local folder; the model is in eval mode on `device`.
    A LoRA adapter folder is applied to its base (a local folder) and merged."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if (base := adapter_base(path)) is not None:
        from peft import PeftModel

        model, tokenizer = load_policy(base, "cpu", dtype)
        merged = PeftModel.from_pretrained(model, str(path)).merge_and_unload()
        return merged.to(device).eval(), tokenizer
    path = _check_dir(path)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return suppress(model, tokenizer).to(device).eval(), tokenizer
