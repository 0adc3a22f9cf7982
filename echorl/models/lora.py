"""LoRA adapters (peft) as policy versions.

With `model.lora.rank > 0` the trainer wraps its policy (`add_lora`) and trains the
adapters alone. Version 0 is the full starting weights; every later version is the
adapter alone, a few per cent of the bytes, with its shape in the file's metadata:

    echorl.kind = "lora"    echorl.base = "0"    echorl.lora = {"rank": 8, "alpha": 16, ...}

A sampler applies it on the base it holds (peft in place for HF, a LoRA request for
vLLM). Adapter tensors carry peft's names (`base_model.model.<module>.lora_A.weight`),
which is what peft's `set_peft_model_state_dict` and vLLM's adapter loader both read.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import PreTrainedModel

from echorl.config import LoraSettings
from echorl.models.loading import load_policy
from echorl.protocol import LoraSpec

# peft asks transformers a deprecated question on every wrap; the answer is the same.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
KIND, BASE, SHAPE = "echorl.kind", "echorl.base", "echorl.lora"


def spec_of(settings: LoraSettings) -> LoraSpec | None:
    """The run's adapter shape; None when LoRA is off."""
    if not settings.rank:
        return None
    return LoraSpec(rank=settings.rank, alpha=settings.alpha, targets=settings.targets)


def peft_config(spec: LoraSpec) -> LoraConfig:
    return LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )


def add_lora(model: PreTrainedModel, spec: LoraSpec) -> PeftModel:
    """`model` with fresh adapters (B = 0: the same function as before); only they train."""
    try:
        return get_peft_model(model, peft_config(spec))
    except ValueError as e:  # e.g. a target module the model does not have
        raise ValueError(f"model.lora.targets {spec.targets}: {e}") from None


def load_for_training(
    model_dir: str | Path, checkpoint: Path | None, settings: LoraSettings, device: str = "cpu"
):
    """(model, tokenizer) to train: `model_dir`'s policy, or the checkpoint's; with LoRA on,
    the base from `model_dir` and the adapters fresh or from the checkpoint."""
    spec = spec_of(settings)
    if spec is None:
        return load_policy(checkpoint or model_dir, device)
    model, tokenizer = load_policy(model_dir, device)
    if checkpoint is None:
        return add_lora(model, spec), tokenizer
    return PeftModel.from_pretrained(model, checkpoint, is_trainable=True), tokenizer


def is_lora(model) -> bool:
    return isinstance(model, PeftModel)


def version_state(model, base: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What a new version publishes: (tensors, safetensors metadata). The full state dict of a
    plain model; the adapter alone of a LoRA model, as a version on full version `base`."""
    if not is_lora(model):
        return model.state_dict(), {"format": "pt"}
    spec = spec_of_model(model)
    meta = {"format": "pt", KIND: "lora", BASE: str(base), SHAPE: spec.model_dump_json()}
    return get_peft_model_state_dict(model), meta


def spec_of_model(model: PeftModel) -> LoraSpec:
    c = model.peft_config["default"]
    return LoraSpec(rank=c.r, alpha=c.lora_alpha, targets=sorted(c.target_modules))


def base_state(model) -> dict[str, torch.Tensor]:
    """The weights under the adapters, named as in the plain model (version 0 of a LoRA run)."""
    if not is_lora(model):
        return model.state_dict()
    inner = model.get_base_model().state_dict()
    return {k.replace(".base_layer.", "."): t for k, t in inner.items() if ".lora_" not in k}


def write_adapter(folder: Path, state: dict[str, torch.Tensor], spec: LoraSpec) -> Path:
    """A peft adapter folder (adapter_config.json + adapter_model.safetensors), as vLLM and
    `PeftModel.from_pretrained` read it."""
    folder.mkdir(parents=True, exist_ok=True)
    config = peft_config(spec).to_dict()
    config["target_modules"] = sorted(spec.targets)  # a set in peft's dict: not JSON
    (folder / "adapter_config.json").write_text(json.dumps(config, default=str))
    save_file({k: t.contiguous() for k, t in state.items()}, folder / "adapter_model.safetensors")
    return folder


def save_policy(model, tokenizer, folder: Path) -> Path:
    """The trained policy as a plain HF folder anyone can load; a LoRA run's adapters are
    merged into it, and also kept alone in `folder/adapter`."""
    if is_lora(model):
        model.save_pretrained(folder / "adapter")
        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
