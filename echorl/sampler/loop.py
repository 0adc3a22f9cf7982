"""The sampler process: lease jobs, hold the right weights, generate, push. Repeat.

    echorl sampler --broker http://127.0.0.1:8000 --token T --model runs/demo/sft

The protocol decides which weights a batch of jobs needs: sync jobs carry
`required_version` (pulled before generating: every call refreshes the
weights); async jobs use the latest version the broker reported, re-checked
between batches. Weights are swapped in place with `load_state_dict` between
generations, never during one. The loop knows nothing of training.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from echorl.client import BrokerClient, BrokerUnavailable
from echorl.config import RunConfig
from echorl.protocol import Job, SamplerInfo
from echorl.sampler.backends.hf import HFBackend
from echorl.sampler.rollout import rollout, to_wire
from echorl.seeding import derive_seed
from echorl.tasks import get_task

log = logging.getLogger("echorl.sampler")


class Sampler:
    def __init__(
        self,
        client: BrokerClient,
        backend: HFBackend,
        cfg: RunConfig,
        name: str,
        cache: Path,
        jobs_per_lease: int = 4,
        idle_sleep: float = 0.2,
    ):
        self.client, self.backend, self.cfg, self.name = client, backend, cfg, name
        self.cache, self.jobs_per_lease, self.idle_sleep = cache, jobs_per_lease, idle_sleep
        self.version: int | None = None  # the version whose weights the backend holds
        self.pushed = 0
        cache.mkdir(parents=True, exist_ok=True)

    def ensure_version(self, version: int) -> None:
        """Download `version` (verified) and load it in place, unless already held."""
        if version == self.version:
            return
        info = self.client.describe(version)
        path = self.client.download(info, self.cache / f"v{version}.safetensors")
        model = self.backend.model
        dtype = next(model.parameters()).dtype
        state = {k: t.to(dtype) if t.is_floating_point() else t for k, t in load_file(path).items()}
        model.load_state_dict(state, strict=True)
        path.unlink()
        self.version = version
        log.info("%s: now holds version %d", self.name, version)

    def work(self, sampler_id: str, jobs: list[Job], latest: int) -> None:
        needed = {j.required_version for j in jobs}
        assert len(needed) == 1, f"one lease mixes required versions {needed}"
        (required,) = needed
        self.ensure_version(latest if required is None else required)
        task = get_task(self.cfg.task.name)
        tokens, t_start = 0, time.perf_counter()
        for job in jobs:
            problem = task.problem(job.seed)
            t0 = time.perf_counter()
            (group,) = rollout(
                self.backend,
                task,
                [problem],
                job.group_size,
                self.cfg.sampling,
                seed=derive_seed(self.cfg.train.seed, "job", job.job_id),
                version=self.version,
            )
            self.client.push(sampler_id, to_wire(group, job.job_id, time.perf_counter() - t0))
            self.pushed += 1
            tokens += sum(len(c.token_ids) for c in group.completions)
        self.client.heartbeat(sampler_id, self.version, tokens / (time.perf_counter() - t_start))

    def run(self, stop: threading.Event) -> None:
        sampler_id = self.client.register(
            SamplerInfo(name=self.name, hardware=_hardware(), backend="hf")
        )
        log.info("%s registered as %s", self.name, sampler_id)
        while not stop.is_set():
            try:
                reply = self.client.lease(sampler_id, self.jobs_per_lease)
                if reply.jobs:
                    self.work(sampler_id, reply.jobs, reply.latest_version)
                else:
                    stop.wait(self.idle_sleep)
            except BrokerUnavailable as e:  # the broker is down: back off and carry on
                log.warning("%s: broker unavailable (%s); retrying", self.name, e)
                stop.wait(2.0)
        try:  # hand back what it will not finish, so nobody waits for the lease to expire
            self.client.leave(sampler_id)
        except BrokerUnavailable:
            log.warning("%s: could not tell the broker it left; its leases will expire", self.name)


def _hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu x{torch.get_num_threads()}"
