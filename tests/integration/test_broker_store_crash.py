"""kill -9 a process writing to the store: every push that returned is there, exactly once."""

import os
import signal
import subprocess
import sys
import textwrap

from echorl.broker.store import BrokerStore
from echorl.models.tokenizer import RunTokenizer
from echorl.tasks import get_task
from tests.integration.conftest import IDENTITY

WRITER = textwrap.dedent("""
    import sys
    from echorl.broker.store import BrokerStore
    from echorl.models.tokenizer import RunTokenizer
    from echorl.protocol import SamplerInfo, ScoredGroup
    from echorl.tasks import get_task
    codec = RunTokenizer.builtin()
    s = BrokerStore(sys.argv[1], "add", get_task("add").problem, codec.encode, vocab_size=258,
                    synchronous="FULL")
    s.set_latest_version(0)
    me = s.register(SamplerInfo(name="writer", tokenizer=codec.fingerprint, task="add"), 0.0)
    while True:
        for job in s.lease(me, 2, 2, now=0.0, lease_seconds=1e9):
            g = ScoredGroup.model_validate({
                "job_id": job.job_id, "version": 0, "prompt_ids": job.prompt_ids,
                "rewards": [0.0, 0.0], "completions": [
                {"token_ids": [20, 1], "logprobs": [-0.1, -0.2], "finished": True}] * 2})
            s.push(me, g, now=0.0)
            print(job.job_id, flush=True)  # acknowledged: push returned
""")


def test_acknowledged_pushes_survive_kill_9(tmp_path):
    db = tmp_path / "broker.sqlite"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True
    )
    acked = []
    while len(acked) < 40:
        line = proc.stdout.readline()
        assert line, "writer died early"
        acked.append(int(line))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    acked += [int(x) for x in proc.stdout.read().split()]

    s = BrokerStore(
        db, "add", get_task("add").problem, RunTokenizer.builtin().encode, vocab_size=258
    )
    stored = [r[0] for r in s.db.execute("SELECT job_id FROM rollouts")]
    assert set(acked) <= set(stored)
    assert len(stored) == len(set(stored))
    assert s.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    from echorl.protocol import SamplerInfo

    nxt = s.lease(
        s.register(SamplerInfo(name="after", **IDENTITY), 0.0), 3, 2, now=0.0, lease_seconds=10
    )
    created = {r[0] for r in s.db.execute("SELECT job_id FROM jobs")}
    # Leased-but-unpushed jobs from the dead writer come back only after their lease; new ones
    # continue the cursor, never reusing an id.
    assert all(j.job_id >= max(stored) for j in nxt)
    assert len(created) == s.db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
