#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with an NVIDIA GPU and PyTorch (docs/benchmarks.md: On a GPU):
#   1. the trainer's step on the 50m preset, the policy alone and as a one-rank FSDP2 world
#      (torchrun, NCCL), 16 x 8 completions of 64 tokens;
#   2. the samplers' engines on the GPU: tokens/s, weight and adapter swaps, log-prob
#      mismatch, hf (and vllm, where it is installed);
#   3. the demo end to end on the GPU: broker, 2 samplers and the trainer as a one-rank FSDP2
#      world under torchrun (model.device=cuda, train.parallel=fsdp2).
#
#   bash bench/gpu_check.sh OUT          # results and logs in OUT
#   DEVICE=cpu PRESET=1m bash bench/gpu_check.sh /tmp/check   # the same path on a CPU
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-bench/results/gpu}
device=${DEVICE:-cuda}
preset=${PRESET:-50m}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
log="$out/gpu_check.log"
step() { echo "=== $* ($(date -u +%T))" | tee -a "$log"; }

step machine
{
  nvidia-smi -L 2>&1 || true
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  python3 -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1
} 2>&1 | tee -a "$log"

step "1. trainer step, $preset, plain and FSDP2 (one rank)"
timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
  bench/trainer_step.py --device "$device" --preset "$preset" 2>&1 | tee -a "$log"
cp bench/results/trainer_step_"${device%%:*}".json "$out"/ 2>/dev/null

step "2. engines on $device"
timeout 150 python3 bench/engines.py --backends hf vllm --device "$device" \
  --presets 10m "$preset" --new-tokens 64 --json "$out/engines_$device.json" 2>&1 | tee -a "$log"

step "3. echorl run on $device (async, 2 samplers, an FSDP2 trainer of one rank, 40 steps)"
run=$(mktemp -d)/run
timeout 240 python3 -m echorl.cli run --out "$run" -o model.device="$device" \
  -o broker.mode=async -o launch.samplers=2 -o train.steps=40 -o train.eval_prompts=100 \
  -o train.parallel=fsdp2 \
  2>&1 | tail -40 | tee -a "$log"
cp "$run"/metrics.jsonl "$run"/reward_curve.png "$out"/ 2>/dev/null
cat "$run"/logs/trainer.log >"$out"/trainer.log 2>/dev/null
step done
