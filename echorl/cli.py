"""`echorl` command line: build the tiny model, warm it up, train, evaluate, demo.

echorl demo                                   # warm-up, then the decoupled swarm learns `add`
echorl run examples/async.toml                # broker + samplers + trainer, live view, report
echorl broker / sampler / trainer -c FILE     # the same roles by hand, on any machines
echorl tiny runs/tiny --preset 1m
echorl sft --task add --model runs/tiny --out runs/sft
echorl train --colocated --task add --model runs/sft -o train.steps=100
echorl eval --task add --model runs/colocated/policy
"""

from __future__ import annotations

import gc
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from echorl.config import ConfigError, RunConfig, load_config, resume_config, save_config
from echorl.protocol import printable

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])
console = Console()

CONFIG = typer.Option(None, "--config", "-c", help="run config, TOML or YAML")
OVERRIDE = typer.Option(
    None, "--set", "-o", help="override a config field: section.field=value (repeatable)"
)


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _config(path: Path | None, overrides: list[str] | None, **fields: object) -> RunConfig:
    extra = [f"{k}={v}" for k, v in fields.items() if v is not None]
    try:
        return load_config(path, [*extra, *(overrides or [])])
    except ConfigError as e:
        console.print(f"[red]config error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None


def _model_path(cfg: RunConfig) -> str:
    """`model.path`, which the verb needs; exits 2 naming the flag when it is unset."""
    if cfg.model.path is None:
        console.print("[red]--model:[/red] give a local model folder (or model.path in the config)")
        raise typer.Exit(2)

    def holds(folder: Path) -> bool:  # a model, or a LoRA adapter on a local base
        return (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file()

    inside = Path(cfg.model.path) / "policy"  # a run's folder, or one of its checkpoints
    if not holds(Path(cfg.model.path)) and holds(inside):
        console.print(f"model: {escape(str(inside))}", soft_wrap=True)  # a path: copyable
        cfg.model.path = str(inside)
    if not holds(Path(cfg.model.path)):  # told before torch loads
        console.print(
            f"[red]model.path:[/red] {escape(cfg.model.path)} is not a model folder (no "
            "config.json); echorl never downloads"
        )
        raise typer.Exit(2)
    return cfg.model.path


def _own_code(cfg: RunConfig) -> None:
    """The trainer's own code by import path (loss.type, advantage.type) imports here, before
    any model loads; exits 2 naming the field when it does not."""
    from echorl.trainer.advantages import advantage_fn
    from echorl.trainer.losses import loss_fn

    try:
        loss_fn(cfg.loss.type)
        advantage_fn(cfg.advantage.type)
    except ValueError as e:
        console.print(f"[red]config error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None


def _broker_url(given: str | None, cfg: RunConfig) -> str:
    """`--broker` (else `broker.url`, else the configured host and port), checked to be an
    http(s) URL: a bare host:port would be retried for a minute as if the broker were down."""
    url = given or cfg.broker.address
    if not url.startswith(("http://", "https://")):
        console.print(f"[red]--broker:[/red] {url!r} is not a URL; give http://HOST:PORT")
        raise typer.Exit(2)
    return url


def _role_name(name: str | None, role: str) -> str:
    """`--name`, checked as the broker will check it (or ROLE-PID)."""
    import re

    from echorl.protocol import NAME_PATTERN

    if name is not None and not re.match(NAME_PATTERN, name):
        console.print(
            f"[red]--name:[/red] {name!r}: up to 64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
        raise typer.Exit(2)
    return name or f"{role}-{os.getpid()}"


def _threads(cfg: RunConfig) -> None:
    import torch

    if cfg.model.threads:
        torch.set_num_threads(cfg.model.threads)


@app.command()
def tiny(out: Path, preset: str = typer.Option("1m", help="1m, 10m or 50m"), seed: int = 0) -> None:
    """Build the randomly initialised tiny model and save it as an HF folder."""
    from echorl.models import PRESETS, save_tiny_model

    if preset not in PRESETS:
        console.print(
            f"[red]--preset:[/red] unknown preset {preset!r}; choose one of {sorted(PRESETS)}"
        )
        raise typer.Exit(2)
    _quiet_transformers()
    save_tiny_model(out, preset, seed)
    console.print(f"tiny model ({preset}) saved to {out}")


def warm_up_to(cfg: RunConfig, model_dir: Path | None, out: Path) -> Path:
    """Warm up `model_dir` (or a fresh tiny model) on the task and save it to `out`."""
    from echorl.models import build_tiny_model, load_policy
    from echorl.progress import steps
    from echorl.tasks import get_task
    from echorl.trainer.sft import warm_up

    if model_dir:
        model, tokenizer = load_policy(model_dir, cfg.model.device)
    else:
        model, tokenizer = build_tiny_model(cfg.model.preset, cfg.model.init_seed)
    with steps(console, f"warm-up on {cfg.task.name}", cfg.sft.steps) as bar:
        losses = warm_up(model, tokenizer, get_task(cfg.task.spec), cfg.sft, bar, cfg.sampling)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if losses:
        console.print(f"warm-up loss {losses[0]:.3f} -> {losses[-1]:.3f}; saved to {out}")
    return out


@app.command()
def sft(
    out: Path = typer.Option(..., help="where to save the warmed-up checkpoint (policy version 0)"),
    task: str = typer.Option(None, help="task name (task.name)"),
    model: Path = typer.Option(
        None, help="local HF model folder (model.path); unset = a fresh tiny model"
    ),
    steps: int = typer.Option(None, help="warm-up steps (sft.steps)"),
    config: Path = CONFIG,
    override: list[str] = OVERRIDE,
) -> None:
    """Supervised warm-up on task demonstrations."""
    cfg = _config(config, override, **{"task.name": task, "sft.steps": steps, "model.path": model})
    _quiet_transformers()
    _threads(cfg)
    warm_up_to(cfg, cfg.model.path and Path(cfg.model.path), out)


def _print_result(result) -> None:
    from echorl.metrics import read_metrics

    rewards = [r["reward/mean"] for r in read_metrics(result.metrics_path) if "reward/mean" in r]
    k = max(1, min(20, len(rewards) // 2))
    table = Table(title="before and after RL")
    for col in ("", "before", "after"):
        table.add_column(col)
    before = f"{result.before.accuracy:.3f}" if result.before else "-"
    table.add_row("held-out greedy accuracy", before, f"{result.after.accuracy:.3f}")
    table.add_row(
        f"train reward (mean of first/last {k} steps)",
        f"{sum(rewards[:k]) / k:.3f}",
        f"{sum(rewards[-k:]) / k:.3f}",
    )
    console.print(table)
    console.print(
        f"metrics: {result.metrics_path}\nreward curve: {result.plot_path}\npolicy: {result.policy_path}"
    )


@app.command()
def train(
    colocated: bool = typer.Option(
        False, "--colocated", help="generate and train in this one process"
    ),
    task: str = typer.Option(None, help="task name (task.name)"),
    model: Path = typer.Option(None, help="local HF model folder, policy version 0 (model.path)"),
    steps: int = typer.Option(None, help="RL steps (train.steps)"),
    out: str = typer.Option(None, help="output folder (train.out_dir)"),
    resume: bool = typer.Option(
        False, help="continue from the latest checkpoint in the output folder"
    ),
    config: Path = CONFIG,
    override: list[str] = OVERRIDE,
) -> None:
    """RL training. `--colocated` runs the single-process reference loop."""
    if not colocated:
        console.print(
            "[red]--colocated:[/red] `echorl train` is the co-located loop; the decoupled "
            "trainer is `echorl trainer --broker URL` (or the whole swarm: `echorl run CONFIG`)"
        )
        raise typer.Exit(2)
    cfg = _config(
        config,
        override,
        **{"task.name": task, "train.steps": steps, "train.out_dir": out, "model.path": model},
    )
    model_path = _model_path(cfg)
    _own_code(cfg)
    _quiet_transformers()
    from echorl.trainer.colocated import run_colocated
    from echorl.trainer.flat import NothingLearned

    try:
        result = run_colocated(cfg, model_path, resume=resume, console=console)
    except NothingLearned as e:  # every group flat for launch.stall_timeout_s
        console.print(f"[red]the trainer stops:[/red] {escape(str(e))}")
        raise typer.Exit(1) from None
    _print_result(result)


@app.command("export")
def export_cmd(
    src: Path = typer.Argument(
        ..., help="a run's folder, one of its checkpoints, a policy or a LoRA adapter folder"
    ),
    out: Path = typer.Argument(..., help="the folder to write (new or empty)"),
    merge_lora: bool = typer.Option(
        True, "--merge-lora/--keep-adapter", help="a LoRA adapter: merged into its base, or kept"
    ),
    dtype: str = typer.Option(None, help="fp32, bf16 or fp16 (default: fp32, as trained)"),
) -> None:
    """A run's trained policy as a standard Hugging Face folder (safetensors, tokenizer,
    chat template, generation config) that transformers and vLLM load."""
    from echorl.models.export import DTYPES, export, policy_folder
    from echorl.models.loading import NotAModelFolder

    if dtype is not None and dtype not in DTYPES:
        console.print(f"[red]--dtype:[/red] {escape(dtype)} is not one of {', '.join(DTYPES)}")
        raise typer.Exit(2)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        console.print(f"[red]OUT:[/red] {escape(str(out))} exists and is not an empty folder")
        raise typer.Exit(2)
    try:
        policy_folder(src)
    except NotAModelFolder as e:
        console.print(f"[red]SRC:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    _quiet_transformers()
    folder, what = export(src, out, merge_lora, dtype)
    console.print(Text(f"wrote {folder}: {what}"), soft_wrap=True)
    console.print(
        Text(
            "  from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast\n"
            f'  model = AutoModelForCausalLM.from_pretrained("{folder}")\n'
            f'  tokenizer = PreTrainedTokenizerFast.from_pretrained("{folder}")'
            if merge_lora or not (folder / "adapter_config.json").is_file()
            else f'  PeftModel.from_pretrained(base_model, "{folder}") (peft)'
        ),
        soft_wrap=True,
    )


@app.command("eval")
def evaluate_cmd(
    model: Path = typer.Option(None, help="local HF model folder (model.path)"),
    task: str = typer.Option(None, help="task name (task.name)"),
    n: int = typer.Option(None, min=1, help="held-out problems (train.eval_prompts)"),
    samples: int = typer.Option(
        None,
        min=0,
        help="also sample this many answers per problem at the sampling temperature: pass@1 "
        "(train.eval_samples)",
    ),
    seed: int = typer.Option(None, help="seed of the held-out problems (task.seed)"),
    config: Path = CONFIG,
    override: list[str] = OVERRIDE,
) -> None:
    """Greedy accuracy on held-out problems (and sampled pass@1 with --samples), with the
    run's settings (prompt format, max_new_tokens, temperature) from -c/-o."""
    cfg = _config(
        config,
        override,
        **{
            "model.path": model,
            "task.name": task,
            "train.eval_prompts": n,
            "train.eval_samples": samples,
            "task.seed": seed,
        },
    )
    _model_path(cfg)
    _quiet_transformers()
    _threads(cfg)
    from echorl.models import load_policy
    from echorl.rollout.hf import HFBackend
    from echorl.rollout.verify import run_pool
    from echorl.tasks import get_task
    from echorl.trainer.colocated import held_out

    backend = HFBackend(*load_policy(cfg.model.path, cfg.model.device))
    task = get_task(cfg.task.spec)
    with run_pool(cfg, backend.codec) as scorer:
        result = held_out(backend, task, cfg, scorer)
    shown = f"{task.name}: held-out greedy accuracy {result.accuracy:.3f}"
    if result.pass1 is not None:
        shown += f", sampled pass@1 {result.pass1:.3f} ({result.samples} per problem)"
    console.print(shown + f" (n={result.n})")


@app.command()
def demo(
    out: Path = typer.Option(Path("runs/demo"), help="output folder"),
    task: str = typer.Option(None, help="task name"),
    steps: int = typer.Option(None, help="RL steps"),
    config: Path = CONFIG,
    override: list[str] = OVERRIDE,
) -> None:
    """The decoupled system on the tiny model: warm-up, then a broker, a sampler and a trainer
    as separate processes under the async protocol; live view, report, plots. An earlier
    demo in the output folder is replaced."""
    cfg = _config(
        config,
        [*DEMO, *(override or [])],
        **{"task.name": task, "train.steps": steps, "train.out_dir": str(out)},
    )
    earlier = Path(cfg.train.out_dir)
    if (earlier / "broker" / "broker.sqlite").exists() and (earlier / "config.yaml").exists():
        import shutil

        console.print(f"replacing the earlier demo run in {earlier}")
        shutil.rmtree(earlier)
    raise typer.Exit(_run_swarm(cfg))


# The demo's settings over the defaults: async push-pull, one staleness step, eval every 20.
DEMO = ["broker.mode=async", "broker.max_staleness=1", "train.eval_every=20"]


@app.command()
def broker(
    data_dir: str = typer.Option(None, help="state folder (broker.data_dir)"),
    host: str = typer.Option(None, help="listen address (broker.host)"),
    port: int = typer.Option(None, help="listen port (broker.port)"),
    insecure_no_auth: bool = typer.Option(
        False, "--insecure-no-auth", help="no tokens: local demos only"
    ),
    config: Path = CONFIG,
    override: list[str] = OVERRIDE,
) -> None:
    """Run the broker service (jobs, rollouts, weight versions) until SIGINT/SIGTERM."""
    cfg = _config(
        config,
        override,
        **{
            "broker.data_dir": data_dir,
            "broker.host": host,
            "broker.port": port,
            "broker.insecure_no_auth": insecure_no_auth or None,
        },
    )
    import uvicorn

    from echorl.broker.app import SetupError, create_app

    try:
        api = create_app(cfg)
    except SetupError as e:
        console.print(f"[red]broker: cannot serve this run:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    if cfg.broker.insecure_no_auth:
        console.print(
            "[yellow]warning: --insecure-no-auth: anyone who can reach the port can call every route"
        )
    console.print(
        f"echorl broker on http://{cfg.broker.host}:{cfg.broker.port} "
        f"(mode {cfg.broker.mode}, data in {cfg.broker.data_dir})"
    )
    # A peer that vanished mid-download (its link cut, its machine gone) never closes its
    # connection: past 3 s, shutdown cancels what is still streaming instead of waiting on it.
    uvicorn.run(
        api,
        host=cfg.broker.host,
        port=cfg.broker.port,
        log_level="warning",
        timeout_graceful_shutdown=3,
    )


@app.command()
def dashboard(
    run: Path = typer.Argument(None, help="an `echorl run` folder (running or finished)"),
    data_dir: Path = typer.Option(
        None, "--data-dir", help="or a broker's data dir (a swarm started by hand), with -c"
    ),
    config: Path = CONFIG,
    port: int = typer.Option(0, help="listen port (0: any free)"),
) -> None:
    """Serve the dashboard for a run: its live broker's when it runs (the URL is printed),
    else a read-only broker on its data dir (it changes nothing there) until Ctrl-C. For a
    swarm started by hand: `--data-dir DIR -c run.toml`, with a token of this session's."""
    import secrets

    import httpx
    import uvicorn

    from echorl.broker.app import SetupError, create_app
    from echorl.launch.local import free_port, read_access

    if (run is None) == (data_dir is None):
        console.print("[red]give a run folder, or --data-dir DIR (with -c CONFIG)[/red]")
        raise typer.Exit(2)
    if data_dir is not None:
        if not (data_dir / "broker.sqlite").is_file():
            console.print(Text(f"--data-dir {data_dir}: no broker.sqlite there", style="red"))
            raise typer.Exit(2)
        token = secrets.token_hex(16)  # this viewing's own: the run's tokens are not at hand
        cfg = _config(config, [f"broker.data_dir={data_dir}"])
        cfg.broker.trainer_token, cfg.broker.sampler_token = token, secrets.token_hex(16)
        where = str(data_dir)
    else:
        try:
            access = read_access(run)
        except ValueError as e:
            console.print(Text(f"{run}: {e}", style="red"))
            raise typer.Exit(2) from None
        token = access["trainer_token"]
        try:
            httpx.get(access["url"] + "/healthz", timeout=2).raise_for_status()
            link = f"{access['url']}/ui?token={token}"
            console.print(Text(f"the run's broker is up: {link}"), soft_wrap=True)
            return
        except httpx.HTTPError:
            pass
        cfg = _config(run / "config.yaml", [f"broker.trainer_token={token}"])
        cfg.broker.sampler_token = access["sampler_token"]
        where = f"{run}, finished"
    cfg.broker.port = port or free_port(0)
    try:
        api = create_app(cfg, read_only=True)
    except SetupError as e:
        console.print(f"[red]{where}: cannot open its broker state:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None
    link = f"http://127.0.0.1:{cfg.broker.port}/ui?token={token}"
    console.print(Text(f"{where}: {link}  (read-only; Ctrl-C stops)"), soft_wrap=True)
    uvicorn.run(api, host="127.0.0.1", port=cfg.broker.port, log_level="warning")


def _stop_on_signals():
    """An event set by SIGTERM or SIGINT: the process finishes what it holds, then exits."""
    from echorl.stopping import Stop

    return Stop().on_signals()


@app.command()
def sampler(
    broker_url: str = typer.Option(None, "--broker", help="broker URL (default: broker.url)"),
    token: str = typer.Option(None, envvar="ECHORL_SAMPLER_TOKEN", help="sampler token"),
    model: Path = typer.Option(
        None, help="local HF folder with the policy's architecture and tokenizer (model.path)"
    ),
    name: str = typer.Option(None, help="sampler name (default: sampler-PID)"),
    backend: str = typer.Option(None, help="generation engine (sampler.backend): hf, vllm, openai"),
    endpoint: str = typer.Option(None, help="the openai backend's server (sampler.endpoint)"),
    device: str = typer.Option(None, help="cpu, cuda, mps (sampler.device)"),
    threads: int = typer.Option(None, min=1, help="torch threads (sampler.threads)"),
    jobs_per_lease: int = typer.Option(None, min=1, help="sampler.jobs_per_lease"),
    metrics: Path = typer.Option(None, help="append per-batch metrics to this JSONL file"),
    config: Path = CONFIG,
    override: list[str] = OVERRIDE,
) -> None:
    """Run a sampler: lease jobs, hold the weights the protocol needs, generate, push."""
    import tempfile

    cfg = _config(
        config,
        override,
        **{
            "model.path": model,
            "sampler.backend": backend,
            "sampler.endpoint": endpoint,
            "sampler.device": device,
            "sampler.threads": threads,
            "sampler.jobs_per_lease": jobs_per_lease,
        },
    )
    _model_path(cfg)
    name, url = _role_name(name, "sampler"), _broker_url(broker_url, cfg)
    _quiet_transformers()
    import torch

    from echorl.client import BrokerClient, BrokerRejected
    from echorl.metrics import MetricsLog
    from echorl.rollout.peers import PeerServer, Shelf
    from echorl.rollout.verify import run_pool
    from echorl.sampler.loop import Sampler

    if cfg.sampler.threads:
        torch.set_num_threads(cfg.sampler.threads)
    stop = _stop_on_signals()
    backend = _sampler_backend(cfg)
    serve = cfg.sampler.serve_peers
    with (
        BrokerClient(url, token, retries=10, cancel=stop) as client,
        tempfile.TemporaryDirectory() as cache,
        run_pool(cfg, backend.codec) as scorer,
        PeerServer(Shelf(), port=cfg.sampler.peer_port) if serve else nullcontext() as peers,
    ):
        log = MetricsLog(metrics) if metrics else None
        worker = Sampler(client, backend, cfg, name, Path(cache), log, scorer, peers)
        serving = f"; serving peers on port {peers.port}" if peers else ""
        console.print(f"{name}: sampling for {url}{serving}")
        try:
            worker.run(stop)
        except BrokerRejected as e:  # refused (registration, revoked, quarantined): final
            console.print(f"[red]{name}: the broker refused this sampler:[/red] {escape(e.reason)}")
            raise typer.Exit(2) from None
    console.print(
        f"{name}: stopped after {worker.pushed} groups ({worker.rejected} refused, "
        f"{worker.cancelled_jobs} cancelled)"
    )


def _sampler_backend(cfg: RunConfig):
    """The sampler's generation engine (`sampler.backend`), on `model.path`'s weights (the
    broker's version replaces them before the first batch). A LoRA run's adapters: as many
    resident as a lease may still ask for (`max_staleness + 1`)."""
    from echorl.models.lora import spec_of

    lora, keep = spec_of(cfg.model.lora), cfg.broker.staleness + 1
    if cfg.sampler.backend == "openai":
        from echorl.broker.state import run_tokenizer
        from echorl.rollout.openai_backend import OpenAIBackend, ServerRefused

        if not cfg.sampler.endpoint:
            console.print("[red]--endpoint:[/red] the openai backend needs its server's URL")
            raise typer.Exit(2)
        try:
            return OpenAIBackend(
                cfg.sampler.endpoint,
                run_tokenizer(cfg.model),
                lora,
                keep,
                dtype=cfg.sampler.dtype,
            )
        except ServerRefused as e:
            console.print(f"[red]sampler.backend = openai:[/red] {escape(str(e))}")
            raise typer.Exit(2) from None
    if cfg.sampler.backend == "vllm":
        from echorl.broker.state import run_tokenizer
        from echorl.rollout.backend import EngineRefused

        try:
            from echorl.rollout.vllm_backend import VLLMBackend

            return VLLMBackend(
                cfg.model.path,
                run_tokenizer(cfg.model),
                cfg.sampler.dtype,
                lora=lora,
                keep_adapters=keep,
            )
        except ImportError as e:
            console.print(
                f"[red]sampler.backend = vllm:[/red] vLLM is not installed here ({e}); "
                "see docs/how-to/real-engines.md for its install"
            )
            raise typer.Exit(2) from None
        except EngineRefused as e:
            console.print(f"[red]sampler.backend = vllm:[/red] {escape(str(e))}")
            raise typer.Exit(2) from None
    import torch

    from echorl.models import load_policy
    from echorl.rollout.hf import HFBackend

    dtype = getattr(torch, "float32" if cfg.sampler.dtype == "auto" else cfg.sampler.dtype)
    device = cfg.sampler.device or cfg.model.device
    model, tokenizer = load_policy(cfg.model.path, device, dtype)
    return HFBackend(model, tokenizer, keep_adapters=keep)


@app.command()
def auditor(
    broker_url: str = typer.Option(None, "--broker", help="broker URL (default: broker.url)"),
    token: str = typer.Option(
        None, envvar="ECHORL_TRAINER_TOKEN", help="the trainer's token (auditors are trusted)"
    ),
    model: Path = typer.Option(
        None, help="local HF folder with the policy's architecture and tokenizer (model.path)"
    ),
    name: str = typer.Option(None, help="auditor name (default: auditor-PID)"),
    device: str = typer.Option(None, help="cpu, cuda, mps (model.device)"),
    threads: int = typer.Option(None, min=1, help="torch threads"),
    metrics: Path = typer.Option(None, help="append per-lease metrics to this JSONL file"),
    config: Path = CONFIG,
    override: list[str] = OVERRIDE,
) -> None:
    """Run an auditor: check consumed groups' log-probs under their own version's weights,
    so that the trainer need not (docs/concepts/trust.md)."""
    import tempfile

    cfg = _config(config, override, **{"model.path": model, "model.device": device})
    _model_path(cfg)
    name, url = _role_name(name, "auditor"), _broker_url(broker_url, cfg)
    _quiet_transformers()
    import torch

    from echorl.auditor import Auditor
    from echorl.client import BrokerClient, BrokerRejected
    from echorl.metrics import MetricsLog
    from echorl.models import load_policy
    from echorl.rollout.hf import HFBackend

    if threads:
        torch.set_num_threads(threads)
    stop = _stop_on_signals()
    policy, tokenizer = load_policy(cfg.model.path, cfg.model.device, torch.float32)
    backend = HFBackend(policy, tokenizer, keep_adapters=cfg.broker.staleness + 1)
    with (
        BrokerClient(url, token, retries=10, cancel=stop) as client,
        tempfile.TemporaryDirectory() as cache,
    ):
        log = MetricsLog(metrics) if metrics else None
        worker = Auditor(client, backend, cfg, name, Path(cache), log)
        console.print(f"{name}: auditing for {url}")
        try:
            worker.run(stop)
        except BrokerRejected as e:
            console.print(f"[red]{name}: the broker refused this auditor:[/red] {escape(e.reason)}")
            raise typer.Exit(2) from None
    console.print(
        f"{name}: stopped after {worker.audited} groups "
        f"({len(worker.quarantined)} samplers quarantined)"
    )


@app.command()
def trainer(
    broker_url: str = typer.Option(None, "--broker", help="broker URL (default: broker.url)"),
    token: str = typer.Option(None, envvar="ECHORL_TRAINER_TOKEN", help="trainer token"),
    model: Path = typer.Option(
        None, help="local HF folder: the starting policy, published as v0 (model.path)"
    ),
    out: str = typer.Option(None, help="output folder (train.out_dir)"),
    resume: bool = typer.Option(
        False, help="continue from the latest checkpoint in the output folder"
    ),
    io_cpus: str = typer.Option(
        None,
        help="Linux: cores for the trainer's I/O process (pulls, uploads, metrics), e.g. 1 "
        "or 2,3 (echorl run keeps it off the training cores)",
    ),
    config: Path = CONFIG,
    override: list[str] = OVERRIDE,
) -> None:
    """Run the trainer against a broker: pull, update, ack, publish the next version.
    SIGTERM checkpoints and exits; --resume continues exactly."""
    fields = {"train.out_dir": out, "model.path": model}
    cfg = _resumable(_config(config, override, **fields), config, override, fields, resume)
    _model_path(cfg)
    _own_code(cfg)
    cpus, url = _cpu_set(io_cpus), _broker_url(broker_url, cfg)
    saved = Path(cfg.train.out_dir) / "config.yaml"
    if not resume and not (config is not None and saved.is_file() and config.samefile(saved)):
        save_config(cfg, saved)  # what --resume reads back (`echorl run` wrote its own)
    _quiet_transformers()
    _threads(cfg)
    from echorl.client import BrokerClient, BrokerError
    from echorl.trainer.brokerio import IOProcessDied, NonFiniteWeights
    from echorl.trainer.decoupled import NoSamplers, run_trainer
    from echorl.trainer.flat import NothingLearned

    stop = _stop_on_signals()
    try:
        with BrokerClient(url, token, retries=10) as client:
            folder = run_trainer(cfg, cfg.model.path, client, console, resume, stop, cpus)
    except BrokerError as e:
        console.print(f"[red]broker {url}:[/red] {escape(str(e))}")
        raise typer.Exit(1) from None
    except IOProcessDied as e:  # its own error, if it had one, is printed above
        console.print(f"[red]the trainer stops:[/red] {escape(str(e))}")
        raise typer.Exit(1) from None
    except NoSamplers as e:  # nobody left to generate: say so and stop, never wait forever
        console.print(f"[red]the swarm is empty:[/red] {escape(str(e))}")
        raise typer.Exit(1) from None
    except NothingLearned as e:  # every group flat for launch.stall_timeout_s
        console.print(f"[red]the trainer stops:[/red] {escape(str(e))}")
        raise typer.Exit(1) from None
    except NonFiniteWeights as e:  # the policy diverged: stop, never serve it
        console.print(
            f"[red]the policy diverged:[/red] {e} (lower optim.lr, or --resume from a checkpoint)"
        )
        raise typer.Exit(1) from None
    if os.environ.get("RANK", "0") == "0":  # under torchrun: rank 0 alone wrote them
        from echorl.launch.local import model_out

        console.print(
            f"metrics: {folder / 'metrics.jsonl'}\nreward curve: {folder / 'reward_curve.png'}"
        )
        console.print(Text(model_out(folder)), soft_wrap=True)


def _cpu_set(text: str | None) -> set[int] | None:
    """`--io-cpus`: cores this process may run on (Linux), or None."""
    if text is None:
        return None
    try:
        cores = {int(c) for c in text.split(",")}
    except ValueError:
        console.print(f"[red]--io-cpus:[/red] {text!r} is not a comma-separated list of cores")
        raise typer.Exit(2) from None
    usable = set(range(os.cpu_count() or 1))  # any of the machine's, not just this process's
    if not cores <= usable:
        console.print(
            f"[red]--io-cpus:[/red] no core {sorted(cores - usable)} here; this machine has "
            f"cores 0-{max(usable)}"
        )
        raise typer.Exit(2)
    return cores


@app.command()
def run(
    config: Path = typer.Argument(None, help="run config, TOML or YAML (default: all defaults)"),
    out: str = typer.Option(None, help="output folder (train.out_dir)"),
    resume: bool = typer.Option(False, help="resume the trainer from its last checkpoint"),
    config_option: Path = typer.Option(
        None, "--config", "-c", help="run config, as for every verb (or give it as CONFIG)"
    ),
    override: list[str] = OVERRIDE,
) -> None:
    """The whole swarm on this machine: broker, samplers and trainer as separate processes,
    with a live view and a report at the end."""
    if config and config_option:
        console.print("[red]-c:[/red] give the config once, as CONFIG or as -c FILE")
        raise typer.Exit(2)
    cfg = _swarm_config(config or config_option, out, override, resume)
    raise typer.Exit(_run_swarm(cfg, resume))


def _swarm_config(path: Path | None, out: str | None, override: list[str], resume: bool):
    """The run's config; resumed, the one its folder's `config.yaml` holds (`_resumable`)."""
    fields = {"train.out_dir": out}
    return _resumable(_config(path, override, **fields), path, override, fields, resume)


def _resumable(
    cfg: RunConfig, path: Path | None, override: list[str] | None, fields: dict, resume: bool
) -> RunConfig:
    """Resumed, the run's own config: its folder's `config.yaml` with the file and flags given
    over it (refused, before anything is written, where they change what the run is:
    `config.resume_config`)."""
    saved = Path(cfg.train.out_dir) / "config.yaml"
    if not resume or not saved.is_file():
        return cfg
    if path is not None and path.resolve() == saved.resolve():
        path = None  # the run's own file: only the flags over it are checked
    extra = [f"{k}={v}" for k, v in fields.items() if v is not None]
    try:
        return resume_config(saved, path, [*extra, *(override or [])])
    except ConfigError as e:
        console.print(f"[red]config error:[/red] {escape(str(e))}")
        raise typer.Exit(2) from None


launch_app = typer.Typer(no_args_is_help=True, help="The swarm on a cluster manager (Ray).")
app.add_typer(launch_app, name="launch")


@launch_app.command("ray")
def launch_ray_cmd(
    config: Path = typer.Argument(None, help="run config, TOML or YAML (as for echorl run)"),
    address: str = typer.Option(
        None, help="the Ray cluster: auto, or HOST:PORT (default: start a local Ray)"
    ),
    out: str = typer.Option(None, help="output folder (train.out_dir; shared across nodes)"),
    resume: bool = typer.Option(False, help="resume the trainer from its last checkpoint"),
    config_option: Path = typer.Option(None, "--config", "-c", help="run config (or CONFIG)"),
    override: list[str] = OVERRIDE,
) -> None:
    """Broker, trainer and samplers as Ray actors, each with its launch.ray.ROLE resources;
    logs streamed here; Ray restarts a sampler that dies."""
    if config and config_option:
        console.print("[red]-c:[/red] give the config once, as CONFIG or as -c FILE")
        raise typer.Exit(2)
    cfg = _swarm_config(config or config_option, out, override, resume)
    raise typer.Exit(_run_swarm(cfg, resume, ray_address=address or "", on_ray=True))


@launch_app.command("scale")
def launch_scale(
    samplers: int = typer.Option(..., min=0, help="samplers wanted from now on"),
    address: str = typer.Option("auto", help="the Ray cluster the launcher runs on"),
) -> None:
    """Change a running `echorl launch ray`'s sampler count."""
    try:
        from echorl.launch.ray import scale
    except ImportError:
        console.print("[red]ray is not installed:[/red] pip install ray")
        raise typer.Exit(2) from None
    try:
        console.print(f"the launcher now keeps {scale(samplers, address)} samplers")
    except ValueError as e:  # no launcher actor on that cluster
        console.print(
            f"[red]no running echorl launch ray found at {address}:[/red] {escape(str(e))}"
        )
        raise typer.Exit(1) from None


def _run_swarm(
    cfg: RunConfig, resume: bool = False, ray_address: str = "", on_ray: bool = False
) -> int:
    from echorl.launch.local import launch, model_out, summarise

    _own_code(cfg)  # the trainer would fail on it after the broker and samplers started
    if on_ray:
        try:
            from echorl.launch.ray import launch_ray
        except ImportError:
            console.print("[red]ray is not installed:[/red] pip install ray")
            return 2

    _quiet_transformers()
    out = Path(cfg.train.out_dir)
    if not resume and (out / "broker" / "broker.sqlite").exists():
        console.print(
            f"[red]--out:[/red] {out} already holds a run: pass --resume, or another --out"
        )
        return 2
    model_dir = Path(cfg.model.path) if cfg.model.path else out / "sft"
    if cfg.model.path is None and not (resume and model_dir.is_dir()):
        if not cfg.launch.warm_up:
            console.print(
                "[red]model.path:[/red] unset, and launch.warm_up is off: nothing to train"
            )
            return 2
        _threads(cfg)
        console.rule(f"warm-up: tiny {cfg.model.preset} model on {cfg.task.name}")
        warm_up_to(cfg, None, model_dir)
    console.rule(
        f"{cfg.broker.mode} RL: {cfg.launch.samplers} sampler(s) + 1 trainer, "
        f"{cfg.train.steps} steps of {cfg.train.batch_prompts}x{cfg.train.group_size}"
    )
    if on_ray:
        code, folder = launch_ray(cfg, model_dir, console, ray_address or None, resume), out
    else:
        code, folder = launch(cfg, model_dir, console, resume)
    if (folder / "metrics.jsonl").is_file():
        summarise(folder, console)
    console.print(f"logs: {folder / 'logs'}   metrics: {folder / 'metrics.jsonl'}")
    console.print(Text(model_out(folder)), soft_wrap=True)
    return code


def _admin_call(broker_url: str, token: str | None, call):
    """`call(client)` against the broker; a refusal or no answer is printed (as text: the
    broker's reason may quote what samplers wrote) and exits 1."""
    from echorl.client import BrokerClient, BrokerError

    _broker_url(broker_url, RunConfig())
    try:
        with BrokerClient(broker_url, token, retries=1) as client:
            return call(client)
    except BrokerError as e:
        console.print(Text(f"--broker {broker_url}: {e}", style="red"))
        raise typer.Exit(1) from None


@app.command()
def status(
    broker_url: str = typer.Option(None, "--broker", help="broker URL (default: 127.0.0.1:8000)"),
    token: str = typer.Option(
        None,
        envvar=["ECHORL_TOKEN", "ECHORL_TRAINER_TOKEN"],
        help="the trainer (admin) token (or $ECHORL_TOKEN, else $ECHORL_TRAINER_TOKEN)",
    ),
    run: Path = typer.Option(
        None, "--run", help="an `echorl run` folder: its broker's URL and token (access.json)"
    ),
    limit: int = typer.Option(20, "--limit", min=0, help="samplers listed (alive first)"),
    watch: float = typer.Option(
        0.0, "--watch", min=0.0, help="refresh in place every this many seconds (0: once)"
    ),
) -> None:
    """Print a broker's samplers (counted by state; the most relevant listed, each with its
    account: pushed, consumed, stale, refused, lapsed, held), what their accounts say with
    the cure, versions, jobs, replay buffer and verifier failures."""
    if run is not None:
        from echorl.launch.local import read_access

        try:
            access = read_access(run)
        except ValueError as e:
            console.print(Text(f"--run: {e}", style="red"))
            raise typer.Exit(2) from None
        broker_url, token = broker_url or access["url"], token or access["trainer_token"]
    broker_url = broker_url or "http://127.0.0.1:8000"
    ask = lambda: _admin_call(broker_url, token, lambda client: client.status(limit))  # noqa: E731
    if not watch:
        for part in _status_view(ask()):
            console.print(part)
        return
    from rich.console import Group
    from rich.live import Live

    with Live(console=console, auto_refresh=False) as live:
        while True:
            live.update(Group(*_status_view(ask())), refresh=True)
            time.sleep(watch)


def _status_view(st) -> list:
    """`echorl status`'s picture of a StatusReply, as rich renderables."""
    from echorl.accounts import holding, warnings

    out: list = [
        f"mode [bold]{st.mode}[/bold]   latest version [bold]{st.latest_version}[/bold]",
        "samplers: "
        + (", ".join(f"{n} {state}" for state, n in sorted(st.sampler_counts.items())) or "none"),
    ]
    table = Table(title=f"samplers ({len(st.samplers)} of {sum(st.sampler_counts.values())})")
    table.add_column("id", no_wrap=True, min_width=16)  # whole: `echorl samplers revoke ID`
    for col in (
        "name",
        "hardware",
        "backend",
        "version held",
        "tokens/s",
        "last seen (s ago)",
        "state",
    ):
        table.add_column(col)
    # Each sampler's account: what it pushed and what became of it (broker/swarm.py ACCOUNT).
    accounts = Table(title="accounts (groups; jobs for cancelled, lapsed and held)")
    for col in ("name", "fetch s", "pushed", "consumed", "share", "stale", "refused"):
        accounts.add_column(col)
    for col in ("flat", "cancelled", "lapsed", "holds"):
        accounts.add_column(col)
    priced = any(s.cost_per_hour is not None for s in st.samplers)
    if priced:  # where samplers told their price: what each cost per token it delivered
        accounts.add_column("spent")
        accounts.add_column("cost/Mtok")
    money = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    now, total = time.time(), sum(s.consumed for s in st.samplers)
    busy = lambda s: s.pushed or s.leased or s.lapsed or s.cancelled  # noqa: E731
    for s in st.samplers:
        table.add_row(  # what samplers wrote is shown as text, never as markup
            Text(s.id),
            Text(printable(s.name)),
            Text(printable(s.hardware)),
            Text(s.backend),
            str(s.version_held),
            "-" if s.tokens_per_s is None else f"{s.tokens_per_s:.0f}",
            f"{now - s.last_seen:.0f}",
            f"{s.state} (parked)" if s.parked else s.state,  # broker.activation = cheapest
        )
        if not busy(s):
            continue  # nothing in its account: not listed twice
        accounts.add_row(
            Text(printable(s.name)),
            "-" if s.fetch_s is None else f"{s.fetch_s:.2f}",
            str(s.pushed),
            str(s.consumed),
            f"{s.consumed / total:.0%}" if total else "-",
            str(s.stale),
            str(s.refused),
            str(s.flat),
            str(s.cancelled),
            str(s.lapsed),
            str(s.leased),
            *((money(s.spent), money(s.cost_per_mtoken)) if priced else ()),
        )
    out += [table, accounts] if accounts.rows else [table]
    for line in warnings(st):
        out.append(Text(line, style="yellow"))
    if held := holding(st, now):
        out.append(Text("holding jobs now: " + "; ".join(held)))
    held_back = [s for s in st.samplers if s.state == "alive" and s.standing.startswith("new")]
    if held_back:  # docs/concepts/trust.md (standing)
        out.append(
            f"held back, not yet proven by the trainer's audit ({len(held_back)}; their jobs "
            "come beyond the trainer's budget, their groups are scored after proven ones):"
        )
        out += [Text(f"  {s.id} {printable(s.name)}: {s.standing}") for s in held_back]
    audited = [s for s in st.samplers if s.audited_tokens]
    if audited:  # each sampler's log-probs against the trainer's, on its consumed tokens
        table = Table(title="log-prob mismatch (trainer's audit; docs/concepts/trust.md)")
        for col in ("id", "tokens", "mean |Δ logp|", "KL", "beyond tolerance"):
            table.add_column(col, no_wrap=col == "id")
        for s in audited:
            table.add_row(
                Text(s.id),
                str(s.audited_tokens),
                f"{s.logprob_mean_abs:.4f}",
                f"{s.logprob_kl:+.4f}",
                f"{s.logprob_beyond:.1%}",
            )
        out.append(table)
    for key, counts in (
        ("jobs", st.jobs),
        ("rollouts", st.rollouts),
        ("ready_by_version", st.ready_by_version),
        ("audits", st.audits),
        ("verifier", st.verifier),
        ("wasted (sync's cancelled work)", st.wasted),
        ("weights fetched from", st.weight_sources),
    ):
        out.append(f"{key}: " + (", ".join(f"{k}={v}" for k, v in counts.items()) or "none"))
    if st.capacity:
        from echorl.broker.capacity import describe

        out += [Text(line) for line in describe(st.capacity)]
    out.append(f"auditors alive: {st.auditors}")
    out.append(f"verifier busy: {st.verifier_busy:.0%}")
    if st.verifier_error:
        out.append(f"[yellow]the verifier's first exception:[/yellow] {escape(st.verifier_error)}")
    return out


samplers_app = typer.Typer(no_args_is_help=True, help="Manage a broker's samplers (admin).")
BROKER_URL = typer.Option("http://127.0.0.1:8000", "--broker", help="broker URL")
ADMIN_TOKEN = typer.Option(
    None,
    envvar=["ECHORL_TOKEN", "ECHORL_TRAINER_TOKEN"],
    help="the trainer (admin) token (or $ECHORL_TOKEN, else $ECHORL_TRAINER_TOKEN)",
)
app.add_typer(samplers_app, name="samplers")


@samplers_app.command("revoke")
def revoke(
    sampler_id: str = typer.Argument(..., help="the sampler's id (see `echorl status`)"),
    broker_url: str = BROKER_URL,
    token: str = ADMIN_TOKEN,
) -> None:
    """Refuse one sampler from now on; its leased jobs go back to the queue."""
    returned = _admin_call(broker_url, token, lambda client: client.revoke(sampler_id))
    console.print(f"sampler {sampler_id} revoked; {returned} leased jobs returned to the queue")


@samplers_app.command("enrol")
def enrol(
    name: str = typer.Argument(..., help="the operator: who runs the samplers, e.g. alice"),
    broker_url: str = BROKER_URL,
    token: str = ADMIN_TOKEN,
) -> None:
    """Issue an operator its own enrolment token (printed once). Its samplers register with it
    as ECHORL_SAMPLER_TOKEN; what the audit finds of them, and what their hoarded leases
    cost, stays with the operator whatever identities it registers."""
    issued = _admin_call(broker_url, token, lambda client: client.enrol(name))
    console.print(f"operator {name} enrolled; its samplers run with")
    print(f"ECHORL_SAMPLER_TOKEN={issued}")


def main() -> None:
    """The `echorl` command: the app, with the errors a user makes (a path that is not a model
    folder, a broker that does not answer) told in one line and exit 2 or 1, no traceback."""
    try:
        app(prog_name="echorl")
    except Exception as e:
        # Their modules are loaded if they raised (and left unimported for --help's speed).
        loading, client = sys.modules.get("echorl.models.loading"), sys.modules.get("echorl.client")
        if loading and isinstance(e, loading.NotAModelFolder):
            console.print(f"[red]model.path:[/red] {escape(str(e))}")
            raise SystemExit(2) from None
        if client and isinstance(e, client.BrokerUnavailable):
            console.print(Text(f"the broker does not answer: {e}", style="red"))
            raise SystemExit(1) from None
        raise
    finally:
        # The interpreter's last garbage collection walks every object a role has loaded
        # (torch, transformers: over a second on 2 cores, each time a sampler or trainer
        # exits). Everything is closed by now; the process's end frees the memory. Not with
        # triton loaded (vLLM): its nanobind bindings print hundreds of "leaked" lines when
        # their objects outlive the interpreter.
        if "triton" not in sys.modules:
            gc.freeze()


if __name__ == "__main__":
    main()
