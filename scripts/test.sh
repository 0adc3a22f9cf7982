#!/usr/bin/env bash
# The test suite, what CI runs: ruff, the docs site (--strict), the default suite (skips
# tests marked slow or long; under 15 minutes on 2 cores), the long end-to-end runs (marked long), then the engines stage
# (scripts/test_engines.sh: vLLM and Ray in a venv of their own; ECHORL_TEST_ENGINES=0 skips
# it). Extra arguments go to the default suite's pytest, and skip the other two stages.
source "$(dirname "$0")/_venv.sh"
# The dashboard's browser test drives Debian's chromium; installed here where apt and root are
# (CI), skipped with its reason elsewhere.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  echo "installing Debian's chromium for the dashboard's browser test (log: .venv/install.log)"
  { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } \
    >>.venv/install.log 2>&1 || echo "chromium could not be installed: the browser test is skipped"
fi
.venv/bin/ruff check .
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -q -d "$(mktemp -d)"  # a broken link fails
.venv/bin/python -m pytest -q "$@"
[ $# -eq 0 ] || exit 0
.venv/bin/python -m pytest -q -m "long and not slow"
if [ "${ECHORL_TEST_ENGINES:-1}" != 0 ]; then
  bash scripts/test_engines.sh
fi
