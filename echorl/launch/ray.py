"""`echorl launch ray`: the swarm's roles as Ray actors on an existing Ray cluster.

    ray start --head                                      # or a cluster you already run
    echorl launch ray examples/async.toml --address auto  # broker, trainer, samplers
    echorl launch scale --samplers 4 --address auto       # while it runs, from any shell

Each role is an actor that runs the same `echorl broker | sampler | trainer` command as
`echorl run` and as a person would by hand, with the resources its `launch.ray.ROLE`
section asks for (`num_cpus`, `num_gpus`, custom resources such as `{edge = 1}` that
place it on a kind of machine). The actor streams the command's output to the console
(prefixed with the role) and to `OUT/logs/ROLE.log` on its node.

- A sampler actor that dies (its node lost, the actor or its command killed) is
  restarted by Ray; the broker re-leases the jobs it held. The trainer's actor is
  restarted too, and resumes from its last checkpoint (`--resume`), as under `echorl
  run`. The broker's is not restarted: its state lives on its node's disk.
- `echorl launch scale --samplers N` tells the running launcher (a named actor holds the
  wanted count) to start or stop samplers; a stopped sampler hands its leases back.
- Ctrl-C, SIGTERM, or the trainer finishing stops the samplers, then the trainer (it
  checkpoints), then the broker, and kills every actor.

Paths: `model.path` must exist on every node that runs a sampler or the trainer, and
`train.out_dir` should be a shared file system (the trainer writes checkpoints there, and
the launcher reads its metrics). Ray is an optional dependency: `pip install ray`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import ray
from rich.console import Console
from rich.text import Text

from echorl.config import RayRole, RunConfig
from echorl.launch.local import echorl_command, resolved_config, tell_lost, trainer_ranks
from echorl.stopping import die_with_parent

NAMESPACE = "echorl"
CONTROL = "echorl-launcher"  # the named actor `echorl launch scale` talks to


@ray.remote(max_concurrency=4)
class RoleActor:
    """One role: its command as a child process, its output kept for the launcher."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        config: str,
        logs: str,
        lost: tuple[str, str] | None = None,
    ):
        """`lost`: a sampler's (broker URL, admin token): told at once when its command
        dies, so its leases go back to the queue (the command never sees the token)."""
        self.lost = lost
        self.name = name
        resumed = ray.get_runtime_context().was_current_actor_reconstructed
        if resumed and name == "trainer" and "--resume" not in argv:
            argv = [*argv, "--resume"]  # from its last checkpoint, as echorl run does
        fd, path = tempfile.mkstemp(prefix=f"echorl-{name}-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(config)
        self.port = _free_port() if "{port}" in argv else None  # free on this node
        argv = [path if a == "{config}" else str(self.port) if a == "{port}" else a for a in argv]
        Path(logs).mkdir(parents=True, exist_ok=True)
        self.log = open(Path(logs) / f"{name}.log", "a", buffering=1)  # noqa: SIM115
        if resumed:
            self.log.write(f"--- echorl launch ray: {name} restarted by Ray ---\n")
        self.lines: deque[str] = deque(maxlen=10_000)
        self.count = 0  # lines seen, for the launcher's cursor
        self.stopping = False
        self.proc = subprocess.Popen(
            argv,
            env=os.environ | env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=die_with_parent,
            start_new_session=True,  # its group is its own, so its helpers die with it
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.lines.append(line.rstrip("\n"))
            self.count += 1

    def _watch(self) -> None:
        """Waits on the command itself, not on its output's end: a helper it forked (a
        verifier worker) may hold the pipe open after the command died."""
        code = self.proc.wait()
        died = code != 0 and not self.stopping
        try:
            if died and self.lost is not None:
                tell_lost(*self.lost, self.name)  # first: its leases go back now
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of its group
            self.reader.join(5)
            if died:
                self.log.write(f"--- exited with {code}: the actor ends, Ray may restart it ---\n")
                os._exit(1)  # a dead command is a dead actor: Ray restarts it

    def where(self) -> tuple[str, int]:
        """(node IP, the command's pid)."""
        return ray.util.get_node_ip_address(), self.proc.pid

    def address(self) -> tuple[str, int | None]:
        """(node IP, the port it chose for its command's `{port}`)."""
        return ray.util.get_node_ip_address(), self.port

    def output(self, seen: int) -> tuple[int, list[str]]:
        """Lines after the first `seen` (as many as are still kept), and the new count."""
        new = self.count - seen
        lines = list(self.lines)[-new:] if new > 0 else []
        return self.count, lines

    def wait(self) -> int:
        self.watcher.join()
        return self.proc.returncode

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (a sampler hands back its leases, the trainer checkpoints), then SIGKILL."""
        self.stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.watcher.join(10)
        return self.proc.returncode


@ray.remote
class Control:
    """The launcher's mailbox: `echorl launch scale` sets how many samplers are wanted."""

    def __init__(self, samplers: int):
        self.samplers = samplers

    def set_samplers(self, n: int) -> int:
        self.samplers = n
        return n

    def wanted(self) -> int:
        return self.samplers


def options(role: RayRole, name: str, restarts: int) -> dict:
    return {
        "num_cpus": role.num_cpus,
        "num_gpus": role.num_gpus,
        "resources": dict(role.resources),
        "max_restarts": restarts,
        "name": name,
        "namespace": NAMESPACE,
    }


class RaySwarm:
    """The actors of one run, and the launcher's view of their output."""

    def __init__(self, cfg: RunConfig, model_dir: Path, console: Console):
        self.cfg, self.console = cfg, console
        self.out = Path(cfg.train.out_dir).resolve()
        self.env = {
            "ECHORL_TRAINER_TOKEN": os.urandom(16).hex(),
            "ECHORL_SAMPLER_TOKEN": os.urandom(16).hex(),
            "HF_HUB_OFFLINE": "1",
        }
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        path = resolved_config(cfg, self.out, model_dir, 0)
        self.config = path.read_text()
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self.placing: dict[str, tuple] = {}  # actors asked for and not yet known to be placed
        self.seen: dict[str, int] = {}
        self.url = ""
        self.next_sampler = 0

    def start(self, name: str, argv: list[str], role: RayRole, restarts: int, block=True):
        """Start role `name`'s actor; `block`: until Ray has placed it (a role the run
        cannot go on without). A sampler is checked on later (`unplaced`)."""
        lost = (self.url, self.env["ECHORL_TRAINER_TOKEN"]) if name.startswith("sampler-") else None
        actor = RoleActor.options(**options(role, f"{self.out.name}-{name}", restarts)).remote(
            name, argv, self.env, self.config, str(self.out / "logs"), lost
        )
        self.actors[name], self.seen[name] = actor, 0
        self.placing[name] = (actor.where.remote(), time.monotonic(), role)
        if block:
            placed = self.placing[name][0]
            if not ray.wait([placed], timeout=20)[0]:
                self.warn_unplaced(name, role)
                if not ray.wait([placed], timeout=self.cfg.launch.stall_timeout_s)[0]:
                    raise RuntimeError(f"{name} found no node with the resources it asks for")
            del self.placing[name]
        return actor

    def warn_unplaced(self, name: str, role: RayRole) -> None:
        asked = role.model_dump(exclude_defaults=True) or "1 CPU"
        self.console.print(
            f"[yellow]{name} is not placed yet: it asks for {asked}, the cluster has "
            f"{ray.available_resources()} free (launch.ray.{name.split('-')[0]})"
        )

    def unplaced(self, after_s: float = 20.0) -> None:
        """Name once each sampler Ray has not placed `after_s` seconds after it was asked."""
        for name, (placed, t0, role) in list(self.placing.items()):
            if ray.wait([placed], timeout=0)[0]:
                del self.placing[name]
            elif time.monotonic() - t0 > after_s:
                self.warn_unplaced(name, role)
                del self.placing[name]

    def start_broker(self) -> None:
        argv = echorl_command(("broker", "-c", "{config}", "--host", "0.0.0.0"))
        argv += ["--port", "{port}"]  # chosen on the node the broker lands on
        broker = self.start("broker", argv, self.cfg.launch.ray.broker, restarts=0)
        host, port = ray.get(broker.address.remote())
        self.url = f"http://{host}:{port}"
        _wait_healthy(self.url, broker, self.cfg.launch.ray.broker_wait_s)

    def start_sampler(self) -> None:
        name = f"sampler-{self.next_sampler}"
        self.next_sampler += 1
        args = ("sampler", "--broker", self.url, "-c", "{config}", "--name", name)
        args += ("--threads", str(self.cfg.launch.sampler_threads))
        role = self.cfg.launch.ray.sampler
        self.start(name, echorl_command(args), role, restarts=-1, block=False)

    def start_trainer(self, resume: bool) -> None:
        args = ("trainer", "--broker", self.url, "-c", "{config}")
        args += ("-o", f"model.threads={self.cfg.launch.trainer_threads}")
        args += ("--resume",) if resume else ()
        argv = echorl_command(args, trainer_ranks(self.cfg))
        self.start("trainer", argv, self.cfg.launch.ray.trainer, self.cfg.launch.max_restarts)

    @property
    def samplers(self) -> list[str]:
        return [n for n in self.actors if n.startswith("sampler-")]

    def scale(self, wanted: int) -> None:
        while len(self.samplers) < wanted:
            self.start_sampler()
        while len(self.samplers) > wanted:
            self.retire(self.samplers[-1])

    def retire(self, name: str) -> None:
        actor = self.actors.pop(name)
        self.placing.pop(name, None)
        self.show(name, actor)
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            ray.get(actor.stop.remote(), timeout=90)
        ray.kill(actor, no_restart=True)
        self.console.print(f"[cyan]{name} stopped")

    def show(self, name: str, actor) -> None:
        """Print the role's new output lines."""
        try:
            self.seen[name], lines = ray.get(actor.output.remote(self.seen[name]), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            return  # restarting: its output comes back with it
        for line in lines:
            self.console.print(Text.assemble((name, "dim"), " ", line), highlight=False)

    def stop(self) -> None:
        for name in [*self.samplers, "trainer", "broker"]:
            if name in self.actors:
                self.retire(name)


def launch_ray(
    cfg: RunConfig,
    model_dir: Path,
    console: Console,
    address: str | None = None,
    resume: bool = False,
) -> int:
    """Run the swarm on a Ray cluster until the trainer finishes; returns an exit code."""
    local = {}
    if address is None:  # a Ray of our own on this machine: room for every role, as echorl
        # run gives them, and for `scale` to add 16 samplers (CPUs here are Ray's bookkeeping)
        r = cfg.launch.ray
        asked = r.broker.num_cpus + r.trainer.num_cpus + cfg.launch.samplers * r.sampler.num_cpus
        asked += 16 * r.sampler.num_cpus
        local = {"num_cpus": max(os.cpu_count() or 1, int(asked + 0.999))}
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, **local)
    swarm = RaySwarm(cfg, model_dir, console)
    control = Control.options(name=CONTROL, namespace=NAMESPACE).remote(cfg.launch.samplers)
    stop: list[str] = []
    handler = signal.signal(signal.SIGTERM, lambda *_: stop.append("SIGTERM"))
    code = 1
    try:
        swarm.start_broker()
        console.print(f"broker at {swarm.url}")
        swarm.scale(cfg.launch.samplers)
        swarm.start_trainer(resume)
        code = watch(swarm, control, stop)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the swarm (the trainer checkpoints first)")
        code = 130
    finally:
        swarm.stop()
        ray.kill(control)
        signal.signal(signal.SIGTERM, handler)
        ray.shutdown()
    return code


def watch(swarm: RaySwarm, control, stop: list[str]) -> int:
    """Stream the roles' output and keep the sampler count until the trainer finishes
    (its exit code), the broker dies, or the launcher is told to stop."""
    trainer, broker = swarm.actors["trainer"], swarm.actors["broker"]
    done, broker_done = trainer.wait.remote(), broker.wait.remote()
    deaths = 0
    while not stop:
        ready, _ = ray.wait([done, broker_done], timeout=0.5, num_returns=1)
        for name, actor in list(swarm.actors.items()):
            swarm.show(name, actor)
        if broker_done in ready:
            swarm.console.print("[red]the broker exited: the run cannot go on")
            return 1
        if ready:
            try:
                return ray.get(done)
            except ray.exceptions.RayActorError:
                deaths += 1  # Ray restarts it (with --resume) up to launch.max_restarts
                if deaths > swarm.cfg.launch.max_restarts:
                    swarm.console.print("[red]the trainer died too often: giving up")
                    return 1
                swarm.console.print(f"[yellow]the trainer's actor died ({deaths}); Ray restarts it")
                time.sleep(1.0)
                done = trainer.wait.remote()
        swarm.scale(ray.get(control.wanted.remote()))
        swarm.unplaced()
    return 143


def scale(samplers: int, address: str = "auto") -> int:
    """Ask the running launcher for `samplers` samplers; returns the count it will keep."""
    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    try:
        control = ray.get_actor(CONTROL, namespace=NAMESPACE)
        return ray.get(control.set_samplers.remote(samplers))
    finally:
        ray.shutdown()


def _free_port() -> int:
    """A port free on the node this runs on (the broker's actor asks on its own node, so
    the launcher never picks one on a machine the broker is not on)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, actor, timeout: float) -> None:
    """Until the broker answers /healthz; RuntimeError after `timeout` with the reason: the
    last error, and the broker's last lines (it may have failed, or still be importing)."""
    import httpx

    t0, last = time.time(), "no answer yet"
    while time.time() - t0 < timeout:
        try:
            httpx.get(url + "/healthz", timeout=1.0).raise_for_status()
            return
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
            time.sleep(0.2)
    _, lines = ray.get(actor.output.remote(0))
    said = " | ".join(lines[-5:]) or "nothing yet (still starting? raise launch.ray.broker_wait_s)"
    raise RuntimeError(
        f"the broker did not answer {url}/healthz within {timeout:.0f} s "
        f"(launch.ray.broker_wait_s); last error: {last}; the broker said: {said}"
    )
