"""The trainer process: pull a batch from the broker, update, ack, publish the next version.

    echorl trainer --broker http://127.0.0.1:8000 --token T --model runs/demo/sft -c run.toml
    echorl trainer ... --resume        # after a crash: continue from the last checkpoint

It publishes v0 (the starting weights), then for step s: pulls B groups under
the broker's protocol (sync: version == s; async: staleness <= max_staleness),
trains on them with the same `update_policy` as the co-located loop (the
sampler's behaviour log-probs feed the truncated importance weight), acks them
at step s, publishes v(s+1) and, every `checkpoint_every` steps and on
SIGTERM, checkpoints model, optimiser, RNG and the set of consumed job ids.
It never talks to a sampler.

Resuming tells the broker where the checkpoint left off (`rewind`): groups the
dead trainer consumed after it are offered again, versions it published after
it are forgotten, so every group is trained into the final model exactly once.
"""

from __future__ import annotations

import os
import random
import secrets
import threading
import time
from collections import Counter
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from transformers import PreTrainedModel

from echorl.accounts import holding
from echorl.client import BrokerClient, BrokerError, BrokerRejected
from echorl.config import RunConfig
from echorl.metrics import plot_run, read_metrics, tracking
from echorl.models.loading import load_policy
from echorl.models.lora import (
    base_state,
    load_for_training,
    save_policy,
    version_state,
)
from echorl.models.tokenizer import RunTokenizer
from echorl.protocol import AuditReport, GroupAudit, ScoredGroup, TrainerHello
from echorl.rollout.hf import HFBackend
from echorl.rollout.verify import run_pool
from echorl.tasks import get_task
from echorl.trainer.audit import PastVersions, audit_batch, group_rows
from echorl.trainer.batch import Batch
from echorl.trainer.brokerio import BrokerIO
from echorl.trainer.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from echorl.trainer.colocated import held_out, reference, reward_metrics
from echorl.trainer.distributed import SOLO, World, full_state, join_world, local_device, wrap
from echorl.trainer.flat import FlatStreak, NothingLearned, Run
from echorl.trainer.update import (
    build_optimizer,
    build_scheduler,
    left_out,
    update_policy,
    world_logprobs,
)


def publishable(
    model: PreTrainedModel, version: int, gathered: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What version `version` sends: the full weights on v0 (or `gathered`, the full weights
    an FSDP2 world collected), after that the adapter alone for LoRA. (The I/O process
    refuses weights with a NaN or inf anywhere: NonFiniteWeights.)"""
    if gathered is not None:
        return gathered, {"format": "pt"}
    if version == 0:
        return base_state(model), {"format": "pt"}
    return version_state(model, 0)


WAIT_REPORT_S = 30.0  # a trainer waiting for groups says why this often


class NoSamplers(RuntimeError):
    """The trainer waited for groups with no sampler alive for `launch.stall_timeout_s`."""


def staleness_metrics(groups: list[ScoredGroup], step: int) -> dict:
    stale = [step - g.version for g in groups]
    hist = Counter(stale)
    return {
        "rollout/staleness_mean": sum(stale) / len(stale),
        "rollout/staleness_max": max(stale),
        "rollout/staleness_hist": [hist.get(k, 0) for k in range(max(stale) + 1)],
        "rollout/versions": sorted({g.version for g in groups}),
    }


class DecoupledTrainer:
    """One trainer: its model, optimiser, step and the job ids it has trained on; in a
    torchrun world, one rank of it (rank 0 alone talks to the broker, logs and writes)."""

    def __init__(
        self,
        cfg: RunConfig,
        model_dir: str | Path,
        client: BrokerClient,
        console=None,
        io_cpus: set[int] | None = None,
        world: World = SOLO,
    ):
        self.cfg, self.client, self.world = cfg, client, world
        self.console = console or Console(quiet=not world.leader)
        self.out = Path(cfg.train.out_dir)
        self.model_dir = Path(model_dir)
        self.task = get_task(cfg.task.spec)
        self.step = 0
        self.consumed: list[int] = []
        self.gathered: dict[str, torch.Tensor] | None = None  # FSDP2: the last full weights
        self.eval_model: PreTrainedModel | None = None
        self.prefetched = False  # async: the helper is already pulling this step's groups
        self.lonely_since: float | None = None  # since when no sampler is alive (waiting)
        self.flat = FlatStreak(
            cfg.launch.stall_timeout_s, run=Run.of(cfg)
        )  # steps with no advantage anywhere
        if world.leader:  # pulls, acks, audits and uploads: in a process of their own
            self.io = BrokerIO(client, io_cpus, spill=self.out)

    def start(self, resume: bool) -> None:
        """Load the policy (or the last checkpoint), and bring the broker to the same point."""
        world, t = self.world, self.cfg.train
        ckpt = latest_checkpoint(self.out / "checkpoints") if resume else None
        ckpt = world.broadcast(ckpt)  # rank 0's LATEST (the output folder is shared)
        device = local_device(self.cfg.model.device)
        self.model, self.tokenizer = load_for_training(
            self.model_dir, ckpt and ckpt / "policy", self.cfg.model.lora, device
        )
        if world.leader:
            # Refused (409, both fingerprints named) unless the broker runs this tokenizer and task.
            self.client.hello(
                TrainerHello(
                    tokenizer=RunTokenizer.from_hf(self.tokenizer).fingerprint,
                    task=self.task.name,
                    batch_prompts=t.batch_prompts,
                    group_size=t.group_size,
                )
            )
        # The KL reference is the run's starting policy, also after a resume.
        self.ref_model = reference(self.model_dir, self.cfg)
        if self.ref_model is not None and world.sharded:
            wrap(self.ref_model, world)
        self.wrapped = wrap(self.model, world)  # DDP around the model, or the model sharded
        self.opt = build_optimizer(self.model, self.cfg.optim)
        self.sched = build_scheduler(self.opt, self.cfg.optim)
        if ckpt:
            state = load_trainer_state(ckpt, self.model, self.opt, self.sched, world)
            self.step, self.consumed = state.step, list(state.extra["consumed"])
        if world.leader:
            self.io.open_log(self.out / "metrics.jsonl", self.step, tracking(self.cfg))
            # Evaluation scores in a bounded worker: a verifier that hangs cannot hang the trainer.
            self.scorer = run_pool(self.cfg, RunTokenizer.from_hf(self.tokenizer))
        publish = not resume
        if resume and world.leader:
            reply = self.client.rewind(self.step, self.consumed)
            self.console.print(
                f"resumed at step {self.step}: {reply.returned} groups offered again, "
                f"{reply.regenerated} to regenerate"
            )
            publish = reply.latest_version == self.step - 1
        elif world.leader and self.client.latest() is not None:
            raise BrokerRejected(
                409,
                "the broker already holds weight versions: pass --resume to continue that "
                "run, or start the broker on a fresh data dir",
            )
        if world.broadcast(publish):
            self.publish(self.step)
        if world.leader:
            self.io.wait()
        # Which groups a partial audit checks: unknowable to the samplers, equal on every rank.
        self.spot = random.Random(world.broadcast(secrets.randbits(64)))
        self.past = None  # recent versions' weights, to audit stale groups exactly
        if self.cfg.quarantine.exact_stale and self.cfg.broker.staleness:
            self.past = PastVersions(self.cfg.broker.staleness)
            self.past.record(self.model, self.step)
        if self.step == 0 and world.leader:
            self.io.log({"step": 0, **self.evaluate()})

    def publish(self, version: int) -> None:
        """Send `version` (the weights as they are now) to the broker in the background.
        Under FSDP2 every rank calls it: the weights are gathered to rank 0 first."""
        if self.world.sharded:
            self.gathered = full_state(self.model, self.world)
        if self.world.leader:
            self.io.publish(*publishable(self.model, version, self.gathered), version)

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy, on rank 0 alone: the policy itself, or (FSDP2, where a forward
        pass needs every rank) a plain copy loaded with the last gathered weights."""
        model = self.model
        if self.world.sharded:
            if self.eval_model is None:
                self.eval_model = load_policy(self.model_dir, local_device(self.cfg.model.device))[
                    0
                ]
            self.eval_model.load_state_dict(self.gathered)
            model = self.eval_model
        backend = HFBackend(model, self.tokenizer)
        return held_out(backend, self.task, self.cfg, self.scorer).record()

    def next_groups(self, stop: threading.Event) -> tuple[list[ScoredGroup] | None, int, dict]:
        """Rank 0 pulls step `self.step`'s groups (prefetched in async mode) and every rank
        gets them, and how many auditors the broker has; None when stopped while waiting."""
        cfg, step = self.cfg, self.step
        groups, wait = None, {}
        if self.world.leader:
            if not self.prefetched:
                self.io.prefetch(step, cfg.train.batch_prompts)
            t0 = time.perf_counter()
            every = min(WAIT_REPORT_S, cfg.launch.stall_timeout_s / 2)
            while (got := self.io.batch(step, stop, timeout=every)) is None:
                self.waiting(step, time.perf_counter() - t0)
            groups, wait = got
            wait["trainer/idle_s"] = time.perf_counter() - t0  # what the prefetch left
            self.prefetched = cfg.broker.mode == "async" and step + 1 < cfg.train.steps
            if groups is not None and self.prefetched:
                # Step s+1 takes staleness <= max_staleness relative to s+1 whenever it is
                # pulled; pulling it now hides the wait and the transfer behind this step.
                self.io.prefetch(step + 1, cfg.train.batch_prompts)
        groups, auditors = self.world.broadcast((groups, wait.get("broker/auditors", 0)))
        return groups, auditors, wait

    def waiting(self, step: int, waited: float) -> None:
        """Say why step `step` has no groups after `waited` seconds; raise NoSamplers once no
        sampler has been alive for `launch.stall_timeout_s` (they were all quarantined,
        revoked or lost, and none joined)."""
        try:
            status = self.client.status()
        except BrokerError as e:  # the broker is away: the pull keeps trying, so do we
            self.console.print(f"[yellow]step {step}: no groups for {waited:.0f} s; broker: {e}")
            return
        samplers = status.samplers
        alive = [s for s in samplers if s.state == "alive"]
        gone = Counter({k: n for k, n in status.sampler_counts.items() if k != "alive"})
        why = ", ".join(f"{n} {state}" for state, n in sorted(gone.items()))
        held = holding(status, time.time())
        self.console.print(
            f"[yellow]step {step}: no groups for {waited:.0f} s; {len(alive)} samplers alive"
            + (f" ({why})" if why else "")
            + (f"; waiting on {escape('; '.join(held))}" if held else "")
        )
        if alive:
            self.lonely_since = None
            return
        self.lonely_since = self.lonely_since or time.monotonic() - waited
        if time.monotonic() - self.lonely_since >= self.cfg.launch.stall_timeout_s:
            reasons = sorted({s.reason for s in samplers if s.reason})
            raise NoSamplers(
                f"no sampler alive for {time.monotonic() - self.lonely_since:.0f} s at step "
                f"{step} (launch.stall_timeout_s): {why or 'none ever registered'}"
                + (f"; quarantined because: {'; '.join(reasons)}" if reasons else "")
            )

    def train_step(self, stop: threading.Event) -> dict | None:
        """Step `self.step`: pull, train, ack, publish. None if stopped while waiting for groups.
        Rank 0 returns the step's record, the other ranks an empty one."""
        cfg, step, world = self.cfg, self.step, self.world
        groups, auditors, wait = self.next_groups(stop)
        if groups is None:
            return None
        t0 = time.perf_counter()
        audits: list[GroupAudit] = []
        drawn = self.spot_check(groups, delegate=auditors > 0)

        def audit(gs, batch, logp):
            audits.extend(self.audit(gs, batch, logp, drawn))

        metrics = update_policy(
            self.model,
            self.tokenizer.pad_token_id,
            self.opt,
            self.sched,
            groups,
            cfg,
            step,
            self.ref_model,
            audit=audit,  # the mismatch per sampler is logged even when nobody is quarantined
            world=world,
            wrapped=self.wrapped,
        )
        train_s = time.perf_counter() - t0
        ids = [g.job_id for g in groups]
        self.consumed += ids
        if world.leader:
            metrics |= self.report(audits, step) | mismatch_by_sampler(groups, audits)
            if metrics.get("optim/nonfinite_skipped"):
                self.console.print(
                    f"[yellow]step {step}: {metrics['optim/nonfinite_skipped']:.0f} minibatches "
                    "had a non-finite loss or gradient and were skipped; the batch came from "
                    f"samplers {sorted({g.sampler or '?' for g in groups})}"
                )
            tokens = sum(len(c.token_ids) for g in groups for c in g.completions)
            self.io.ack(ids, step, train_s, tokens, wait.get("trainer/idle_s", 0.0))
        self.publish(step + 1)
        if self.past is not None:
            self.past.record(self.model, step + 1)
        self.step = step + 1
        if not world.leader:
            return {}
        if cfg.broker.mode == "sync":  # the next batch needs these weights: nothing to overlap
            self.io.wait()
        return {
            "step": self.step,
            "time": time.time(),
            **reward_metrics(groups),
            **staleness_metrics(groups, step),
            **metrics,
            **wait,
            "trainer/step_s": train_s,  # the update and the audit (trainer/audit_s)
            "trainer/update_s": train_s - metrics.get("trainer/audit_s", 0.0),
            "trainer/ranks": world.size,
            **refill_rate(wait, self.step * cfg.train.batch_prompts),
            "perf/publish_s": self.io.last_s,  # the last upload that finished
            "perf/publish_bytes": self.io.last_bytes,  # as the samplers download it
            **self.swarm(),
        }

    def audit(
        self, groups: list[ScoredGroup], batch: Batch, logp: torch.Tensor | None, drawn: set[int]
    ) -> list[GroupAudit]:
        """The audit of the `drawn` ones among `groups` (the rows of `batch`), from the
        current policy's log-probs `logp` of them (None for flat groups: no pass covered
        them) and, for a stale group, its own version's (`quarantine.exact_stale`)."""
        temperature = self.cfg.sampling.temperature or 1.0
        picked = [g.job_id in drawn for g in groups]
        if not any(picked):
            return []
        if not all(picked):
            rows = group_rows(groups, picked).to(batch.input_ids.device)
            groups, batch = [g for g, p in zip(groups, picked) if p], batch.rows(rows)
            logp = None if logp is None else logp[rows]
        if logp is None:  # the current policy's pass over the rows no older version scores
            logp = torch.zeros_like(batch.behaviour_logp)
            now = group_rows(
                groups, [self.past is None or not self.past.recomputes(g) for g in groups]
            )
            if len(now):
                now = now.to(logp.device)
                logp[now] = world_logprobs(self.model, batch.rows(now), temperature, self.world)
        exact = [g.version == self.step for g in groups]  # the policy before this update
        if self.past is not None:  # stale groups against their own version
            exact = [e or self.past.recomputes(g) for e, g in zip(exact, groups)]
            logp = self.past.logprobs(self.model, groups, batch, logp, temperature)
        audits = audit_batch(groups, batch, logp, self.cfg.quarantine.tolerance)
        return [a.model_copy(update={"exact": e}) for a, e in zip(audits, exact)]

    def spot_check(self, groups: list[ScoredGroup], delegate: bool = False) -> set[int]:
        """The job ids audited this step: every group the update's own pass covers, and each
        group whose audit needs a pass of its own (flat, or stale under exact_stale) with
        probability `quarantine.audit_fraction`, drawn with the run's secret seed (the same
        on every rank). `delegate` (an auditor is alive): none of the latter, which stay
        open at the broker for the auditors."""
        share = 0.0 if delegate else self.cfg.quarantine.audit_fraction

        def own_pass(g: ScoredGroup) -> bool:
            return left_out(g, self.cfg) or (self.past is not None and self.past.recomputes(g))

        return {
            g.job_id for g in groups if share >= 1 or not own_pass(g) or self.spot.random() < share
        }

    def report(self, audits: list[GroupAudit], step: int) -> dict[str, float]:
        """Send the samplers' log-prob audit (the batch's audited groups) to the broker, which
        quarantines a sampler far off (docs/concepts/trust.md); return the batch's figures. The
        broker's answer arrives while the next step trains: `audit/quarantined` counts the
        samplers quarantined by the reports answered since the last step."""
        if not self.cfg.quarantine.enabled:
            return {}
        if not audits:  # none on-policy, and the rest left to the auditors
            return {"audit/groups": 0.0}
        self.io.audit(AuditReport(step=step, groups=audits))
        self.io.poll()
        quarantined, self.io.quarantined = self.io.quarantined, {}
        for sid, why in quarantined.items():
            self.console.print(f"[yellow]sampler {sid} quarantined: {why}")
        tokens = max(1, sum(a.tokens for a in audits))
        return {
            "audit/groups": float(len(audits)),  # below the batch's when audit_fraction < 1
            "audit/logprob_mean_abs": sum(a.abs_delta for a in audits) / tokens,
            "audit/logprob_kl": sum(a.kl for a in audits) / tokens,
            "audit/logprob_beyond": sum(a.beyond for a in audits) / tokens,
            "audit/quarantined": float(len(quarantined)),
        }

    def swarm(self, every: int = 10) -> dict[str, float]:
        """Samplers alive and their speed, asked of the broker every `every` steps (a status
        call costs the broker a scan of its tables; between asks the last answer stands)."""
        if self.step % every == 1 or not self.io.swarm:
            self.io.ask_swarm()  # answered while the next step trains
        self.io.poll()
        return self.io.swarm

    def checkpoint(self) -> None:
        """Every rank calls it (FSDP2 gathers to rank 0, which writes)."""
        if self.world.leader:  # v_step is at the broker before checkpoint `step` exists:
            self.io.wait()  # a resume relies on it (and on the acks before it, in order)
        save_checkpoint(
            self.out / "checkpoints",
            self.step,
            self.model,
            self.tokenizer,
            self.opt,
            self.sched,
            extra={"consumed": self.consumed},
            world=self.world,
        )

    def run(self, stop: threading.Event) -> Path:
        """Train until `train.steps` or `stop` (SIGTERM: checkpoint, then return). In a world
        the other ranks follow rank 0's stop: its pull answers None to everyone."""
        cfg, leader = self.cfg.train, self.world.leader
        t_start = time.perf_counter()
        while self.step < cfg.steps and not (leader and stop.is_set()):
            record = self.train_step(stop)
            if record is None:
                break
            if leader:
                self.log_step(record, t_start)
                self.watch_flat(record)
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.checkpoint()
        self.checkpoint()
        if not leader:
            return self.out
        self.io.close()  # the last upload and log line land; a prefetch in flight is dropped
        self.scorer.close()
        if self.step == cfg.steps:
            save_policy(self.eval_model or self.model, self.tokenizer, self.out / "policy")
        plot_run(read_metrics(self.out / "metrics.jsonl"), self.out, f"{self.cfg.broker.mode}")
        return self.out

    def watch_flat(self, record: dict) -> None:
        """Warn of a streak of flat steps (`FlatStreak`). When it has lasted too long, log
        why as the last metrics record (`trainer/gave_up`: `echorl run` reads it and does
        not restart a trainer that cannot learn), close the I/O process so that the record
        lands, and raise NothingLearned."""
        try:
            warning = self.flat.see(record)
        except NothingLearned as e:
            self.io.log({"step": self.step, "trainer/gave_up": str(e)})
            self.io.close()
            self.scorer.close()
            raise
        if warning:
            self.console.print(f"[yellow]step {self.step}: {escape(warning)}")

    def log_step(self, record: dict, t_start: float) -> None:
        cfg = self.cfg.train
        record["trainer/wall_s"] = time.perf_counter() - t_start
        if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
            record |= self.evaluate()
        if self.step == cfg.steps:
            record |= self.evaluate()
        self.io.log(
            record,
            f"step {self.step}/{cfg.steps}  reward {record['reward/mean']:.3f}  "
            f"staleness {record['rollout/staleness_mean']:.2f}  "
            f"idle {record['trainer/idle_s']:.2f}s  train {record['trainer/step_s']:.2f}s",
        )


def refill_rate(pulled: dict, consumed: int) -> dict[str, float]:
    """Dynamic sampling's share of flat groups among those scored for training, so far."""
    flat = pulled.get("broker/flat_refilled", 0)
    return {"rollout/refill_rate": flat / (flat + consumed)} if flat else {}


def run_trainer(
    cfg: RunConfig,
    model_dir: str | Path,
    client: BrokerClient,
    console: Console | None = None,
    resume: bool = False,
    stop: threading.Event | None = None,
    io_cpus: set[int] | None = None,
) -> Path:
    """The trainer process, or (under torchrun) one rank of it."""
    world = join_world(cfg.train.parallel, cfg.model.device)
    try:
        trainer = DecoupledTrainer(
            cfg, model_dir, client, console if world.leader else None, io_cpus, world
        )
        if hasattr(os, "sched_getaffinity"):
            cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
            where = (
                f" ({world.size} rank{'s' * (world.size > 1)}, {world.strategy})"
                if world.started
                else ""
            )
            trainer.console.print(f"trainer on cores {cores}{where}")
        trainer.start(resume)
        folder = trainer.run(stop or threading.Event())
    except BaseException:
        world.close(together=False)
        raise
    world.close()
    return folder


def mismatch_by_sampler(groups: list[ScoredGroup], audits: list[GroupAudit]) -> dict[str, float]:
    """Per sampler of this batch, its behaviour log-probs against the trainer's on its tokens:
    `mismatch/ID/mean_abs` (mean |sampler - trainer|) and `mismatch/ID/kl` (mean of
    sampler - trainer, an estimate of KL(sampler || trainer)). Numerics (a bf16 sampler, another
    engine) and staleness show here; the truncated IS weight corrects for both."""
    owner = {g.job_id: g.sampler or "unknown" for g in groups}
    sums: dict[str, list[float]] = {}
    for a in audits:
        s = sums.setdefault(owner.get(a.job_id, "unknown"), [0.0, 0.0, 0.0])
        s[0], s[1], s[2] = s[0] + a.tokens, s[1] + a.abs_delta, s[2] + a.kl
    out = {}
    for sampler, (tokens, abs_delta, kl) in sums.items():
        if tokens:
            out[f"mismatch/{sampler}/mean_abs"] = abs_delta / tokens
            out[f"mismatch/{sampler}/kl"] = kl / tokens
    return out
