#!/usr/bin/env bash
# The test suite, what CI runs: the default suite (skips tests marked slow), then the engines
# stage (scripts/test_engines.sh: vLLM and Ray in a venv of their own; ECHORL_TEST_ENGINES=0
# skips it). Extra arguments go to the default suite's pytest, and skip the engines stage.
source "$(dirname "$0")/_venv.sh"
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
if [ $# -eq 0 ] && [ "${ECHORL_TEST_ENGINES:-1}" != 0 ]; then
  bash scripts/test_engines.sh
fi
