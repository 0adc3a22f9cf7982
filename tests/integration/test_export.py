"""`echorl export`: a run's checkpoint (full weights, or a LoRA run's adapter) as a standard
Hugging Face folder that plain `transformers` loads and generates from as the run did."""

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from echorl.config import SamplingConfig
from echorl.models.loading import load_policy
from echorl.rollout.hf import HFBackend

pytestmark = pytest.mark.integration

PROMPTS = ["12+34=", "5+5=", "71+8="]


def echorl(*args):
    proc = subprocess.run(
        [sys.executable, "-m", "echorl.cli", *args], capture_output=True, text=True, timeout=600
    )
    return proc


def trained(tmp_path, warm_add, *overrides) -> str:
    """A co-located run of 2 steps on `add` from the warm model, checkpointed at each."""
    out = tmp_path / "run"
    args = ["train", "--colocated", "--task", "add", "--model", str(warm_add), "--out", str(out)]
    for o in (
        "train.batch_prompts=4",
        "train.group_size=4",
        "train.eval_prompts=4",
        "train.steps=2",
    ):
        args += ["-o", o]
    for o in ("train.checkpoint_every=1", "optim.lr=1e-3", *overrides):
        args += ["-o", o]
    proc = echorl(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_an_exported_checkpoint_loads_in_transformers_and_generates_as_the_policy(
    tmp_path, warm_add
):
    out = trained(tmp_path, warm_add)
    ckpt = out / "checkpoints" / "step_0000002"
    dest = tmp_path / "exported"
    shown = echorl("export", str(ckpt), str(dest), "--dtype", "fp32")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert f"wrote {dest}" in shown.stdout and "from_pretrained" in shown.stdout
    assert (dest / "model.safetensors").is_file() and (dest / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(dest)  # plain transformers, nothing of echorl
    tokenizer = PreTrainedTokenizerFast.from_pretrained(dest)
    assert model.generation_config.suppress_tokens == [tokenizer.pad_token_id]
    policy = HFBackend(*load_policy(ckpt / "policy"))
    greedy = SamplingConfig(temperature=0.0)
    contexts = policy.codec.encode_prompts(PROMPTS, greedy)
    ours = [c.token_ids for c in policy.generate_ids(contexts, greedy, 8, seed=0)]
    for context, expected in zip(contexts, ours):
        got = model.generate(
            torch.tensor([context]), max_new_tokens=8, do_sample=False, attention_mask=None
        )[0, len(context) :].tolist()
        assert got[: len(expected)] == expected
    # The refusals: a folder with no policy, an OUT that holds files, an unknown dtype.
    for args, named in [
        ((str(tmp_path), str(tmp_path / "x")), "SRC:"),
        ((str(ckpt), str(dest)), "OUT:"),
        ((str(ckpt), str(tmp_path / "y"), "--dtype", "int4"), "--dtype:"),
    ]:
        refused = echorl("export", *args)
        assert refused.returncode == 2 and named in refused.stdout, refused.stdout


def test_a_lora_checkpoint_exported_merged_equals_its_adapter_applied(tmp_path, warm_add):
    """A LoRA run's checkpoint holds the adapter alone (`echorl eval` could not read it):
    exported merged, its logits equal the base with the adapter applied (peft); kept, it is
    a PEFT adapter folder; `echorl eval --model` takes the adapter folder as it is."""
    from peft import PeftModel

    out = trained(tmp_path, warm_add, "model.lora.rank=4")
    adapter = out / "checkpoints" / "step_0000002" / "policy"
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    merged_dir, kept_dir = tmp_path / "merged", tmp_path / "kept"
    assert echorl("export", str(adapter), str(merged_dir)).returncode == 0
    assert echorl("export", str(adapter), str(kept_dir), "--keep-adapter").returncode == 0
    assert (kept_dir / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    base, tokenizer = load_policy(warm_add)
    applied = PeftModel.from_pretrained(base, str(adapter)).eval()
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
    with torch.no_grad():
        want = applied(input_ids=ids).logits[..., 1:]  # past pad (echorl suppresses it)
        got = merged(input_ids=ids).logits[..., 1:]
    assert torch.allclose(got, want, atol=1e-4)
    shown = echorl("eval", "--model", str(adapter), "--n", "4")
    assert shown.returncode == 0 and "held-out greedy accuracy" in shown.stdout, shown.stderr
