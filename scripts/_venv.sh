# Sourced by demo.sh and test.sh: create or reuse .venv, install torch (CPU build) first, then echorl.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first and pinned, so nothing later pulls a multi-GB CUDA build.
log=.venv/install.log
install() { .venv/bin/python -m pip install -q "$@" >>"$log" 2>&1 || { cat "$log"; exit 1; }; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "installing torch 2.13.0 (CPU) and echorl into .venv (log: $log)"
  install --upgrade pip
  install "torch==2.13.0"
fi
install -e ".[test]"
export HF_HUB_OFFLINE=1
