#!/usr/bin/env bash
# Issues 47 and 50 on one GPU call: the FP8 GPU tests, the FP8 rows against cuBLAS bf16 and our
# W4A16, and the 7B rollouts side by side (FP8 activations, FP8 KV cache). Writes into OUT_DIR
# (default: bench/results/fp8-run); each bench rewrites its file after every row, so a run cut
# short still leaves what it measured. Run from the repository root on a GPU with FP8 tensor cores:
#   QERL_COMMIT=<commit> bash bench/scripts/fp8_gpu_run.sh [OUT_DIR] [PART]    PART: tests, rows, act, kv, kv32 or all
# QERL_COMMIT names the commit in each results file: a device's copy of the tree can carry a stale .git.
set -uo pipefail
: "${QERL_COMMIT:?set QERL_COMMIT to the commit being measured (git rev-parse --short HEAD, here)}"
export QERL_COMMIT
out="${1:-bench/results/fp8-run}"
part="${2:-all}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

if [[ "$part" == all || "$part" == tests ]]; then
  python3 -m pytest -q -m gpu tests/kernels/test_fp8_gpu.py tests/kernels/test_decode_kernels_gpu.py tests/engine/test_engine_gpu.py -s \
    -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log" | tail -30
fi
if [[ "$part" == all || "$part" == rows ]]; then
  python3 -m qerl_pipe bench fp8-rows --out "$out/fp8-rows.json" > /dev/null 2> "$out/fp8-rows.err"
  tail -3 "$out/fp8-rows.err"
fi
if [[ "$part" == all || "$part" == act ]]; then
  # Issue 47's rollout rows: 1024 tokens, NVFP4 and bf16 with and without FP8 activations.
  python3 -m qerl_pipe bench rollout --shapes qwen2.5-7b --formats bf16,bf16+fp8,nvfp4,nvfp4+fp8 \
    --batches 1,8,64,256 --hf-batches '' --new-tokens 1024 --out "$out/rollout-fp8-7b.json" \
    2> "$out/rollout-fp8-7b.err" | grep -E "qerl-engine" || tail -3 "$out/rollout-fp8-7b.err"
fi
if [[ "$part" == all || "$part" == kv ]]; then
  # Issue 50's decode-step row: batch 256 at a ~3.8k-token mean context, bf16 against FP8 KV.
  python3 -m qerl_pipe bench rollout --shapes qwen2.5-7b --formats nvfp4+fp8,nvfp4+fp8+fp8kv,nvfp4,nvfp4+fp8kv --batches 256 \
    --hf-batches '' --prompt-len 3584 --new-tokens 512 --out "$out/rollout-fp8-kv-7b.json" \
    2> "$out/rollout-fp8-kv-7b.err" | grep -E "qerl-engine" || tail -3 "$out/rollout-fp8-kv-7b.err"
fi
if [[ "$part" == all || "$part" == kv32 ]]; then
  # Issue 50's 32B row: the slots the 80 GB plan gives each cache (16 bf16, 32 FP8) at the mean
  # context of a BigMath wave (1,024 + 8,192 / 2 ~ 5.1k): a 512-token run from a 4,608-token prompt.
  python3 -m qerl_pipe bench rollout --shapes qwen2.5-32b --formats nvfp4,nvfp4+fp8kv --batches 16,32 \
    --hf-batches '' --prompt-len 4608 --new-tokens 512 --out "$out/rollout-fp8-kv-32b.json" \
    2> "$out/rollout-fp8-kv-32b.err" | grep -E "qerl-engine" || tail -3 "$out/rollout-fp8-kv-32b.err"
fi
