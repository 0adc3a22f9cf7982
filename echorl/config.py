"""Configuration: one pydantic model per part of a run, every field documented and bounded.

A run is described by one TOML or YAML file (see `examples/`); any field can be
overridden with a dotted `key=value` (`train.steps=50`, `optim.lr=1e-4`).
Unknown keys are errors, so a typo never silently does nothing.

    cfg = load_config("examples/colocated.toml", ["train.steps=20"])
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEVICE = r"^(cpu|mps|(cuda|xpu)(:\d+)?)$"  # a torch device name, checked before any is made


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSettings(_Section):
    """Low-rank adapters (peft): the trainer trains only them, and each version after v0 is
    the adapter alone, applied by the samplers on v0's weights (docs/how-to/lora.md)."""

    rank: int = Field(0, ge=0, le=512, description="adapter rank r; 0 = off (full weights)")
    alpha: float = Field(
        16.0, gt=0.0, le=1e4, description="scale alpha: the update is (alpha / r) * B A"
    )
    targets: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="names of the linear modules that get adapters (Qwen/Llama names)",
    )


class ModelConfig(_Section):
    path: str | None = Field(
        None, description="local HF model folder; unset = build the tiny model"
    )
    tokenizer: str | None = Field(
        None,
        description="folder with the run's tokenizer.json (for a broker that holds no weights); "
        "unset = model.path's; both unset = the tiny model's byte tokenizer",
    )
    preset: Literal["1m", "10m", "50m"] = Field(
        "1m", description="tiny-model size when `path` is unset"
    )
    init_seed: int = Field(0, ge=0, description="seed of the tiny model's random initialisation")
    device: str = Field("cpu", pattern=DEVICE, description="torch device: cpu, cuda, cuda:1, mps")
    threads: int | None = Field(
        None, ge=1, le=256, description="torch intra-op threads; unset = torch default"
    )
    lora: LoraSettings = LoraSettings()


class TaskConfig(_Section):
    name: str = Field(
        "add",
        description="a built-in task or environment (echorl.tasks.TASKS, ENVIRONMENTS), "
        "jsonl:PATH (math problems from a file, which must exist on the broker and sampler "
        "machines), rg:DATASET (reasoning-gym), or your own: module.path:Name or "
        "file.py:Name (a Task or Environment class, factory or instance)",
    )
    seed: int = Field(0, ge=0, description="seed of the prompt stream")
    format_reward: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="added to the verifier's reward when the answer is inside <answer>...</answer>; "
        "kept apart from correctness (accuracy counts the verifier alone)",
    )

    dataset: str | None = Field(
        None,
        description="your own data: a .jsonl/.json/.csv/.parquet file or a local datasets "
        "folder, one row a prompt (text or chat messages in `prompt_column`), scored by "
        "`rewards` over its columns (TRL's reward functions); task.name is then 'dataset'",
    )
    prompt_column: str = Field("prompt", min_length=1, description="the dataset's prompt column")
    rewards: list[str] = Field(
        [],
        max_length=32,
        description="reward functions, file.py:name or module.path:name, each "
        "fn(prompts, completions, **columns) -> list[float]; the reward is their weighted sum",
    )
    reward_weights: list[float] | None = Field(
        None, description="one weight per reward function; unset = 1 each"
    )
    eval_dataset: str | None = Field(
        None, description="held-out rows from another file (else a hash of each prompt decides)"
    )
    eval_fraction: float | None = Field(
        None, gt=0.0, lt=1.0, description="the held-out share of `dataset`'s rows; unset = 1/8"
    )
    max_new_tokens: int = Field(
        256,
        ge=1,
        le=32768,
        description="a dataset's completion bound (built-in tasks have their own)",
    )

    @property
    def spec(self) -> str:
        """The string `echorl.tasks.get_task` builds this task from (the verifier workers
        receive it): `name`, or the dataset's settings."""
        if self.dataset is None:
            return self.name
        from echorl.tasks.dataset import DatasetSpec

        return DatasetSpec(
            self.dataset,
            tuple(self.rewards),
            None if self.reward_weights is None else tuple(self.reward_weights),
            self.eval_dataset,
            self.eval_fraction,
            self.prompt_column,
            self.max_new_tokens,
        ).spec()

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        from echorl.tasks import get_task

        if name != "dataset":
            try:
                get_task(name)
            except (KeyError, ValueError) as e:
                raise ValueError(e.args[0] if e.args else str(e)) from None
        return name

    @model_validator(mode="after")
    def _dataset(self) -> TaskConfig:
        from echorl.tasks import get_task

        if self.dataset is None:
            for key in ("rewards", "reward_weights", "eval_dataset", "eval_fraction"):
                if getattr(self, key):
                    raise ValueError(f"task.{key} is for your own data: set task.dataset too")
        elif self.name not in ("add", "dataset"):
            raise ValueError(
                f"task.name {self.name!r} and task.dataset are two tasks: set one of them"
            )
        elif self.name != "dataset":
            self.__dict__["name"] = "dataset"  # what the run's saved config reads back
        if self.dataset is None:
            if self.name == "dataset":
                raise ValueError("task.name 'dataset' needs task.dataset (a file or folder)")
            return self
        try:
            get_task(self.spec)
        except (KeyError, ValueError) as e:
            raise ValueError(e.args[0] if e.args else str(e)) from None
        return self


class SamplingConfig(_Section):
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass; 1 = off")
    max_new_tokens: int | None = Field(
        None, ge=1, le=32768, description="unset = the task's own bound"
    )
    prompt_format: Literal["plain", "chat"] = Field(
        "plain",
        description="plain: the task's text as is (the tiny model); chat: wrapped in the "
        "tokenizer's chat template as a user turn (real instruction-tuned checkpoints)",
    )
    system_prompt: str | None = Field(
        None, max_length=10_000, description="chat format: an optional system turn"
    )


class AdvantageConfig(_Section):
    type: str = Field(
        "grpo",
        description="grpo: (r-mean)/(std+eps); drgrpo: r-mean; rloo: r - mean of the others; "
        "or your own, file.py:name or module.path:name: fn(rewards (groups, G), cfg) -> same shape",
    )
    eps: float = Field(1e-6, gt=0.0, le=1.0, description="added to the group std (grpo)")

    @field_validator("type")
    @classmethod
    def _builtin_or_path(cls, name: str) -> str:
        return _builtin_or_path(name, ("grpo", "drgrpo", "rloo"), "advantage")


def _builtin_or_path(name: str, builtin: tuple[str, ...], what: str) -> str:
    """A built-in name, or the form of an import path (resolved where it runs: the trainer)."""
    from echorl.userpath import is_import_path

    if name in builtin or is_import_path(name):
        return name
    raise ValueError(
        f"unknown {what} {name!r}: one of {', '.join(builtin)}, or file.py:name / module.path:name"
    )


class LossConfig(_Section):
    type: str = Field(
        "ppo_clip",
        description="policy loss (echorl.trainer.losses.LOSSES): ppo_clip (token ratios, "
        "clip-higher), gspo (a sequence's ratio, clipped by seq_clip_*), cispo (every "
        "token's gradient kept, its stop-gradient IS weight clipped by clip_*); or your own, "
        "file.py:name or module.path:name: fn(LossInputs, cfg) -> (loss, metrics), "
        "imported by the trainer",
    )

    @field_validator("type")
    @classmethod
    def _builtin_or_path(cls, name: str) -> str:
        return _builtin_or_path(name, ("ppo_clip", "gspo", "cispo"), "loss")

    clip_low: float = Field(0.2, ge=0.0, le=1.0, description="ratio lower bound is 1 - clip_low")
    clip_high: float = Field(
        0.28, ge=0.0, le=10.0, description="ratio upper bound is 1 + clip_high (DAPO clip-higher)"
    )
    seq_clip_low: float = Field(
        3e-4, ge=0.0, le=1.0, description="gspo: a sequence ratio's lower bound 1 - seq_clip_low"
    )
    seq_clip_high: float = Field(
        4e-4, ge=0.0, le=10.0, description="gspo: its upper bound 1 + seq_clip_high"
    )
    aggregation: Literal["token_mean", "seq_mean"] = Field(
        "token_mean",
        description="token_mean: mean over all tokens (DAPO); seq_mean: mean per sequence, then over sequences (GRPO)",
    )
    is_cap: float = Field(
        2.0,
        ge=1.0,
        le=1e6,
        description="C in the truncated importance weight min(exp(old - behaviour), C)",
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        le=10.0,
        description="weight of the k3 KL to the frozen initial policy; 0 = off",
    )
    proximal: bool = Field(
        True,
        description="decoupled PPO: clip the ratio to the trainer's own pre-update policy and "
        "correct for the sampler with the truncated IS weight (one extra forward pass); "
        "false: clip the ratio to the sampler's behaviour log-probs directly",
    )


class OptimConfig(_Section):
    lr: float = Field(
        3e-5,
        gt=0.0,
        le=1.0,
        description="AdamW learning rate (3e-4 collapses the 1m tiny model; see docs/benchmarks.md)",
    )
    weight_decay: float = Field(0.0, ge=0.0, le=1.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.99, ge=0.0, lt=1.0)
    grad_clip: float = Field(1.0, gt=0.0, le=1e4, description="max global grad norm")
    warmup_steps: int = Field(
        0, ge=0, description="linear learning-rate warm-up, in optimiser steps"
    )


class TrainConfig(_Section):
    """The RL loop: B prompts x G completions per step."""

    steps: int = Field(120, ge=1, le=10_000_000, description="RL steps (policy versions published)")
    batch_prompts: int = Field(16, ge=1, le=65536, description="B: prompts per step")
    group_size: int = Field(8, ge=1, le=1024, description="G: completions per prompt")
    ppo_epochs: int = Field(1, ge=1, le=64, description="passes over each batch")
    minibatches: int = Field(1, ge=1, le=4096, description="optimiser steps per pass")
    seed: int = Field(0, ge=0, description="run seed; sampling seeds derive from (seed, step)")
    drop_flat_groups: bool = Field(
        True,
        description="leave out groups whose rewards are all equal (zero advantage, no policy "
        "gradient) so they neither dilute the token mean nor move Adam; a step with none left is skipped",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling: the broker sets flat groups aside as they are "
        "scored and gives their place to fresh prompts, until a step has B informative groups "
        "(both protocols; the refill rate is logged as rollout/refill_rate)",
    )
    dynamic_sampling_max: float = Field(
        4.0,
        ge=0.0,
        le=1000.0,
        description="flat groups set aside per version, as a multiple of B, before flat ones "
        "are served anyway (a model that solves all or nothing is then told so, not waited on)",
    )
    eval_every: int = Field(
        0, ge=0, description="steps between held-out greedy evaluations; 0 = start and end only"
    )
    eval_prompts: int = Field(200, ge=1, le=100_000, description="held-out prompts per evaluation")
    eval_samples: int = Field(
        0,
        ge=0,
        le=1024,
        description="also sample this many answers per held-out prompt at the sampling "
        "temperature and log their mean success (eval/pass1); 0 = greedy only",
    )
    checkpoint_every: int = Field(
        50, ge=0, description="steps between checkpoints; 0 = only at the end"
    )
    out_dir: str = Field("runs/colocated", description="metrics, checkpoints and plots go here")
    parallel: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="under torchrun, how the trainer's ranks share a step: ddp (every rank a "
        "whole replica) or fsdp2 (parameters, gradients and optimiser state sharded); one "
        "process: no effect",
    )

    @model_validator(mode="after")
    def _divisible(self) -> TrainConfig:
        n = self.batch_prompts * self.group_size
        if n % self.minibatches:
            raise ValueError(
                f"batch_prompts*group_size = {n} is not divisible by minibatches = {self.minibatches}; "
                "pick minibatches that divides it"
            )
        return self


class SFTConfig(_Section):
    """The supervised warm-up on task demonstrations."""

    steps: int = Field(800, ge=0, le=10_000_000, description="optimiser steps")
    batch_size: int = Field(64, ge=1, le=65536)
    lr: float = Field(1e-3, gt=0.0, le=1.0, description="peak rate, decayed linearly to 30%")
    seed: int = Field(
        1, ge=0, description="seed of the demonstration stream (kept apart from RL's)"
    )


class BrokerConfig(_Section):
    """The broker service: where its state lives, the protocol it enforces, who may call it."""

    data_dir: str = Field("runs/broker", description="holds broker.sqlite and weights/")
    host: str = Field("127.0.0.1", description="listen address")
    port: int = Field(8000, ge=0, le=65535, description="0 = any free port")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sequential pull or asynchronous push-pull"
    )
    max_staleness: int = Field(
        1,
        ge=0,
        le=1000,
        description="async: oldest version a pulled group may have, relative to the latest",
    )
    lease_seconds: float = Field(
        120.0, gt=0.0, le=86400.0, description="how long a sampler holds a job"
    )
    overprovision: float = Field(
        1.0,
        ge=1.0,
        le=4.0,
        description="sync: lease up to this x train.batch_prompts jobs of each version; the "
        "trainer takes the first B groups to arrive and the rest are cancelled when the next "
        "version is published (their jobs queued again): a straggler never stalls a step. "
        "Every consumed group is still of the step's version; the cancelled work is reported "
        "as wasted",
    )
    activation: Literal["all", "cheapest"] = Field(
        "all",
        description="cheapest: with priced samplers (sampler.cost_per_hour), hand jobs only "
        "to the cheapest proven set whose measured speed covers the trainer's need x (1 + "
        "activation_margin) and park the rest (registered, heartbeating, leases empty with "
        "`parked`), waking them the moment the swarm falls short (broker/activation.py); "
        "all: every sampler works",
    )
    activation_margin: float = Field(
        0.2,
        ge=0.0,
        le=10.0,
        description="activation = cheapest: the active samplers' speed is kept at the "
        "trainer's need x (1 + this); under (1 + this / 2), parked samplers are woken",
    )
    activation_hold_s: float = Field(
        60.0,
        ge=0.0,
        le=86400.0,
        description="activation = cheapest: no sampler is parked within this long of the "
        "last change (waking is at once)",
    )
    lease_by_speed: bool = Field(
        False,
        description="size each lease to the sampler's measured speed: one that generates at "
        "a fraction f < 1/2 of the fastest sampler's tokens/s leases about f x the jobs it "
        "asks for (at least 1), so a slow machine holds few jobs and its lease fits its speed",
    )
    peer_hosts: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="networks (CIDR, e.g. 10.0.0.0/8) a sampler's peer_url may name besides "
        "the address its registration came from (samplers behind a NAT that reach each other "
        "on a LAN); link-local is refused always, loopback unless the broker is on loopback",
    )
    peer_fanout: int = Field(
        2,
        ge=0,
        le=64,
        description="weights from peers: a sampler that serves peers (sampler.serve_peers) "
        "passes a version on to at most this many others, while it is still arriving, and "
        "the broker itself serves this many directly; the rest of the swarm fetches down the "
        "tree. 0 = every sampler fetches from the broker",
    )
    trainer_lease_seconds: float = Field(
        300.0, gt=0.0, le=86400.0, description="how long pulled groups wait for an ack"
    )
    sampler_timeout: float = Field(
        60.0, gt=0.0, le=86400.0, description="silence after which a sampler is lost"
    )
    lease_silence_s: float = Field(
        6.0,
        ge=1.0,
        le=86400.0,
        description="a sampler holding a lease and silent this long (killed, its cable pulled) "
        "has its leases returned at once, as a lapse; it beats every third of this (or of "
        "sampler_timeout) while it works one",
    )
    max_attempts: int = Field(5, ge=1, le=1000, description="leases before a job is parked")
    max_samplers: int = Field(
        256, ge=1, le=1_000_000, description="samplers registered and alive at once (429 beyond)"
    )
    sampler_retention_s: float = Field(
        600.0,
        ge=0.0,
        le=1e9,
        description="samplers that left or were lost are forgotten this long after they were "
        "last seen (quarantined and revoked ones are kept: their reasons stay on record)",
    )
    max_leased_per_sampler: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="jobs one sampler may hold leased at once; unset = train.batch_prompts "
        "(a sampler that hoards leases and never pushes cannot take every admitted job)",
    )
    first_lease: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="jobs a sampler may hold at first; each group it delivers allows one more, "
        "up to max_leased_per_sampler (a lease that runs out unpushed halves that count); "
        "until the trainer's audit proves it (quarantine.min_tokens audited tokens) its jobs "
        "are newcomer_jobs, beyond the budget: a fresh identity cannot hoard; "
        ">= max_leased_per_sampler: no probation",
    )
    newcomer_jobs: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="jobs all samplers not yet proven by the audit (broker/standing.py) may "
        "hold together, on top of the admission budget (a swarm of fresh identities, or of "
        "identities that delivered one junk group, cannot take the trainer's jobs); "
        "unset = max(1, train.batch_prompts // 4)",
    )
    registrations_per_minute: float = Field(
        20.0,
        ge=0.0,
        le=1e6,
        description="registrations per enrolment token and per client address (a burst of as "
        "many, then this rate; 429 beyond); 0 = unlimited",
    )
    max_body_bytes: int = Field(16 << 20, ge=1024, description="largest JSON body accepted")
    push_bytes_per_sampler: int | None = Field(
        None,
        ge=1024,
        description="push bodies one sampler may have in flight at once (429 beyond, before "
        "reading them); unset = 2 x max_body_bytes",
    )
    push_bytes_in_flight: int | None = Field(
        None,
        ge=1024,
        description="push bodies all samplers may have in flight at once: what pushes can "
        "hold of the broker's memory (429 beyond); unset = 8 x max_body_bytes",
    )
    sampler_calls_per_s: float = Field(
        100.0,
        ge=0.0,
        le=1e6,
        description="calls one sampler may make a second, after a burst of twice as many "
        "(429 with Retry-After beyond; a busy sampler of the 1m model makes ~30); 0 = unlimited",
    )
    push_slots: int = Field(
        4,
        ge=1,
        le=1024,
        description="pushes processed at once (more wait, read but not parsed): keeps the "
        "trainer's pull and ack quick under a swarm",
    )
    max_weights_bytes: int = Field(64 << 30, ge=1024, description="largest weights upload accepted")
    keep_versions: int = Field(3, ge=1, le=10000, description="weight versions kept on disk")
    sampler_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="floating tensors are cast to this for samplers (bf16 halves the download); "
        "the trainer keeps its own precision",
    )
    synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL", description="FULL: durable across power loss too"
    )
    trainer_token: str | None = Field(
        None,
        min_length=16,
        description="bearer token of the trainer role (or $ECHORL_TRAINER_TOKEN)",
    )
    viewer_token: str | None = Field(
        None,
        min_length=16,
        description="read-only: the dashboard at /ui and nothing else (or $ECHORL_VIEWER_TOKEN); "
        "the trainer token opens it too",
    )
    sampler_token: str | None = Field(
        None,
        min_length=16,
        description="bearer token of the sampler role (or $ECHORL_SAMPLER_TOKEN)",
    )
    insecure_no_auth: bool = Field(
        False, description="accept every call without a token (local demos only)"
    )
    url: str | None = Field(
        None,
        description="where samplers and trainer reach the broker; unset = http://host:port",
    )

    @field_validator("peer_hosts")
    @classmethod
    def _networks(cls, nets: list[str]) -> list[str]:
        for net in nets:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"{net!r} is not a network (e.g. 10.0.0.0/8)") from None
        return nets

    @property
    def address(self) -> str:
        return self.url or f"http://{self.host}:{self.port}"

    @property
    def staleness(self) -> int:
        """The bound in force: `max_staleness` in async; 0 in sync (every group on-policy)."""
        return self.max_staleness if self.mode == "async" else 0


class VerifyConfig(_Section):
    """Verifiers (the task's scoring code) run in worker processes, each call bounded: one
    that overruns or crashes scores that completion 0 and is counted, never stalling the
    broker, a sampler or an evaluation."""

    workers: int = Field(
        2,
        ge=1,
        le=256,
        description="the broker's verifier processes (ingest scales with them, up to its "
        "cores); samplers, trainers and evaluations use one each",
    )
    time_limit_s: float = Field(
        5.0, gt=0.0, le=3600.0, description="wall clock one completion's scoring may take"
    )
    memory_mb: int = Field(
        1024, ge=64, le=1 << 20, description="memory a verifier process may grow by"
    )


class QuarantineConfig(_Section):
    """The trainer audits every consumed group: its own log-probs of the tokens (the
    proximal policy) against the sampler's behaviour log-probs. A sampler whose tokens
    disagree far beyond what honest samplers show (fake log-probs, other weights, made-up
    completions) is quarantined: no more leases, its unconsumed groups dropped.
    Defaults from measurement (docs/concepts/trust.md)."""

    enabled: bool = Field(True, description="audit consumed groups and quarantine on the bounds")
    exact_stale: bool = Field(
        True,
        description="the trainer keeps the trainable weights of the last max_staleness "
        "versions (LoRA: the adapters; full: a copy of the model each) and audits a stale "
        "group against its own version (a forward pass of its rows); off: against the "
        "current policy, whose drift since then counts as the sampler's mismatch",
    )
    audit_fraction: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="share of the groups whose audit needs a forward pass of its own (flat "
        "groups, left out of the update; stale ones under exact_stale) audited each step, "
        "each drawn at random with a seed the samplers cannot know; groups the update's own "
        "pass covers are always audited. Below 1 the audit costs the trainer that share; 0 "
        "audits only what is free (a swarm of trusted samplers)",
    )
    tolerance: float = Field(
        2.0, gt=0.0, le=100.0, description="|trainer - sampler| log-prob counted as far off"
    )
    max_mean_abs: float = Field(
        0.5, gt=0.0, le=100.0, description="bound on a sampler's mean |trainer - sampler|"
    )
    max_kl: float = Field(
        0.05,
        gt=0.0,
        le=100.0,
        description="bound on a sampler's |mean (sampler - trainer)| log-prob, its estimate of "
        "KL(sampler || trainer): ~0 for an honest one; claims of confidence it never had "
        "(made-up completions) push it up, made-up log-probs either way",
    )
    max_beyond: float = Field(
        0.1, gt=0.0, le=1.0, description="bound on the fraction of its tokens far off"
    )
    min_tokens: int = Field(
        128,
        ge=1,
        le=10**9,
        description="audited tokens before a sampler can be quarantined, and before it is "
        "proven (leases from the trainer's budget, verifier turns ahead of unproven ones)",
    )
    decay: float = Field(
        0.9, ge=0.0, le=1.0, description="weight of a sampler's past audit per new report"
    )


class SamplerConfig(_Section):
    """A sampler process (`echorl sampler`, or each one `echorl run` starts)."""

    backend: Literal["hf", "vllm", "openai"] = Field(
        "hf",
        description="generation engine: hf (transformers, CPU/CUDA/MPS), vllm (a vLLM "
        "engine in the sampler's process; installed apart) or openai (a vLLM OpenAI-"
        "compatible server at sampler.endpoint); docs/how-to/real-engines.md",
    )
    endpoint: str | None = Field(
        None, description="the openai backend's server, e.g. http://127.0.0.1:8300"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="the sampler's weights and compute dtype (auto: the model's for vllm, "
        "float32 for hf); bfloat16 samplers beside an fp32 trainer show their log-prob "
        "mismatch per step, which the truncated IS weight corrects",
    )
    jobs_per_lease: int = Field(
        16, ge=1, le=1024, description="jobs leased, and generated as one batch, at a time"
    )
    slowdown: float = Field(
        1.0,
        ge=1.0,
        le=1000.0,
        description="SIMULATION, for test beds of uneven machines (bench/swarm.py): after "
        "generating a lease, wait (slowdown - 1) x its generation time, so this sampler "
        "delivers 1/slowdown of its real speed (and reports that speed). 1 = real speed",
    )
    device: str | None = Field(
        None, pattern=DEVICE, description="torch device; unset = model.device"
    )
    threads: int | None = Field(
        None, ge=1, le=256, description="torch intra-op threads; unset = torch default"
    )
    cost_per_hour: float | None = Field(
        None,
        ge=0.0,
        le=1e6,
        description="what running this sampler costs an hour (any currency, the same for the "
        "swarm): `echorl status` names the cheapest samplers that keep the trainer busy",
    )
    serve_peers: bool = Field(
        False,
        description="serve the weights this sampler holds (and the version arriving) to "
        "peers the broker sends to it (checked by sha256; a failing peer sends them back to "
        "the broker): the broker's uplink carries a version about once, not once per sampler",
    )
    peer_port: int = Field(0, ge=0, le=65535, description="serve_peers: port (0 = any free)")
    peer_host: str | None = Field(
        None,
        pattern=r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]{1,253})$",
        description="serve_peers: the address peers reach this sampler at; unset = the "
        "address this machine reaches the broker from (the broker takes another only in "
        "its broker.peer_hosts)",
    )
    lease_wait_s: float = Field(
        2.0,
        ge=0.1,
        le=10.0,
        description="long poll: how long the broker may hold a lease while no job is admitted "
        "(it answers the moment one is); also how long a stopping sampler may take to notice",
    )


class RayRole(_Section):
    """What one role's Ray actor asks of the cluster (`echorl launch ray`)."""

    num_cpus: float = Field(1.0, ge=0.0, le=4096.0, description="CPUs Ray reserves for it")
    num_gpus: float = Field(0.0, ge=0.0, le=64.0, description="GPUs Ray reserves for it")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom resources it needs, e.g. {edge = 1} places it only on nodes "
        "started with `ray start --resources '{\"edge\": 4}'` (a kind of machine)",
    )


class RaySettings(_Section):
    """`echorl launch ray`: each role an actor with its own resources."""

    broker: RayRole = Field(default_factory=RayRole)
    trainer: RayRole = Field(default_factory=RayRole)
    sampler: RayRole = Field(default_factory=RayRole)
    broker_wait_s: float = Field(
        120.0,
        ge=1.0,
        le=86400.0,
        description="how long the launcher waits for the broker's actor to answer /healthz "
        "(its placement, its node's imports and its start; a busy small head node is slow)",
    )


class LaunchConfig(_Section):
    """`echorl run`: a broker, the samplers and the trainer as processes on this machine."""

    samplers: int = Field(1, ge=0, le=256, description="sampler processes to start")
    sampler_threads: int = Field(1, ge=1, le=256, description="torch threads per sampler")
    sampler_slowdowns: list[Annotated[float, Field(ge=1.0, le=1000.0)]] = Field(
        default_factory=list,
        max_length=256,
        description="SIMULATION of uneven machines: sampler k runs with sampler.slowdown = "
        "sampler_slowdowns[k % len] (e.g. [1, 1, 2, 4]); empty = every sampler at real speed",
    )
    auditors: int = Field(
        0,
        ge=0,
        le=64,
        description="auditor processes to start (`echorl auditor`): they audit the groups "
        "whose check needs a forward pass of its own, in the trainer's place (docs/concepts/trust.md)",
    )
    trainer_threads: int = Field(
        1, ge=1, le=256, description="torch threads of the trainer (of each of its ranks)"
    )
    trainer_procs: int = Field(
        1,
        ge=1,
        le=1024,
        description="trainer ranks on this machine: more than 1 starts the trainer under "
        "torchrun (train.parallel says how they share a step)",
    )
    pin_cores: bool = Field(
        True,
        description="Linux: the trainer's compute gets the first `trainer_threads` cores to "
        "itself; broker, samplers and the trainer's I/O process share the rest (as on "
        "separate machines). Off, or too few cores: the OS schedules everyone everywhere",
    )
    warm_up: bool = Field(
        True, description="when model.path is unset: warm the tiny model up (sft) before RL"
    )
    max_restarts: int = Field(
        10, ge=0, le=10_000, description="restarts of one role before the run is given up"
    )
    ray: RaySettings = Field(default_factory=RaySettings)
    stall_timeout_s: float = Field(
        300.0,
        ge=5.0,
        le=86400.0,
        description="stop the run, with the reason, when the trainer neither logs a step nor "
        "publishes a version for this long (counted from the launch; raise it when the first "
        "evaluation of a big model takes longer), or when every group of every step was flat "
        "(all rewards equal: nothing is learned) for this long",
    )


class MetricsConfig(_Section):
    """Where a run's numbers go besides OUT/metrics.jsonl and its PNG plots (echorl/trackers.py)."""

    tensorboard: bool = Field(
        True, description="event files in OUT/tb (when tensorboard is installed)"
    )
    wandb: bool = Field(False, description="Weights & Biases: config, every step, the summary")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: files in OUT/wandb (`wandb sync` uploads them); online: needs "
        "`wandb login` or WANDB_API_KEY",
    )
    mlflow: bool = Field(False, description="MLflow: config as params, every step, summary.json")
    mlflow_uri: str | None = Field(
        None, description="an MLflow tracking server or store; unset = the folder OUT/mlruns"
    )
    project: str = Field(
        "echorl", min_length=1, max_length=128, description="W&B project, MLflow experiment"
    )
    run_name: str | None = Field(
        None, max_length=128, description="the tracker run's name; unset = the out folder's"
    )


class RunConfig(_Section):
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    advantage: AdvantageConfig = AdvantageConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    sft: SFTConfig = SFTConfig()
    broker: BrokerConfig = BrokerConfig()
    verify: VerifyConfig = VerifyConfig()
    quarantine: QuarantineConfig = QuarantineConfig()
    sampler: SamplerConfig = SamplerConfig()
    launch: LaunchConfig = LaunchConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _group_needs_peers(self) -> RunConfig:
        if self.train.group_size < 2:
            raise ValueError(
                f"train.group_size = {self.train.group_size}: group-relative advantages "
                f"({self.advantage.type}) need at least 2 completions per prompt"
            )
        if self.train.parallel == "fsdp2" and self.model.lora.rank:
            raise ValueError(
                "train.parallel = fsdp2 with model.lora: LoRA trains a few per cent of the "
                "weights, which every rank can hold; use train.parallel = ddp"
            )
        return self


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the field."""


def _read_file(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; give a TOML or YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot parse: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a table of sections")
    return data


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b=value` in the nested dict. A text field takes the value as written (`2024`,
    `yes` and `a #1` stay text; quote it to have YAML read it); any other field's value is
    read as YAML (numbers, booleans, lists). An empty value unsets the field."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} must look like section.field=value")
    *parents, leaf = key.strip().split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part} is not a section")
    if not raw.strip():
        node[leaf] = None
    elif _is_text(parents, leaf) and raw.strip()[0] not in "'\"":
        node[leaf] = raw
    else:
        try:
            node[leaf] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{key.strip()}: cannot read {raw!r}: {problem}") from None


def _is_text(parents: list[str], leaf: str) -> bool:
    """Whether RunConfig's field `parents.leaf` holds text (str, or str or None)."""
    section: Any = RunConfig
    for part in parents:
        field = getattr(section, "model_fields", {}).get(part)
        if field is None:
            return False
        section = field.annotation
    field = getattr(section, "model_fields", {}).get(leaf)
    return field is not None and field.annotation in (str, str | None)


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        lines.append(f"{where}: {err['msg']}")
    return "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read a run config from TOML/YAML (or the defaults) and apply dotted overrides."""
    data = _read_file(Path(path)) if path else {}
    for override in overrides or []:
        apply_override(data, override)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


# What a run is: a resumed run may train longer, on more samplers, logging elsewhere, but
# with another of these it would be another run on this one's broker and checkpoints.
RUN_IDENTITY = (
    "model.path",
    "model.preset",
    "model.lora",
    "task",
    "broker.mode",
    "train.batch_prompts",
    "train.group_size",
)


def save_config(cfg: RunConfig, path: Path) -> None:
    """`cfg` as the run's `config.yaml` (what `--resume` reads back), without its tokens (they
    come from the environment); written whole or not at all."""
    data = cfg.model_dump(mode="json")
    data["broker"] |= {"trainer_token": None, "sampler_token": None, "viewer_token": None}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".yaml.{os.getpid()}.tmp")  # torchrun's ranks write it at once
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)


def resume_config(
    saved: Path, path: str | Path | None, overrides: list[str] | None = None
) -> RunConfig:
    """The config of a run resumed from `saved` (its `config.yaml`): that run's, with what
    the config file `path` sets and the `overrides` over it. Changing what the run is
    (RUN_IDENTITY) is a ConfigError that names each difference; nothing else has happened."""
    data = _read_file(saved)
    run = RunConfig.model_validate(data)
    if path:
        _merge(data, _read_file(Path(path)))
    for override in overrides or []:
        apply_override(data, override)
    try:
        asked = RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    was, now = run.model_dump(mode="json"), asked.model_dump(mode="json")
    changed = [
        f"{key}: {_at(was, key)!r} in {saved}, {_at(now, key)!r} asked"
        for key in RUN_IDENTITY
        if _at(was, key) != _at(now, key)
    ]
    if changed:
        raise ConfigError(
            "--resume continues the run as it was; these would make it another run: "
            + "; ".join(changed)
            + " (drop them, or start a new run with another --out)"
        )
    return asked


def _merge(into: dict[str, Any], over: dict[str, Any]) -> None:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _at(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data
