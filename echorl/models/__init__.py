"""Models: the built-in tiny Qwen-architecture model and loading of local checkpoints.

Names are imported on first use, so `echorl.models.tokenizer` (used by the broker)
does not pull in transformers and torch.
"""

import importlib

_WHERE = {
    "load_policy": "loading",
    "load_tokenizer": "loading",
    "PRESETS": "tiny",
    "build_tiny_model": "tiny",
    "save_tiny_model": "tiny",
    "build_byte_tokenizer": "tokenizer",
    "byte_tokenizer": "tokenizer",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'echorl.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"echorl.models.{_WHERE[name]}"), name)
