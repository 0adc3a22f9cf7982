"""The documentation: the site builds with --strict (a broken link or a missing page fails),
its reference pages name every config field, CLI verb and broker route, and the README is
what a newcomer reads in 5 minutes, every link in it to a page that exists."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 250
    links = re.findall(r"\]\(([^)#]+)", text)
    assert links
    assert [link for link in links if not (ROOT / link).exists()] == []


def test_the_reference_pages_are_what_the_code_says_now(tmp_path):
    """Regenerate with `python scripts/docs_reference.py` after changing a config field, a
    CLI option or a route."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_reference
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    for path, make in docs_reference.PAGES.items():
        assert (ROOT / "docs" / path).read_text() == make(), (
            f"docs/{path} is stale: run python scripts/docs_reference.py"
        )


def test_the_site_builds_strict_with_generated_reference(tmp_path):
    assert shutil.which("mkdocs", path=str(Path(sys.executable).parent)), (
        "mkdocs-material is not installed: pip install 'echorl[test]' (or [docs])"
    )
    built = subprocess.run(
        [
            str(Path(sys.executable).parent / "mkdocs"),
            "build",
            "--strict",
            "-q",
            "-d",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=os.environ | {"NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    config = (tmp_path / "reference" / "config" / "index.html").read_text()
    from echorl.config import RunConfig

    for section, field in RunConfig.model_fields.items():
        assert f"<code>{section}</code>" in config
        for name, sub in field.annotation.model_fields.items():
            nested = isinstance(sub.annotation, type) and hasattr(sub.annotation, "model_fields")
            shown = f"<code>{section}.{name}</code>" if nested else f"<code>{name}</code>"
            assert shown in config, f"{section}.{name}"
    cli = (tmp_path / "reference" / "cli" / "index.html").read_text()
    for verb in ("run", "broker", "sampler", "trainer", "export", "status", "launch ray"):
        assert f"echorl {verb}</code>" in cli, verb
    http = (tmp_path / "reference" / "http" / "index.html").read_text()
    for route in ("/v1/jobs/lease", "/v1/rollouts", "/v1/batches/pull", "/v1/weights/{version}"):
        assert route in http
    assert (tmp_path / "architecture" / "index.html").is_file()
