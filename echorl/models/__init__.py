"""Models: the built-in tiny Qwen-architecture model and loading of local checkpoints."""

from echorl.models.loading import load_policy, load_tokenizer
from echorl.models.tiny import PRESETS, build_tiny_model, save_tiny_model
from echorl.models.tokenizer import build_byte_tokenizer

__all__ = [
    "PRESETS",
    "build_byte_tokenizer",
    "build_tiny_model",
    "load_policy",
    "load_tokenizer",
    "save_tiny_model",
]
