#!/usr/bin/env bash
# Issue 49, item 4: one RL step of each paper recipe below at its 80 GB budget, on random weights of
# the exact shapes, one wave of the planned KV slots, responses stopped at STOP_AT tokens (the plan,
# the engine's KV cache and its sequence length stay the recipe's full step; each row's `lowered`
# says what ran). One recipe per call keeps each under the device's 10-minute limit; the rows
# accumulate in OUT_DIR/paper-recipes-<gpu>.json (--append, from the committed bench/results/ file).
# Run from the repository root on an 80 GB GPU:
#   QERL_COMMIT=<commit> bash bench/scripts/paper_recipes_gpu_run.sh OUT_DIR PART [STOP_AT]
#   PART: qerl-7b, bf16-lora-7b, qlora-7b, qerl-32b, qerl-32b-fp8kv
set -uo pipefail
: "${QERL_COMMIT:?set QERL_COMMIT to the commit being measured (git rev-parse --short HEAD, here)}"
export QERL_COMMIT PYTHONUNBUFFERED=1
out="${1:?OUT_DIR}"
part="${2:?PART}"
stop_at="${3:-512}"
case "$part" in
  qerl-7b) recipe=recipes/paper/gsm8k-qwen2.5-7b-qerl.yaml ;;
  bf16-lora-7b) recipe=recipes/paper/gsm8k-qwen2.5-7b-bf16-lora.yaml ;;
  qlora-7b) recipe=recipes/paper/gsm8k-qwen2.5-7b-qlora.yaml ;;
  qerl-32b) recipe=recipes/paper/bigmath-qwen2.5-32b-qerl.yaml ;;
  qerl-32b-fp8kv) recipe=recipes/paper/bigmath-qwen2.5-32b-qerl-fp8kv.yaml ;;
  *) echo "unknown PART $part" >&2; exit 2 ;;
esac
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o 'H[0-9]*' | head -1 | tr 'H' 'h')
file="paper-recipes-${gpu:-gpu}.json"
mkdir -p "$out"
[[ -f "bench/results/$file" ]] && cp -n "bench/results/$file" "$out/$file"
python3 -m qerl_pipe bench train-step --recipe "$recipe" --one-wave --stop-at "$stop_at" --timed-steps 1 \
  --append --out "$out/$file" 2> "$out/paper-$part.err" > /dev/null
tail -4 "$out/paper-$part.err"
