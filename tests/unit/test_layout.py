"""The layout the design promises: roles import downwards only."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "echorl"


def imports(folder: str) -> set[tuple[str, str]]:
    """(file, imported module) for every import in `echorl/folder`."""
    found = set()
    for path in (PACKAGE / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add((path.name, node.module))
            elif isinstance(node, ast.Import):
                found |= {(path.name, alias.name) for alias in node.names}
    return found


def test_the_trainer_imports_nothing_from_the_sampler():
    assert not [(f, m) for f, m in imports("trainer") if m.startswith("echorl.sampler")]


def test_rollout_and_the_broker_import_neither_role():
    for folder in ("rollout", "broker"):
        roles = ("echorl.sampler", "echorl.trainer")
        assert not [(f, m) for f, m in imports(folder) if m.startswith(roles)], folder
