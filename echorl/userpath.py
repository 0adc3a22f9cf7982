"""Your own code by import path: `path/to/file.py:name` or `my_pkg.module:name` (a task, a
reward function, a loss, an advantage). One importer, so every such field reads alike."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def load_callable(spec: str, field: str):
    """`file.py:name` or `module.path:name` -> that callable; ValueError naming `field`."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr.isidentifier():
        raise ValueError(f"{field}: {spec!r} is not file.py:name or module.path:name")
    fn = getattr(import_path(where, spec), attr, None)
    if not callable(fn):
        raise ValueError(f"{field}: {where} has no function {attr!r}")
    return fn


def is_import_path(spec: str) -> bool:
    where, _, attr = spec.rpartition(":")
    return bool(where) and attr.isidentifier()


def import_path(where: str, name: str):
    """The module at `where`: a file path (`x.py`) or a module path (`pkg.mod`, found as
    installed or in the working directory). ValueError names `name` and what failed."""
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"{name!r}: no such file {where}")
        key = f"echorl_user_{abs(hash(str(path.resolve())))}"
        if key not in sys.modules:
            spec = importlib.util.spec_from_file_location(key, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[key]
                raise ValueError(
                    f"{name!r}: importing {where} raised {type(e).__name__}: {e}"
                ) from e
        return sys.modules[key]
    # Modules in the working directory are found, as `python -m` finds them.
    if str(Path.cwd()) not in sys.path:
        sys.path.append(str(Path.cwd()))
    try:
        return importlib.import_module(where)
    except ImportError as e:
        raise ValueError(f"{name!r}: cannot import {where} ({e})") from e
    except Exception as e:  # the user's module failed while importing: that is the reason
        raise ValueError(f"{name!r}: importing {where} raised {type(e).__name__}: {e}") from e
