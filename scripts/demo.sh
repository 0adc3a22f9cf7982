#!/usr/bin/env bash
# The demo: the tiny model warms up on 2-digit addition, then a broker, a sampler and a trainer,
# each its own process, improve it under the async protocol (live view, summary, plots).
# Extra arguments go to `echorl demo` (e.g. --task countdown --steps 60).
source "$(dirname "$0")/_venv.sh"
exec .venv/bin/echorl demo "$@"
