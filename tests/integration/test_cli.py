"""The `echorl` CLI as a user runs it: real subprocesses, real files."""

import json
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def echorl(*args, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "echorl.cli", *args], capture_output=True, text=True, timeout=600
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"echorl {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "sft"
    echorl("sft", "--task", "add", "--out", str(out), "--steps", "40")
    return out


def test_colocated_train_writes_metrics_checkpoints_and_plot_then_resumes(warm, tmp_path):
    out = tmp_path / "rl"
    common = [
        "train",
        "--colocated",
        "--task",
        "add",
        "--model",
        str(warm),
        "--out",
        str(out),
        "-o",
        "train.batch_prompts=4",
        "-o",
        "train.group_size=4",
        "-o",
        "train.eval_prompts=16",
        "-o",
        "train.checkpoint_every=2",
        "-o",
        "train.drop_flat_groups=false",
    ]
    run = echorl(*common, "--steps", "3")
    assert "held-out greedy accuracy" in run.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "reward/mean" in r]
    assert steps == [1, 2, 3]
    for key in (
        "reward/mean",
        "reward/accuracy",
        "loss/clip_frac",
        "policy/entropy",
        "perf/gen_tokens_per_s",
        "trainer/step_s",
    ):
        assert key in records[1], key
    assert (out / "reward_curve.png").stat().st_size > 5_000
    assert (out / "checkpoints" / "LATEST").read_text() == "step_0000003"
    assert (out / "policy" / "model.safetensors").is_file()

    # A crash after step 3's checkpoint but with step 4 already logged: resume rewrites step 4.
    with (out / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 4, "reward/mean": -1.0}) + "\n")
    echorl(*common, "--steps", "5", "--resume")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2, 3, 4, 5]
    assert all(r["reward/mean"] >= 0 for r in records if "reward/mean" in r)
    assert (out / "checkpoints" / "LATEST").read_text() == "step_0000005"
    # A run's folder or a checkpoint is a model folder: its policy inside (was: "not a model
    # folder", with no hint of policy/).
    for given in (out, out / "checkpoints" / "step_0000005"):
        shown = echorl("eval", "--model", str(given), "--n", "4").stdout
        assert f"model: {given / 'policy'}" in shown and "held-out greedy accuracy" in shown


def test_bad_config_field_is_named_and_nothing_runs(warm, tmp_path):
    proc = echorl(
        "train",
        "--colocated",
        "--model",
        str(warm),
        "--out",
        str(tmp_path / "x"),
        "-o",
        "train.group_size=0",
        check=False,
    )
    assert proc.returncode == 2
    assert "train.group_size" in proc.stdout
    assert not (tmp_path / "x").exists()


def test_train_without_colocated_says_why(warm):
    proc = echorl("train", "--model", str(warm), check=False)
    assert proc.returncode == 2 and "--colocated" in proc.stdout


def test_trainer_refuses_a_malformed_core_list(warm, tmp_path):
    proc = echorl(
        "trainer", "--broker", "http://127.0.0.1:9", "--model", str(warm), "--io-cpus", "1,x",
        "--out", str(tmp_path / "t"), check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "--io-cpus" in proc.stdout
    assert not (tmp_path / "t").exists()


def test_sft_into_a_pipe_prints_plain_progress_lines(tmp_path):
    """rich draws no bar where stdout is no terminal (CI, nohup, a file): the warm-up says
    how far it is in plain lines, with the loss and an ETA, and the last step's at the end."""
    out = tmp_path / "sft"
    shown = echorl("sft", "--task", "add", "--out", str(out), "-o", "sft.steps=60").stdout
    lines = [x for x in shown.splitlines() if x.startswith("warm-up on add: step ")]
    line = r"warm-up on add: step (\d+)/60 loss \d+\.\d{3} eta (\d+:\d\d:\d\d|\?)"
    assert lines and all(re.fullmatch(line, x) for x in lines), shown
    last = lines[-1]
    assert last.startswith("warm-up on add: step 60/60 ") and last.endswith(" eta 0:00:00")
    assert "━" not in shown and (out / "config.json").is_file()  # no bar's remains


def test_eval_prints_accuracy(warm):
    assert "held-out greedy accuracy" in echorl("eval", "--model", str(warm), "--n", "8").stdout
    shown = echorl("eval", "--model", str(warm), "--n", "8", "--samples", "2").stdout
    assert "sampled pass@1" in shown and "(2 per problem)" in shown


def test_every_settings_verb_takes_a_config_file_and_overrides(warm, tmp_path):
    """`-c FILE` and `-o key=value` the same way on every verb that reads settings: a field
    from the file is used, an override wins over it, a bad one is named."""
    (tmp_path / "run.toml").write_text('[task]\nname = "reverse"\n[train]\neval_prompts = 4\n')
    c = ["-c", str(tmp_path / "run.toml")]
    shown = echorl("eval", "--model", str(warm), *c).stdout
    assert shown.startswith("reverse:") and "(n=4)" in shown
    shown = echorl(
        "eval", "--model", str(warm), *c, "-o", "task.name=add", "-o", "train.eval_prompts=3"
    )
    assert shown.stdout.startswith("add:") and "(n=3)" in shown.stdout
    needs = {"sft": ["--out", str(tmp_path / "x")], "train": ["--colocated"]}
    for verb in ("sft", "train", "eval", "run", "broker", "sampler", "trainer", "demo"):
        bad = echorl(verb, *needs.get(verb, []), *c, "-o", "train.steps=-1", check=False)
        assert bad.returncode == 2 and "train.steps" in bad.stdout, (verb, bad.stdout, bad.stderr)
    both = echorl("run", str(tmp_path / "run.toml"), *c, check=False)
    assert both.returncode == 2 and "give the config once" in both.stdout


def test_a_users_mistakes_get_one_line_naming_the_flag_and_no_traceback(warm, tmp_path):
    """Each mistake is told in a line naming what to fix, exit 2 (or 1: a broker that does
    not answer), before any model is loaded or any state is written."""
    model = ["--model", str(warm)]
    cases = [
        (["eval", "--model", str(tmp_path / "nowhere")], 2, "model.path"),
        (["sampler", "--broker", "127.0.0.1:9", *model], 2, "--broker"),
        (["sampler", "--broker", "http://127.0.0.1:9", "--name", "a b", *model], 2, "--name"),
        (["auditor", "--broker", "http://127.0.0.1:9", "--name", "../x", *model], 2, "--name"),
        (["sft", "--out", str(tmp_path / "x"), "-o", "train.steps=[oops"], 2, "train.steps"),
        (["eval", *model, "-o", "model.device=gpu"], 2, "model.device"),
        (["trainer", "--broker", "http://127.0.0.1:9", *model, "--io-cpus", "999"], 2, "--io-cpus"),
        (["status", "--broker", "127.0.0.1:9"], 2, "--broker"),
        (["sft", "--out", str(tmp_path / "x"), "-c", str(tmp_path)], 2, "is a folder"),
    ]
    for args, code, named in cases:
        shown = echorl(*args, check=False)
        said = " ".join((shown.stdout + shown.stderr).split())
        assert shown.returncode == code and named in said, (args, said)
        assert "Traceback" not in said, (args, said)
    assert not (tmp_path / "x").exists()
    # A broker that refuses the run: `echorl run` shows its reason, leaves no run behind,
    # and the same --out runs once the setting is fixed.
    out = tmp_path / "run"
    run = ["run", "--out", str(out), "-o", f"model.path={warm}", "-o", "train.steps=1"]
    run += ["-o", "train.batch_prompts=2", "-o", "train.group_size=2", "-o", "train.eval_prompts=2"]
    refused = echorl(*run, "-o", "sampling.prompt_format=chat", check=False)
    said = " ".join(refused.stdout.split())
    assert refused.returncode == 2 and "chat template" in said, said
    assert not (out / "broker" / "broker.sqlite").exists()
    assert "already holds a run" not in echorl(*run).stdout
