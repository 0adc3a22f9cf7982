"""`echorl run`: the whole swarm on this machine, each role its own OS process.

    echorl run examples/async.toml            # broker + samplers + trainer, live view, report
    echorl run examples/sync.toml -o launch.samplers=2

The launcher warms the tiny model up (unless `model.path` names a checkpoint),
writes the resolved config to `OUT/config.yaml`, and starts `echorl broker`,
`launch.samplers` x `echorl sampler` and `echorl trainer` with that one file,
exactly as they would be started by hand on separate machines. Each child logs
to `OUT/logs/ROLE.log` (appended to across restarts). While the trainer runs, a
live table shows step, reward, version, staleness, samplers alive and tokens/s (where
the output is no terminal, a plain line every 15 s: step, reward, version, samplers, ETA);
Ctrl-C (or SIGTERM) stops every child cleanly (the trainer checkpoints first).

The launcher supervises: a child that dies is started again after a backoff (1,
2, 4 ... 30 s): a sampler as it was, the broker on the same port and data dir
(its state is durable), the trainer with --resume (its last checkpoint; the
broker offers again what it trained on since). One that dies
`launch.max_restarts` times ends the run, and so does a run with no trainer
record and no new version for `launch.stall_timeout_s`, with a report of each
process's last complaint: it never sits at step 0. A trainer that gave up because every
group was flat (nothing is learned; its last metrics record says so) is not restarted:
the run ends with its reason. `--resume` keeps the port.
At the end: `OUT/metrics.jsonl`, the PNG plots, and a summary table.

The launcher only starts, watches and stops processes; it knows nothing of
the protocol.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from echorl.broker.capacity import describe
from echorl.config import RunConfig
from echorl.metrics import MetricsTail, plot_run, read_metrics
from echorl.progress import LineSteps, draws_live
from echorl.protocol import Capacity
from echorl.trainer.flat import FlatStreak, Run, is_flat


@dataclass
class Role:
    """One child process: how to start it, and how often it was restarted."""

    name: str
    args: tuple[str, ...]
    cpus: set[int] | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    due: float = 0.0  # monotonic time of the next restart, while it is dead
    retired: bool = False  # refused by the broker: never started again
    ranks: int | None = None  # started under torchrun with this many ranks; None: plainly

    @property
    def command(self) -> list[str]:
        return echorl_command(self.args, self.ranks)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Swarm:
    """The child processes of one run, and where they log (appended across restarts)."""

    out: Path
    url: str
    env: dict[str, str]
    roles: dict[str, Role] = field(default_factory=dict)

    @property
    def broker(self) -> subprocess.Popen | None:
        return self.roles["broker"].proc if "broker" in self.roles else None

    @property
    def trainer(self) -> subprocess.Popen | None:
        return self.roles["trainer"].proc if "trainer" in self.roles else None

    @property
    def samplers(self) -> list[subprocess.Popen]:
        return [r.proc for n, r in self.roles.items() if n.startswith("sampler-") and r.proc]

    @property
    def auditors(self) -> list[subprocess.Popen]:
        return [r.proc for n, r in self.roles.items() if n.startswith("auditor-") and r.proc]

    def spawn(
        self, name: str, *args: str, cpus: set[int] | None = None, ranks: int | None = None
    ) -> subprocess.Popen:
        """Start `echorl ARGS` as role NAME (under torchrun with `ranks` ranks, if given),
        logging to logs/NAME.log, on the cores `cpus`."""
        role = self.roles.setdefault(name, Role(name, args, cpus))
        role.args, role.cpus, role.ranks = args, cpus, ranks
        return self.start(role)

    def start(self, role: Role) -> subprocess.Popen:
        with (self.out / "logs" / f"{role.name}.log").open("a") as log:
            if role.restarts:
                log.write(f"--- echorl run: restart {role.restarts} of {role.name} ---\n")
                log.flush()
            role.proc = subprocess.Popen(
                role.command,
                preexec_fn=None
                if role.cpus is None
                else (lambda: os.sched_setaffinity(0, role.cpus)),
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the launcher only; it stops children
            )
        return role.proc

    def tell_lost(self, name: str) -> None:
        tell_lost(self.url, self.env["ECHORL_TRAINER_TOKEN"], name)

    def reap(self, role: Role) -> None:
        """Kill what is left of a dead role's process group (its helpers: parser and verifier
        workers, multiprocessing's resource tracker), so nothing of it outlives it."""
        if role.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(role.proc.pid, signal.SIGKILL)  # its own session: pgid == pid

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the trainer (it checkpoints), then the samplers (they hand back their leases)
        and auditors, then the broker; SIGKILL whatever is still there after `timeout`."""
        for group in ([self.trainer], self.samplers + self.auditors, [self.broker]):
            procs = [p for p in group if p is not None and p.poll() is None]
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for role in self.roles.values():
            self.reap(role)


def core_split(cfg: RunConfig) -> tuple[set[int], set[int]] | None:
    """(the trainer's cores, everyone else's) under `launch.pin_cores`, or None when pinning is
    off, unsupported (not Linux) or there are no cores left over for the rest."""
    if not cfg.launch.pin_cores or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    n = cfg.launch.trainer_threads * cfg.launch.trainer_procs
    if len(cores) <= n:
        return None
    return set(cores[:n]), set(cores[n:])


def split_auditors(
    others: set[int] | None, n: int
) -> tuple[set[int] | None, list[set[int] | None]]:
    """(the broker's, samplers' and uploads' cores, each of `n` auditors' cores): an auditor
    gets a core of its own (the last ones) where the rest keep at least one, as a spare
    machine would be; otherwise it shares theirs."""
    if others is None or len(others) <= n:
        return others, [others] * n
    own = [{c} for c in sorted(others)[len(others) - n :]]
    return others - set().union(*own), own


def tell_lost(url: str, token: str, name: str) -> None:
    """Tell the broker at `url` that sampler process `name` died: its leases go back to the
    queue at once (best effort: a broker that does not answer releases them after
    broker.lease_silence_s anyway)."""
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(
            url + "/v1/samplers/lost",
            json={"name": name},
            headers={"Authorization": f"Bearer {token}"},
            timeout=5.0,  # a broker on a busy machine (a sampler restarting beside it) is slow
        )


def echorl_command(args: tuple[str, ...], ranks: int | None = None) -> list[str]:
    """`echorl ARGS` as this Python runs it; under torchrun with `ranks` ranks if given."""
    if ranks is None:
        return [sys.executable, "-m", "echorl.cli", *args]
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return [sys.executable, *torchrun, "-m", "echorl.cli", *args]


def trainer_ranks(cfg: RunConfig) -> int | None:
    """The trainer's torchrun ranks: for more than one, and for FSDP2 (a world even of one
    rank); None: a plain process."""
    procs = cfg.launch.trainer_procs
    return procs if procs > 1 or cfg.train.parallel == "fsdp2" else None


def _cpu_list(cores: set[int]) -> str:
    return ",".join(map(str, sorted(cores)))


def free_port(wanted: int = 0) -> int:
    """`wanted` if nothing listens there, else any free port."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", wanted))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the broker exited with code {proc.returncode}")
        try:
            httpx.get(url + "/healthz", timeout=1.0).raise_for_status()
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"the broker did not answer {url}/healthz within {timeout:.0f} s")


def previous_port(out: Path) -> int:
    """The port the run at `out` used (a resumed run keeps it, so that samplers started by
    hand find the broker where it was); 0 if unknown."""
    try:
        return int(yaml.safe_load((out / "config.yaml").read_text())["broker"]["port"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return 0


def resolved_config(cfg: RunConfig, out: Path, model_dir: Path, port: int) -> Path:
    """The run's one config file, as every child reads it."""
    data = cfg.model_dump(mode="json")
    data["model"]["path"] = str(model_dir)
    data["train"]["out_dir"] = str(out)
    data["broker"] |= {"data_dir": str(out / "broker"), "port": port, "host": "127.0.0.1"}
    data["broker"] |= {"url": None, "insecure_no_auth": False}
    data["broker"] |= {"trainer_token": None, "sampler_token": None}  # from the environment
    data["broker"]["viewer_token"] = None
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


ACCESS = "access.json"  # in a run's folder: where its broker is and its tokens (mode 0600)


def write_access(out: Path, url: str, env: dict[str, str]) -> None:
    """The broker's URL and this launch's tokens, readable by the owner alone: `echorl status
    --run OUT` reads them, and a sampler started by hand takes its token from there."""
    access = {
        "url": url,
        "trainer_token": env["ECHORL_TRAINER_TOKEN"],
        "sampler_token": env["ECHORL_SAMPLER_TOKEN"],
    }
    path = out / ACCESS
    path.unlink(missing_ok=True)  # made anew with mode 0600, whatever an older one had
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(access, f, indent=1)


def read_access(out: Path) -> dict[str, str]:
    """What `write_access` wrote for the run at `out`; ValueError says what is missing."""
    path = out / ACCESS
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{path} does not exist: is {out} the folder of an `echorl run`?"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read: {e}") from None


def launch(
    cfg: RunConfig, model_dir: Path, console: Console, resume: bool = False
) -> tuple[int, Path]:
    """Run the swarm until the trainer finishes; returns (exit code, output folder)."""
    out = Path(cfg.train.out_dir)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    port = free_port(previous_port(out) if resume else cfg.broker.port)
    config = resolved_config(cfg, out, model_dir, port)
    resumed_at, marker = 0, out / "checkpoints" / "LATEST"  # trainer/checkpoint.py's, read
    if resume and marker.is_file():  # without torch
        ckpt = marker.parent / marker.read_text().strip()
        resumed_at = int(ckpt.name.removeprefix("step_"))
        console.print(
            f"resuming from {ckpt} (step {resumed_at} of {cfg.train.steps}): the steps after "
            "it are trained again, none twice",
            soft_wrap=True,  # a path: copyable
            markup=False,
        )
    env = os.environ | {
        "ECHORL_TRAINER_TOKEN": secrets.token_hex(16),
        "ECHORL_SAMPLER_TOKEN": secrets.token_hex(16),
        "HF_HUB_OFFLINE": "1",
    }
    if cfg.broker.viewer_token:  # to the broker by its environment, never in config.yaml
        env["ECHORL_VIEWER_TOKEN"] = cfg.broker.viewer_token
    split = core_split(cfg)
    trainer_cores, other_cores = split or (None, None)
    n = cfg.launch.auditors
    other_cores, auditor_cores = split_auditors(other_cores, n)
    if split:
        console.print(
            f"cores: trainer {_cpu_list(trainer_cores)}; broker, samplers, uploads "
            f"{_cpu_list(other_cores)}"
            + (f"; auditors {_cpu_list(set().union(*auditor_cores))}" if n else "")
        )
        own = os.sched_getaffinity(0)
        os.sched_setaffinity(0, other_cores)  # the launcher's own watching, too
    swarm = Swarm(out, f"http://127.0.0.1:{port}", env)
    write_access(out, swarm.url, env)
    stop = []
    handler = signal.signal(signal.SIGTERM, lambda *_: stop.append("SIGTERM"))
    try:
        swarm.spawn("broker", "broker", "-c", str(config), cpus=other_cores)
        try:
            wait_healthy(swarm.url, swarm.broker)
        except RuntimeError as e:  # it refused the run (its reason is in its log) or hung
            said = (out / "logs" / "broker.log").read_text(errors="replace").strip()
            console.print(f"[red]{e}; its log ends:[/red]")
            console.print("\n".join(said.splitlines()[-6:]) or "(nothing)", markup=False)
            return 2, out
        common = ("--broker", swarm.url, "-c", str(config))
        slowdowns = cfg.launch.sampler_slowdowns
        for k in range(cfg.launch.samplers):
            swarm.spawn(
                f"sampler-{k}",
                "sampler",
                *common,
                "--name",
                f"sampler-{k}",
                "--threads",
                str(cfg.launch.sampler_threads),
                "--metrics",
                str(out / "samplers" / f"sampler-{k}.jsonl"),
                *(["-o", f"sampler.slowdown={slowdowns[k % len(slowdowns)]}"] if slowdowns else []),
                cpus=other_cores,
            )
        for k in range(cfg.launch.auditors):
            swarm.spawn(
                f"auditor-{k}",
                "auditor",
                *common,
                "--name",
                f"auditor-{k}",
                "--threads",
                "1",
                "--metrics",
                str(out / "auditors" / f"auditor-{k}.jsonl"),
                cpus=auditor_cores[k],
            )
        trainer_args = ("trainer", *common, "-o", f"model.threads={cfg.launch.trainer_threads}")
        swarm.spawn(
            "trainer",
            *trainer_args,
            *(["--resume"] if resume else []),
            *(["--io-cpus", _cpu_list(other_cores)] if split else []),
            cpus=trainer_cores,
            ranks=trainer_ranks(cfg),
        )
        code = watch(swarm, cfg, console, stop, quiet_through=resumed_at)
        keep_capacity(swarm)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the swarm (the trainer checkpoints first)")
        code = 130
    finally:
        swarm.stop()
        signal.signal(signal.SIGTERM, handler)
        if split:
            os.sched_setaffinity(0, own)
    return code, out


def keep_capacity(swarm: Swarm) -> None:
    """The broker's provisioning figures as the run ends, in capacity.json for the summary."""
    try:
        st = httpx.get(
            swarm.url + "/v1/status",
            params={"limit": 0},
            headers={"Authorization": f"Bearer {swarm.env['ECHORL_TRAINER_TOKEN']}"},
            timeout=5.0,
        ).json()
    except (httpx.HTTPError, ValueError):
        return
    if st.get("capacity"):
        (swarm.out / "capacity.json").write_text(json.dumps(st["capacity"], indent=1))


def watch(
    swarm: Swarm, cfg: RunConfig, console: Console, stop: list, quiet_through: int = 0
) -> int:
    """Show the view (`shown`) and supervise the children until the trainer finishes (0).
    A child that dies is started again after a backoff (the trainer with --resume); one
    that dies `launch.max_restarts` times, a trainer that gave up (every group flat: its
    last metrics record says why), or a run with no progress for `launch.stall_timeout_s`,
    ends the run with the reason (1). The view's warnings (flat steps) are printed, but for
    steps up to `quiet_through` (a resumed run's earlier sessions: said then)."""
    view = LiveView(swarm, cfg, quiet_through)
    with shown(console, view) as show:
        while True:
            if stop:
                return 143
            trainer = swarm.roles["trainer"]
            dead = not trainer.alive  # seen before the metrics are read: its last record is in
            view.update()
            for warning in view.take_warnings():
                console.print(warning, style="yellow", markup=False)
            if dead and trainer.proc.returncode == 1 and view.gave_up:  # a restart cannot help
                console.print(f"the trainer stops: {view.gave_up}", style="red", markup=False)
                return 1
            if dead and trainer.proc.returncode == 0 and not trainer.due:
                break
            for role in swarm.roles.values():
                if role.retired or role.alive:
                    continue
                if role is trainer and role.proc.returncode == 0 and not role.due:
                    continue  # it finished since `dead` was read: the next round ends the run
                if (code := supervise(swarm, role, cfg, console)) is not None:
                    return code
            show()
            stalled = time.monotonic() - view.progressed
            if stalled > cfg.launch.stall_timeout_s:
                console.print(stall_report(swarm, view, stalled), style="red", markup=False)
                return 1
            time.sleep(0.5)
        show()
    console.print()
    return 0


RUN_LINE_EVERY_S = 15.0  # a plain line this often where there is no live table


@contextmanager
def shown(console: Console, view: LiveView) -> Iterator[Callable[[], None]]:
    """How `watch` shows the view: yields a function that redraws the live table where rich
    draws one, and elsewhere (CI, nohup, a file) prints a plain line at most every
    `RUN_LINE_EVERY_S`: `echorl run: step 12/40 reward 0.512 version 12 samplers 2/2 eta ...`."""
    if draws_live(console):
        with Live(console=console, refresh_per_second=2) as live:
            yield lambda: live.update(view.table())
        return
    total = view.cfg.train.steps
    with LineSteps(console, "echorl run", total, None, RUN_LINE_EVERY_S) as lines:
        yield lambda: lines.update(view.step, view.note())


REFUSED = 2  # `echorl sampler`'s (and auditor's) exit code when the broker refuses it (403, 401, 409 at start)


def supervise(swarm: Swarm, role: Role, cfg: RunConfig, console: Console) -> int | None:
    """A dead child: schedule its restart (backoff 1, 2, 4 ... 30 s), or start it when due; a
    sampler the broker refused stays down. A broker that dies (or hangs) while it starts
    died: the next round restarts it again, counted. Returns 1 when one has died too often
    to go on."""
    now = time.monotonic()
    if not role.due:
        code = role.proc.returncode
        swarm.reap(role)
        if role.name.startswith("sampler-"):
            swarm.tell_lost(role.name)  # its leases back in the queue now, not seconds on
        if role.name.startswith(("sampler-", "auditor-")) and code == REFUSED:
            role.retired = True
            console.print(
                f"[yellow]{role.name} was refused by the broker (revoked or quarantined; see "
                f"{swarm.out / 'logs' / role.name}.log); not restarted"
            )
            return None
        if role.restarts >= cfg.launch.max_restarts:
            console.print(
                f"[red]{role.name} exited ({code}) after {role.restarts} restarts; stopping the "
                f"run (launch.max_restarts). See {swarm.out / 'logs' / role.name}.log"
            )
            return 1
        role.restarts += 1
        delay = min(30.0, 2.0 ** (role.restarts - 1))
        role.due = now + delay
        console.print(
            f"[yellow]{role.name} exited ({code}); restarting it in {delay:.0f} s "
            f"(restart {role.restarts})"
        )
        return None
    if now >= role.due:
        role.due = 0.0
        if role.name == "trainer" and "--resume" not in role.args:
            role.args = (*role.args, "--resume")  # from its last checkpoint
        swarm.start(role)
        if role.name == "broker":
            try:
                wait_healthy(swarm.url, role.proc)
            except RuntimeError as e:
                console.print(f"[yellow]the restarted broker did not come up: {e}")
                if role.proc.poll() is None:  # hung: it is stopped, then counted as dead
                    role.proc.kill()
                    role.proc.wait()
    return None


class LiveView:
    """The live table: the trainer's newest metrics (followed, never re-read) and, every few
    seconds, the broker's view of the swarm (a status call scans the broker's tables).
    From the metrics, too: warnings of flat steps, and why the trainer gave up, if it did."""

    STATUS_EVERY_S = 2.0

    def __init__(self, swarm: Swarm, cfg: RunConfig, quiet_through: int = 0):
        self.swarm, self.cfg, self.quiet_through = swarm, cfg, quiet_through
        self.tail = MetricsTail(swarm.out / "metrics.jsonl")
        self.last: dict = {}
        self.recent: deque[float] = deque(maxlen=10)  # the last 10 steps' rewards
        self.alive, self.version, self.speed = [], "?", 0.0
        self.asked = float("-inf")
        self.progressed = time.monotonic()  # the last trainer record or published version
        self.flat = FlatStreak(run=Run.of(cfg))  # warns only: giving up is the trainer's to decide
        self.warnings: list[str] = []  # not yet printed
        self.gave_up: str | None = None  # the trainer's reason, from its last record
        self.verifier_failed = 0  # completions the task's verifier failed on (scored 0)

    @property
    def step(self) -> int:
        return self.last.get("step", 0)

    def update(self) -> None:
        """Read the metrics appended since the last call and, when due, the broker's status."""
        records = self.tail.read()
        if records:
            self.progressed = time.monotonic()
        if self.tail.restarted:
            self.last, self.recent = {}, deque(maxlen=10)
            self.flat = FlatStreak(run=Run.of(self.cfg))
        for r in records:
            self.take(r)
        if time.monotonic() - self.asked < self.STATUS_EVERY_S:
            return
        self.asked = time.monotonic()
        try:
            st = httpx.get(
                self.swarm.url + "/v1/status",
                headers={"Authorization": f"Bearer {self.swarm.env['ECHORL_TRAINER_TOKEN']}"},
                timeout=1.0,
            ).json()
            self.alive = [s for s in st["samplers"] if s["state"] == "alive"]
            if isinstance(self.version, int) and st["latest_version"] != self.version:
                # a published version is progress too
                self.progressed = time.monotonic()
            self.version = st["latest_version"]
            self.speed = sum(s["tokens_per_s"] or 0 for s in self.alive)
            failed = sum(n for kind, n in st["verifier"].items() if kind != "refused")
            if failed and not self.verifier_failed:  # said once; the count is in the view
                self.warnings.append(verifier_warning(failed, st.get("verifier_error")))
            self.verifier_failed = failed
        except (httpx.HTTPError, ValueError, KeyError):
            self.alive, self.version, self.speed = [], "?", 0.0

    def take(self, record: dict) -> None:
        """One metrics record: a step's (the table's figures, the flat streak) or the
        trainer's last words (`trainer/gave_up`)."""
        if "trainer/gave_up" in record:
            self.gave_up = record["trainer/gave_up"]
        if "reward/mean" not in record:
            return
        self.last, self.gave_up = record, None  # a step after it: the trainer went on
        self.recent.append(record["reward/mean"])
        if (warning := self.flat.see(record)) and record["step"] > self.quiet_through:
            self.warnings.append(f"step {record['step']}: {warning}")

    def take_warnings(self) -> list[str]:
        said, self.warnings = self.warnings, []
        return said

    def note(self) -> str:
        """The table's main figures, for a plain line."""
        recent = self.recent
        reward = f"{sum(recent) / len(recent):.3f}" if recent else "-"
        return (
            f"reward {reward} version {self.version} "
            f"samplers {len(self.alive)}/{len(self.swarm.samplers)} {self.speed:.0f} tok/s"
            + (f" verifier errors {self.verifier_failed}" if self.verifier_failed else "")
        )

    def table(self) -> Table:
        last, recent, cfg = self.last, self.recent, self.cfg
        table = Table(title=f"echorl run ({cfg.broker.mode}, {cfg.task.name})")
        for col in (
            "step",
            "reward (last 10)",
            "version",
            "staleness mean/max",
            "samplers",
            "tokens/s",
            "trainer idle s",
            "verifier errors",
        ):
            table.add_column(col)
        table.add_row(
            f"{last.get('step', 0)}/{cfg.train.steps}",
            f"{sum(recent) / len(recent):.3f}" if recent else "-",
            str(self.version),
            f"{last['rollout/staleness_mean']:.2f}/{last['rollout/staleness_max']}"
            if last
            else "-",
            f"{len(self.alive)}/{len(self.swarm.samplers)}",
            f"{self.speed:.0f}",
            f"{last['trainer/idle_s']:.2f}" if last else "-",
            str(self.verifier_failed),
        )
        return table


def verifier_warning(failed: int, error: str | None) -> str:
    return (
        f"the task's verifier failed on {failed} completions, each scored 0"
        + (f"; the first raised {error}" if error else "")
        + " (see logs/broker.log)"
    )


def stall_report(swarm: Swarm, view: LiveView, stalled: float) -> str:
    """Why the run is stopped for making no progress: where it stood, and each process's last
    complaint (the broker's reasons reach the samplers' and trainer's logs)."""
    step = view.last.get("step", 0)
    lines = [
        f"no trainer step or new version for {stalled:.0f} s (launch.stall_timeout_s; last "
        f"step {step}/{view.cfg.train.steps}, samplers alive {len(view.alive)}/{len(swarm.samplers)}): "
        "stopping the run. Last words:"
    ]
    for log in sorted((swarm.out / "logs").glob("*.log")):
        said = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
        loud = [x for x in said if any(w in x for w in ("ERROR", "WARNING", "rror", "refused"))]
        for line in (loud or said)[-2:]:
            lines.append(f"  {log.stem}: {line.strip()[:300]}")
    return "\n".join(lines)


def model_out(out: Path) -> str:
    """Where a run's trained policy is, and how to load it (printed at every run's end)."""
    policy = out / "policy"
    if not (policy / "config.json").is_file():
        return f"no trained policy in {policy} yet (checkpoints: {out / 'checkpoints'})"
    return (
        f"the trained policy: {policy} (a Hugging Face folder; a LoRA run's adapters are "
        "merged in, and kept alone in policy/adapter):\n"
        "  from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast\n"
        f'  model = AutoModelForCausalLM.from_pretrained("{policy}")\n'
        f'  tokenizer = PreTrainedTokenizerFast.from_pretrained("{policy}")'
    )


def run_wall_s(train: list[dict]) -> float:
    """The trainer's seconds over the whole run: each session's (`trainer/wall_s` counts from
    its process's start, so a resumed run's restarts from 0; a session's last record kept is
    its checkpoint's step, what it logged after that having been dropped on resume)."""
    total, last = 0.0, 0.0
    for r in train:
        if r["trainer/wall_s"] < last:  # a new session
            total += last
        last = r["trainer/wall_s"]
    return total + last


def summarise(out: Path, console: Console) -> dict:
    """The end-of-run table; also (re)draws the plots."""
    records = read_metrics(out / "metrics.jsonl")
    train = [r for r in records if "reward/mean" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    plots = plot_run(records, out, "decoupled GRPO")
    # A flat step (every group's rewards equal) has no advantage: it taught nothing.
    summary: dict = {"steps": len(train), "flat_steps": sum(map(is_flat, train))}
    if train:
        k = max(1, min(10, len(train) // 2))
        wall = run_wall_s(train)
        summary |= {
            "reward_first": sum(r["reward/mean"] for r in train[:k]) / k,
            "reward_last": sum(r["reward/mean"] for r in train[-k:]) / k,
            "wall_s": wall,
            "steps_per_s": len(train) / wall,
            "staleness_mean": sum(r["rollout/staleness_mean"] for r in train) / len(train),
            "staleness_max": max(r["rollout/staleness_max"] for r in train),
            "dropped_stale": sum(r["broker/groups_dropped_stale"] for r in train),
            "trainer_busy": sum(r["trainer/step_s"] for r in train) / wall,
        }
        if wasted := train[-1].get("broker/wasted_tokens"):  # sync, over-provisioned
            summary["wasted_tokens"] = wasted
        if failed := train[-1].get("verifier/errors"):
            summary["verifier_errors"] = failed
    capacity = None
    if (out / "capacity.json").is_file():
        capacity = Capacity.model_validate_json((out / "capacity.json").read_text())
        summary |= {
            "needed_tokens_per_s": capacity.needed_tokens_per_s,
            "swarm_tokens_per_s": capacity.swarm_tokens_per_s,
        }
        if capacity.dissemination_s is not None:
            summary["dissemination_s"] = capacity.dissemination_s
        if capacity.staleness_to_overlap is not None:
            summary["staleness_to_overlap"] = capacity.staleness_to_overlap
    if evals:
        summary |= {
            "eval_first": evals[0]["eval/accuracy"],
            "eval_last": evals[-1]["eval/accuracy"],
        }
        if "eval/pass1" in evals[0]:
            summary |= {
                "pass1_first": evals[0]["eval/pass1"],
                "pass1_last": evals[-1]["eval/pass1"],
            }
    table = Table(title="run summary")
    table.add_column("")
    table.add_column("value")
    for key, value in summary.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    if summary["flat_steps"]:
        console.print(
            f"[yellow]{summary['flat_steps']} of {len(train)} steps had every group flat (all "
            "rewards equal): they taught the policy nothing"
        )
    if summary.get("verifier_errors"):
        error = next(
            (r["verifier/first_error"] for r in train if "verifier/first_error" in r), None
        )
        console.print(f"[yellow]{escape(verifier_warning(summary['verifier_errors'], error))}")
    for line in describe(capacity) if capacity else []:
        console.print(line, markup=False)
    console.print("plots: " + ", ".join(str(p) for p in plots))
    return summary
