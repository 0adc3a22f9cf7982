"""The streamed safetensors file: what safetensors itself reads, hashed as sent."""

import hashlib

import torch
from safetensors.torch import load

from echorl.models.tiny import build_tiny_model
from echorl.trainer.weights import stream_safetensors


def test_streamed_file_loads_with_safetensors_and_its_digest_is_the_bytes():
    state = {
        "w": torch.randn(3, 5),
        "half": torch.randn(4, dtype=torch.float32).to(torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "mask": torch.tensor([True, False, True]),
        "strided": torch.randn(4, 6).t(),  # not contiguous: copied, same values
    }
    digest, size, chunks = stream_safetensors(state, {"format": "pt"})
    blob = b"".join(bytes(c) for c in chunks())
    assert len(blob) == size and hashlib.sha256(blob).hexdigest() == digest
    assert b"".join(bytes(c) for c in chunks()) == blob  # a retry sends the same bytes
    back = load(blob)
    assert back.keys() == state.keys()
    for name, t in state.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    assert (8 + int.from_bytes(blob[:8], "little")) % 8 == 0  # tensors start aligned


def test_a_whole_model_round_trips():
    model, _ = build_tiny_model("1m")
    state = model.state_dict()
    _, _, chunks = stream_safetensors(state)
    back = load(b"".join(bytes(c) for c in chunks()))
    assert all(torch.equal(back[k], v) for k, v in state.items())
