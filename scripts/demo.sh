#!/usr/bin/env bash
# The demo: the tiny model warms up on 2-digit addition, then co-located GRPO improves it.
# Extra arguments go to `echorl demo` (e.g. --task countdown --steps 60).
source "$(dirname "$0")/_venv.sh"
exec .venv/bin/echorl demo "$@"
