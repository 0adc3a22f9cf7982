import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from echorl.models import build_tiny_model


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_saved(tmp_path_factory):
    """A 1m tiny model saved to disk once per session."""
    from echorl.models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "1m", seed=0)


@pytest.fixture
def tiny():
    return build_tiny_model("1m", seed=0)
