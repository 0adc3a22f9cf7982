import os

import pytest
import torch

from echorl.config import ConfigError, RunConfig, load_config
from echorl.launch.local import core_split, split_auditors
from echorl.protocol import Completion, ScoredGroup, Turn
from echorl.trainer.batch import Row, batch_from_groups, collate


def test_collate_masks_only_completion_tokens():
    b = collate(
        [
            Row([5, 6, 7], [8, 1], [-0.5, -0.1], [1, 1], 1.0),
            Row([5], [9, 9, 1], [-1.0, -2.0, -3.0], [1, 1, 1], -1.0),
        ],
        pad_id=0,
    )
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 1], [5, 9, 9, 1, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # Target column t predicts token t + 1.
    assert b.loss_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert torch.allclose(
        b.behaviour_logp, torch.tensor([[0, 0, -0.5, -0.1], [-1.0, -2.0, -3.0, 0]])
    )
    assert b.advantages.tolist() == [1.0, -1.0]
    assert b.rows(torch.tensor([1])).input_ids.tolist() == [[5, 9, 9, 1, 0]]


def test_collate_refuses_mismatched_logprobs_and_masks():
    with pytest.raises(
        AssertionError, match="row 0: 2 completion tokens, 1 log-probs, a mask of 2"
    ):
        collate([Row([1], [2, 3], [-1.0], [1, 1], 0.0)], pad_id=0)
    ok = Row([1], [2, 3], [-1.0, -1.0], [1, 1], 0.0)
    with pytest.raises(
        AssertionError, match="row 1: 2 completion tokens, 2 log-probs, a mask of 3"
    ):
        collate([ok, Row([1], [2, 3], [-1.0, -1.0], [1, 1, 0], 0.0)], pad_id=0)


def test_batch_from_groups_masks_environment_tokens_and_spreads_advantages():
    single = Completion(token_ids=[8, 1], logprobs=[-0.5, -0.1], finished=True)
    episode = Completion(
        token_ids=[9, 7, 7, 9],
        logprobs=[-1.0, 0.0, 0.0, -2.0],
        finished=False,
        turns=[Turn(start=0, end=1, version=0), Turn(start=3, end=4, version=0)],
    )
    groups = [
        ScoredGroup(job_id=0, version=0, prompt_ids=[5, 6], completions=[single], rewards=[1.0]),
        ScoredGroup(job_id=1, version=0, prompt_ids=[5], completions=[episode], rewards=[0.0]),
    ]
    b = batch_from_groups(groups, torch.tensor([[0.5], [-0.5]]), pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 8, 1, 0], [5, 9, 7, 7, 9]]
    assert b.loss_mask.tolist() == [[0, 1, 1, 0], [1, 0, 0, 1]]
    assert torch.allclose(b.behaviour_logp, torch.tensor([[0, -0.5, -0.1, 0], [-1.0, 0, 0, -2.0]]))
    assert b.advantages.tolist() == [0.5, -0.5]


def test_toml_and_yaml_configs_load_and_overrides_win(tmp_path):
    (tmp_path / "run.toml").write_text('[task]\nname = "reverse"\n[train]\nsteps = 7\n')
    (tmp_path / "run.yaml").write_text("task: {name: countdown}\noptim: {lr: 0.0001}\n")
    t = load_config(tmp_path / "run.toml", ["train.steps=9", "loss.aggregation=seq_mean"])
    assert (t.task.name, t.train.steps, t.loss.aggregation) == ("reverse", 9, "seq_mean")
    y = load_config(tmp_path / "run.yaml")
    assert (y.task.name, y.optim.lr) == ("countdown", 1e-4)
    assert load_config() == RunConfig()


@pytest.mark.parametrize(
    "override,field",
    [
        ("optim.lr=-1", "optim.lr"),
        ("optim.lr=fast", "optim.lr"),
        ("train.group_size=1", "train.group_size"),
        ("train.minibatches=3", "minibatches"),
        ("task.name=chess", "task.name"),
        ("train.stpes=5", "train.stpes"),
        ("loss.aggregation=mean", "loss.aggregation"),
        ("sampling.top_p=0", "sampling.top_p"),
        ("advantage.type=ppo", "advantage.type"),
        ("nonsense", "section.field=value"),
        ("train.steps=[oops", "train.steps"),  # not YAML
        ("model.device=gpu", "model.device"),  # no such torch device: refused before use
        ("sampler.device=cuda:x", "sampler.device"),
    ],
)
def test_bad_fields_are_named_in_the_error(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_bad_files_are_reported(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("[train\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(tmp_path / "bad.toml")
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path)
    (tmp_path / "latin1.toml").write_bytes('[task]\nname = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(tmp_path / "latin1.toml")


def test_text_fields_take_an_override_as_written():
    """A path named 2024, a prompt with a colon or a '#': text, not YAML's int or comment."""
    cfg = load_config(
        None,
        [
            "train.out_dir=2024",
            "model.path=yes",
            "sampling.system_prompt=You are: helpful",
            "broker.data_dir=runs/a #1",
            "sampler.endpoint='http://h:1/v1'",  # quoted: read as YAML, quotes dropped
            "train.steps=5",
            "model.device=cuda:1",
        ],
    )
    assert (cfg.train.out_dir, cfg.model.path, cfg.sampling.system_prompt) == (
        "2024",
        "yes",
        "You are: helpful",
    )
    assert (cfg.broker.data_dir, cfg.sampler.endpoint) == ("runs/a #1", "http://h:1/v1")
    assert (cfg.train.steps, cfg.model.device) == (5, "cuda:1")
    assert load_config(None, ["model.path="]).model.path is None  # empty: unset


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="core pinning is Linux's")
def test_core_split_gives_the_trainer_its_own_cores_when_there_are_any_left():
    cores = os.sched_getaffinity(0)
    if len(cores) > 1:
        trainer, rest = core_split(RunConfig())
        assert len(trainer) == 1 and trainer.isdisjoint(rest) and trainer | rest == cores
    assert core_split(RunConfig.model_validate({"launch": {"pin_cores": False}})) is None
    every = RunConfig.model_validate({"launch": {"trainer_threads": len(cores)}})
    assert core_split(every) is None  # nothing left for the samplers: no pinning


def test_an_auditor_gets_a_core_of_its_own_only_where_the_rest_keep_one():
    assert split_auditors({1, 2, 3}, 1) == ({1, 2}, [{3}])
    assert split_auditors({1, 2, 3}, 2) == ({1}, [{2}, {3}])
    assert split_auditors({1}, 1) == ({1}, [{1}])  # 2 cores: the auditor shares core 1
    assert split_auditors({1, 2}, 0) == ({1, 2}, [])
    assert split_auditors(None, 2) == (None, [None, None])  # no pinning


def test_a_resumed_run_keeps_its_config_and_refuses_to_become_another(tmp_path):
    """`echorl run --out DIR --resume` without the first run's flags had warmed up a fresh
    model on `add` and overwritten DIR/config.yaml. Resumed, the run's config is its
    config.yaml, with the file and flags given over it; those that change what the run is
    are refused, each named."""
    import yaml

    from echorl.config import resume_config

    run = load_config(None, ["task.name=reverse", "broker.mode=async", "model.path=m"])
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(run.model_dump(mode="json")))
    assert resume_config(saved, None) == run  # no flags: the run as it was
    longer = resume_config(saved, None, ["train.steps=500", "launch.samplers=4"])
    assert (longer.train.steps, longer.launch.samplers, longer.task.name) == (
        500,
        4,
        "reverse",
    )
    toml = tmp_path / "more.toml"
    toml.write_text('[train]\nsteps = 900\n[model]\npreset = "1m"\n')  # sets only what it says
    assert resume_config(saved, toml).train.steps == 900
    with pytest.raises(ConfigError) as e:
        resume_config(saved, None, ["task.name=add", "train.group_size=4", "broker.mode=sync"])
    for named in ("task:", "train.group_size: 8", "broker.mode: 'async'", "another --out"):
        assert named in str(e.value), (named, str(e.value))


def test_a_resumed_runs_wall_time_counts_every_session():
    from echorl.launch.local import run_wall_s

    walls = [1.0, 2.0, 3.0, 0.5, 1.5, 0.2]  # three sessions (the trainer's clock restarts)
    assert run_wall_s([{"trainer/wall_s": w} for w in walls]) == pytest.approx(3.0 + 1.5 + 0.2)


def test_a_resume_given_the_runs_own_config_still_refuses_flags_that_change_the_run(tmp_path):
    """`echorl trainer --resume -c OUT/config.yaml -o task.name=...`: the run's own file
    with a flag that makes it another run is refused (exit 2, naming the field) before
    anything starts; before, the run's own file skipped the check."""
    import subprocess
    import sys

    from echorl.config import load_config, save_config

    out = tmp_path / "run"
    out.mkdir()
    save_config(load_config(None, ["task.name=add", f"train.out_dir={out}"]), out / "config.yaml")
    cmd = [sys.executable, "-m", "echorl.cli", "trainer", "--resume", "--out", str(out)]
    cmd += [
        "-c",
        str(out / "config.yaml"),
        "-o",
        "task.name=countdown",
        "--broker",
        "http://127.0.0.1:9",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    said = " ".join(done.stdout.split())
    assert "would make it another run: task:" in said and "'countdown'" in said
