"""`echorl export`: a run's trained policy as a standard Hugging Face folder.

The source is a run's folder or one of its checkpoints (the `policy` inside), a policy
folder, or a LoRA adapter folder (a LoRA run's checkpoint: applied to its base and, with
`merge_lora`, merged; else written as a PEFT adapter folder). The folder written holds the
weights as safetensors, the tokenizer with its chat template, and a generation config with
the run's eos and, as `suppress_tokens`, the special tokens echorl never lets it emit
(`RunTokenizer.never_emitted`), so `transformers` generates as the run's samplers did.
"""

from __future__ import annotations

from pathlib import Path

import torch

from echorl.models.loading import NotAModelFolder, adapter_base, load_policy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def policy_folder(src: str | Path) -> Path:
    """The model or adapter folder that `src` (a run, a checkpoint or the folder itself) is."""
    src = Path(src)
    for folder in (src, src / "policy"):
        if (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file():
            return folder
    raise NotAModelFolder(
        f"{src} holds no policy (a run's folder, a checkpoint, a model folder with "
        "config.json, or a LoRA adapter folder with adapter_config.json)"
    )


def export(src: str | Path, out: str | Path, merge_lora: bool = True, dtype: str | None = None):
    """Write `src`'s policy to `out`; returns (the folder written, what it holds in words)."""
    folder, out = policy_folder(src), Path(out)
    torch_dtype = DTYPES[dtype] if dtype else torch.float32
    base = adapter_base(folder)
    if base is not None and not merge_lora:  # the adapter, as PEFT writes it
        from peft import PeftModel

        model, tokenizer = load_policy(base, "cpu", torch_dtype)
        model = PeftModel.from_pretrained(model, str(folder))
        what = f"a LoRA adapter of {base}"
    else:
        model, tokenizer = load_policy(folder, "cpu", torch_dtype)
        what = f"the merged weights of {folder} on {base}" if base else f"the weights of {folder}"
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.generation_config.suppress_tokens = list(getattr(inner, "_echorl_suppressed", [])) or None
    model.save_pretrained(out, safe_serialization=True)  # a plain model: its generation config too
    tokenizer.save_pretrained(out)
    return out, f"{what}, {dtype or 'float32'}"
