"""The sampler's engines side by side: generation speed, weight swaps, bytes on the wire and
log-prob mismatch against the trainer, per backend and tiny-model preset.

    .venv-engines/bin/python bench/engines.py            # hf and vllm (docs/how-to/real-engines.md)
    python bench/engines.py --presets 1m              # hf alone where vLLM is not installed

For each preset (random weights: completions run to `--new-tokens`):
- tokens/s: B x G completions of `--new-tokens` tokens at temperature 1, after a warm-up;
- swap: a new full version (the trainer's state dict) loaded in place, and a LoRA adapter
  version (rank 8) applied, in seconds;
- bytes per version as the broker serves it: full fp32, full bf16, a rank-8 adapter;
- mismatch: the trainer's fp32 log-probs of the sampled tokens against the backend's
  behaviour log-probs (mean |delta| and mean sampler - trainer, an estimate of KL), for the
  backend in fp32 and in bf16.

Writes bench/results/engines.json and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from echorl.config import LoraSettings, SamplingConfig
from echorl.models import load_policy, save_tiny_model
from echorl.models.lora import add_lora, spec_of, version_state
from echorl.rollout.hf import HFBackend
from echorl.trainer.batch import Row, collate, token_logprobs
from echorl.trainer.weights import stream_safetensors

OUT = Path(__file__).resolve().parent / "results"
console = Console(width=150)
PROMPT = [19, 18, 12, 24, 18, 30]  # "21+38=" in the byte tokenizer


def nbytes(state: dict, meta: dict | None = None) -> int:
    return stream_safetensors(state, meta)[1]


def mismatch(trainer, completions, contexts) -> tuple[float, float]:
    """Mean |sampler - trainer| and mean (sampler - trainer) over the sampled tokens."""
    rows = [
        Row(ctx, c.token_ids, c.logprobs, [1] * len(c.token_ids), 0.0)
        for ctx, c in zip(contexts, completions)
        if c.token_ids
    ]
    batch = collate(rows, 0)
    with torch.no_grad():
        logp = token_logprobs(trainer, batch)[0]
    mask = batch.loss_mask.bool()
    delta = (batch.behaviour_logp - logp)[mask]
    return delta.abs().mean().item(), delta.mean().item()


def make_backend(kind: str, folder: Path, dtype: str, lora: bool, device: str = "cpu"):
    if kind == "hf":
        model, tok = load_policy(folder, device, dtype=getattr(torch, dtype))
        return HFBackend(model, tok)
    from echorl.models.tokenizer import RunTokenizer
    from echorl.rollout.vllm_backend import VLLMBackend

    spec = spec_of(LoraSettings(rank=8)) if lora else None
    return VLLMBackend(folder, RunTokenizer.from_folder(folder), dtype, lora=spec)


def bench(kind: str, preset: str, folder: Path, args) -> list[dict]:
    trainer, _ = load_policy(folder)
    contexts = [PROMPT] * (args.batch * args.group)
    params = SamplingConfig(temperature=1.0)
    rows = []
    for dtype in ("float32", "bfloat16"):
        t0 = time.perf_counter()
        backend = make_backend(kind, folder, dtype, lora=dtype == "float32", device=args.device)
        start_s = time.perf_counter() - t0
        backend.generate_ids(contexts[:8], params, 4, seed=0)  # warm-up
        speeds, last = [], None
        for r in range(args.repeats):
            t0 = time.perf_counter()
            last = backend.generate_ids(contexts, params, args.new_tokens, seed=r)
            dt = time.perf_counter() - t0
            speeds.append(sum(len(c.token_ids) for c in last) / dt)
        abs_d, kl = mismatch(trainer, last, contexts)
        row = {
            "backend": kind,
            "preset": preset,
            "dtype": dtype,
            "device": args.device,
            "start_s": start_s,
            "tokens_per_s": statistics.median(speeds),
            "mismatch_abs": abs_d,
            "mismatch_kl": kl,
        }
        if dtype == "float32":
            state = {k: v + 0.01 * torch.randn_like(v) for k, v in trainer.state_dict().items()}
            t0 = time.perf_counter()
            backend.load_weights(state)
            row["swap_full_s"] = time.perf_counter() - t0
            lora = add_lora(load_policy(folder)[0], spec_of(LoraSettings(rank=8)))
            adapter = version_state(lora)[0]
            t0 = time.perf_counter()
            backend.load_adapter(1, adapter, spec_of(LoraSettings(rank=8)))
            row["swap_lora_s"] = time.perf_counter() - t0
        rows.append(row)
        console.print(row)
        del backend
        gc.collect()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["1m", "10m", "50m"])
    ap.add_argument("--backends", nargs="+", default=["hf", "vllm"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="the hf backend's device (cuda on a GPU)")
    ap.add_argument("--json", type=Path, default=OUT / "engines.json", help="where results go")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    backends = list(args.backends)
    if "vllm" in backends:
        try:
            import vllm  # noqa: F401
        except ImportError:
            console.print("vLLM is not installed here: hf only (docs/how-to/real-engines.md)")
            backends.remove("vllm")
    rows, sizes = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            folder = save_tiny_model(Path(tmp) / preset, preset)
            model, _ = load_policy(folder)
            full = model.state_dict()
            sizes[preset] = {
                "full_fp32": nbytes(full),
                "full_bf16": nbytes({k: v.bfloat16() for k, v in full.items()}),
                "lora_r8": nbytes(*version_state(add_lora(model, spec_of(LoraSettings(rank=8))))),
            }
            for kind in backends:
                try:
                    rows += bench(kind, preset, folder, args)
                except Exception as e:  # e.g. vLLM's CPU attention lacks this head size
                    reason = f"{type(e).__name__}: {str(e).splitlines()[-1][:120]}"
                    console.print(f"{kind} on {preset}: {reason}")
                    rows.append({"backend": kind, "preset": preset, "error": reason})
    table = Table(
        title=f"engines: {args.batch} x {args.group} completions of {args.new_tokens} tokens, "
        f"{args.threads} threads, {args.device}"
    )
    for col in (
        "preset",
        "backend",
        "dtype",
        "tokens/s",
        "start s",
        "swap full s",
        "swap LoRA s",
        "|dlogp|",
        "KL",
    ):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["preset"], r["backend"], "-", r["error"], *[""] * 5)
            continue
        table.add_row(
            r["preset"],
            r["backend"],
            r["dtype"],
            f"{r['tokens_per_s']:.0f}",
            f"{r['start_s']:.1f}",
            f"{r['swap_full_s']:.3f}" if "swap_full_s" in r else "",
            f"{r['swap_lora_s']:.3f}" if "swap_lora_s" in r else "",
            f"{r['mismatch_abs']:.2e}",
            f"{r['mismatch_kl']:+.2e}",
        )
    console.print(table)
    sizes_table = Table(title="bytes per version on the wire")
    for col in ("preset", "full fp32", "full bf16", "LoRA r=8", "LoRA / full"):
        sizes_table.add_column(col)
    for preset, s in sizes.items():
        sizes_table.add_row(
            preset,
            f"{s['full_fp32'] / 1e6:.2f} MB",
            f"{s['full_bf16'] / 1e6:.2f} MB",
            f"{s['lora_r8'] / 1e6:.2f} MB",
            f"{s['lora_r8'] / s['full_fp32']:.1%}",
        )
    console.print(sizes_table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "torch": torch.__version__,
                "machine": platform.machine(),
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                "rows": rows,
                "bytes": sizes,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
