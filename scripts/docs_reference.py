"""The docs' reference pages, generated from the code itself: every config field from the
pydantic models, every CLI verb from the typer app, every broker route from its OpenAPI
schema. They are committed (readable on any forge) and a test fails when they drift:

    python scripts/docs_reference.py          # rewrites docs/reference/*.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal, get_args, get_origin

from pydantic import BaseModel


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _type(annotation) -> str:
    if get_origin(annotation) is Literal:
        return " | ".join(json.dumps(a) for a in get_args(annotation))
    name = getattr(annotation, "__name__", None) or str(annotation)
    return name.replace("typing.", "").replace("NoneType", "None")


def config_page() -> str:
    from echorl.config import RunConfig

    out = [
        "# Configuration reference",
        "",
        "Every field of a run's config, generated from `echorl/config.py`. A config file (TOML "
        "or YAML) sets any of them by section; `-o section.field=value` overrides one. Unknown "
        "keys are errors.",
        "",
    ]

    def section(model: type[BaseModel], prefix: str) -> None:
        rows, subsections = [], []
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                subsections.append((ann, f"{prefix}.{name}"))
                continue
            default = field.get_default(call_default_factory=True)
            shown = json.dumps(default) if not isinstance(default, BaseModel) else "…"
            rows.append(
                f"| `{name}` | `{_cell(_type(ann))}` | `{_cell(shown)}` | "
                f"{_cell(field.description or '')} |"
            )
        out.extend([f"## `{prefix}`", ""])
        if model.__doc__ and model.__module__ == "echorl.config":
            out.extend([" ".join(model.__doc__.split()), ""])
        if rows:
            out.extend(["| field | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""])
        for sub, name in subsections:
            section(sub, name)

    for name, field in RunConfig.model_fields.items():
        section(field.annotation, name)
    return "\n".join(out) + "\n"


def cli_page() -> str:
    import typer

    from echorl.cli import app

    root = typer.main.get_command(app)
    out = [
        "# CLI reference",
        "",
        "Every `echorl` verb and its options, generated from `echorl/cli.py` (the same text as "
        "`echorl VERB --help`). Every verb that takes `-c CONFIG` and `-o key=value` reads the "
        "[configuration](config.md).",
        "",
    ]

    def command(cmd, path: str) -> None:  # typer's own click: matched by what it has
        if hasattr(cmd, "commands"):
            for name in sorted(cmd.commands):
                command(cmd.commands[name], f"{path} {name}")
            return
        out.extend([f"## `{path}`", "", (cmd.help or "").strip().split("\f")[0], ""])
        rows = []
        for p in cmd.params:
            if not getattr(p, "help", None) and p.param_type_name == "argument":
                rows.append(f"| `{p.name.upper()}` | argument | |")
                continue
            if p.name == "help":
                continue
            flags = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
            default = "" if p.default is None or p.is_flag and not p.default else p.default
            shown = f"`{_cell(default)}`" if default != "" else ""
            rows.append(f"| {flags} | {_cell(p.help or '')} | {shown} |")
        if rows:
            out.extend(["| option | meaning | default |", "| --- | --- | --- |", *rows, ""])

    command(root, "echorl")
    return "\n".join(out) + "\n"


def http_page() -> str:
    from fastapi import FastAPI

    from echorl.broker.routes import router

    app = FastAPI(title="echorl broker", version="1")
    app.include_router(router)
    schema = app.openapi()
    out = [
        "# HTTP reference",
        "",
        "The broker's routes, generated from its OpenAPI schema (a running broker serves it at "
        "`/openapi.json` and `/docs`). Samplers send `Authorization: Bearer` with a sampler "
        "token, the trainer with the trainer token (see [Trust](../concepts/trust.md)). Errors "
        "are JSON `{\"detail\": reason}` with a 4xx code that says which rule was broken.",
        "",
        "| method | route | what it does |",
        "| --- | --- | --- |",
    ]
    for route, methods in sorted(schema["paths"].items()):
        for method, op in methods.items():
            what = (op.get("description") or op.get("summary", "")).split("\n\n")[0]
            out.append(f"| {method.upper()} | `{route}` | {_cell(what)} |")
    out.extend(["", "## Bodies", ""])
    for name, body in sorted(schema.get("components", {}).get("schemas", {}).items()):
        props = body.get("properties", {})
        if not props:
            continue
        out.extend([f"### {name}", "", " ".join((body.get("description") or "").split()), ""])
        out.extend(["| field | type | meaning |", "| --- | --- | --- |"])
        for field, spec in props.items():
            kind = spec.get("type") or " or ".join(
                s.get("type", s.get("$ref", "?").rsplit("/", 1)[-1]) for s in spec.get("anyOf", [])
            ) or spec.get("$ref", "").rsplit("/", 1)[-1]
            out.append(f"| `{field}` | {_cell(kind)} | {_cell(spec.get('description', ''))} |")
        out.append("")
    return "\n".join(out) + "\n"


PAGES = {"reference/config.md": config_page, "reference/cli.md": cli_page, "reference/http.md": http_page}


if __name__ == "__main__":
    where = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parents[1] / "docs")
    for path, make in PAGES.items():
        (where / path).parent.mkdir(parents=True, exist_ok=True)
        (where / path).write_text(make())
        print(where / path)
