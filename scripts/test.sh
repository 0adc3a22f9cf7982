#!/usr/bin/env bash
# The default test suite (skips tests marked slow). Extra arguments go to pytest.
source "$(dirname "$0")/_venv.sh"
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
