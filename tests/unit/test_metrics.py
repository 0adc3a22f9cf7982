"""Metrics files: JSONL rewritten on resume, TensorBoard event files, the run's PNG report."""

from echorl.metrics import MetricsLog, MetricsTail, plot_run, read_metrics


def record(step, stale):
    return {
        "step": step,
        "time": 100.0 + step,
        "trainer/wall_s": float(step),
        "reward/mean": 0.5 + step / 100,
        "rollout/staleness_hist": stale,
        "rollout/versions": [step - 1],
        "loss/policy": float("nan"),
    }


def test_jsonl_tensorboard_and_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path / "metrics.jsonl", tensorboard=True)
    for s in range(1, 6):
        log.write(record(s, [4, 0]))
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["loss/policy"] is None  # NaN is not JSON: written as null
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Scalars("reward/mean")
    assert [e.step for e in scalars] == [1, 2, 3, 4, 5]
    assert abs(scalars[-1].value - 0.55) < 1e-6
    assert "rollout/versions" not in events.Tags()["scalars"]  # lists stay in the JSONL
    MetricsLog(tmp_path / "metrics.jsonl", keep_through_step=3).close()  # a resume at step 3
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_plot_run_draws_reward_time_and_staleness(tmp_path):
    records = [record(s, [2, 1, 1] if s % 2 else [4]) for s in range(1, 30)]
    paths = plot_run(records, tmp_path, "async")
    assert [p.name for p in paths] == ["reward_curve.png", "reward_vs_time.png", "staleness.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_tail_reads_only_new_whole_lines_and_restarts_after_a_rewrite(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []  # no file yet
    log = MetricsLog(path)
    for s in range(1, 4):
        log.write(record(s, [1]))
    assert [r["step"] for r in tail.read()] == [1, 2, 3]
    assert tail.read() == []
    with path.open("a") as f:
        f.write('{"step": 4, "reward/mean"')  # the trainer is mid-write
    assert tail.read() == []
    with path.open("a") as f:
        f.write(": 0.5}\n")
    assert tail.read() == [{"step": 4, "reward/mean": 0.5}] and not tail.restarted
    MetricsLog(path, keep_through_step=2)  # a resume rewrites the file shorter
    assert [r["step"] for r in tail.read()] == [1, 2] and tail.restarted
