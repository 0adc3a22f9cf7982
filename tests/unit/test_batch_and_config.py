import os

import pytest
import torch

from echorl.config import ConfigError, RunConfig, load_config
from echorl.launch.local import core_split
from echorl.trainer.batch import Sequence, collate


def test_collate_masks_only_completion_tokens():
    b = collate(
        [
            Sequence([5, 6, 7], [8, 1], [-0.5, -0.1], 1.0),
            Sequence([5], [9, 9, 1], [-1.0, -2.0, -3.0], -1.0),
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


def test_collate_refuses_mismatched_logprobs():
    with pytest.raises(AssertionError, match="2 completion tokens but 1 log-probs"):
        collate([Sequence([1], [2, 3], [-1.0], 0.0)], pad_id=0)


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


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="core pinning is Linux's")
def test_core_split_gives_the_trainer_its_own_cores_when_there_are_any_left():
    cores = os.sched_getaffinity(0)
    if len(cores) > 1:
        trainer, rest = core_split(RunConfig())
        assert len(trainer) == 1 and trainer.isdisjoint(rest) and trainer | rest == cores
    assert core_split(RunConfig.model_validate({"launch": {"pin_cores": False}})) is None
    every = RunConfig.model_validate({"launch": {"trainer_threads": len(cores)}})
    assert core_split(every) is None  # nothing left for the samplers: no pinning
