"""The trainer process: pull a batch from the broker, update, publish the next version, ack.

    echorl trainer --broker http://127.0.0.1:8000 --token T --model runs/demo/sft -c run.toml

It publishes v0 (the starting weights), then for step s: pulls B groups under
the broker's protocol (sync: version == s; async: staleness <= max_staleness),
trains on them with the same `train_on_batch` as the co-located loop (the
sampler's behaviour log-probs feed the truncated importance weight), acks them
at step s and publishes v(s+1). It never talks to a sampler.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from rich.console import Console
from safetensors.torch import save_file
from transformers import PreTrainedModel

from echorl.client import BrokerClient
from echorl.config import RunConfig
from echorl.metrics import MetricsLog, plot_reward_curve, read_metrics
from echorl.models import load_policy
from echorl.protocol import PulledGroup
from echorl.sampler.backends.hf import Completion
from echorl.sampler.rollout import Group
from echorl.tasks import Problem
from echorl.trainer.colocated import reward_metrics
from echorl.trainer.update import build_optimizer, build_scheduler, update_policy


def publish(client: BrokerClient, model: PreTrainedModel, version: int, folder: Path) -> float:
    """Upload the model's weights as `version`; returns the seconds it took."""
    t0 = time.perf_counter()
    path = folder / f"v{version}.safetensors"
    save_file(
        {k: t.detach().contiguous() for k, t in model.state_dict().items()},
        path,
        metadata={"format": "pt"},
    )
    client.publish(version, path)
    path.unlink()
    return time.perf_counter() - t0


def collect(
    client: BrokerClient, n: int, step: int, poll: float = 0.1
) -> tuple[list[PulledGroup], dict]:
    """Pull until `n` groups are in hand; returns them and the idle/stale counts."""
    groups, dropped, t0 = [], 0, time.perf_counter()
    while len(groups) < n:
        reply = client.pull(n - len(groups), step)
        groups += reply.groups
        dropped += reply.dropped_stale
        if len(groups) < n:
            time.sleep(poll)
    return groups, {
        "trainer/idle_s": time.perf_counter() - t0,
        "broker/groups_dropped_stale": dropped,
    }


def to_groups(pulled: list[PulledGroup], task_name: str) -> list[Group]:
    return [
        Group(
            Problem(task_name, 0, p.prompt, ""),
            [Completion(c.token_ids, c.logprobs, "", c.finished) for c in p.group.completions],
            p.rewards,
            p.group.version,
        )
        for p in pulled
    ]


def staleness_metrics(groups: list[Group], step: int) -> dict[str, float]:
    stale = [step - g.version for g in groups]
    return {"rollout/staleness_mean": sum(stale) / len(stale), "rollout/staleness_max": max(stale)}


def run_trainer(
    cfg: RunConfig, model_dir: str | Path, client: BrokerClient, console: Console | None = None
) -> Path:
    console = console or Console()
    out = Path(cfg.train.out_dir)
    model, tokenizer = load_policy(model_dir, cfg.model.device)
    opt = build_optimizer(model, cfg.optim)
    sched = build_scheduler(opt, cfg.optim)
    log = MetricsLog(out / "metrics.jsonl")
    with tempfile.TemporaryDirectory() as tmp:
        publish(client, model, 0, Path(tmp))
        for step in range(cfg.train.steps):
            pulled, wait = collect(client, cfg.train.batch_prompts, step)
            groups = to_groups(pulled, cfg.task.name)
            t0 = time.perf_counter()
            metrics = update_policy(model, tokenizer, opt, sched, groups, cfg, step)
            train_s = time.perf_counter() - t0
            client.ack([p.group.job_id for p in pulled], step)
            publish_s = publish(client, model, step + 1, Path(tmp))
            record = {
                "step": step + 1,
                **reward_metrics(groups),
                **staleness_metrics(groups, step),
                **metrics,
                **wait,
                "trainer/step_s": train_s,
                "perf/publish_s": publish_s,
                "rollout/versions": sorted({g.version for g in groups}),
            }
            log.write(record)
            console.print(
                f"step {step + 1}/{cfg.train.steps}  reward {record['reward/mean']:.3f}  "
                f"staleness max {record['rollout/staleness_max']}  idle {wait['trainer/idle_s']:.1f}s"
            )
    plot_reward_curve(
        read_metrics(out / "metrics.jsonl"),
        out / "reward_curve.png",
        title=f"decoupled GRPO on {cfg.task.name}",
    )
    model.save_pretrained(out / "policy")
    tokenizer.save_pretrained(out / "policy")
    return out
