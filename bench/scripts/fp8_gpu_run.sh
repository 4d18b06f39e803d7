#!/usr/bin/env bash
# Issues 47 and 50 on one GPU call: the FP8 GPU tests, the FP8 rows against cuBLAS bf16 and our
# W4A16, the 7B rollouts side by side (FP8 activations) and the coded KV caches. Writes into OUT_DIR
# (default: bench/results/fp8-run); the rollout and rows benches rewrite their files after every row, so a run cut
# short still leaves what it measured. Run from the repository root on a GPU with FP8 tensor cores:
#   QERL_COMMIT=<commit> bash bench/scripts/fp8_gpu_run.sh [OUT_DIR] [PART]    PART: tests, rows, act, step, kv, kv32 or all
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
  # The rows that set fp8.OURS_MAX_ROWS and engine.fp8.NVFP4_MIN_ROWS (32 and 128 unmeasured at
  # e036380), with our GEMM's config grid.
  python3 -m qerl_pipe bench fp8-rows --ms 16,32,64,128,256 --sweep --out "$out/fp8-rows.json" > /dev/null \
    2> "$out/fp8-rows.err"
  grep -E "^M " "$out/fp8-rows.err" || tail -3 "$out/fp8-rows.err"
fi
if [[ "$part" == all || "$part" == act ]]; then
  # Issue 47's rollout rows: 1024 tokens, NVFP4 and bf16 with and without FP8 activations; the
  # target rows first (0e4d2cf's run was cut after 13 rows, before any NVFP4 + FP8 row past batch 1).
  python3 -m qerl_pipe bench rollout --shapes qwen2.5-7b --formats nvfp4+fp8,bf16,nvfp4+fp8+fp8kv,bf16+fp8,nvfp4 \
    --batches 64,256,8,1 --hf-batches '' --new-tokens 1024 --out "$out/rollout-fp8-7b.json" \
    2> "$out/rollout-fp8-7b.err" | grep -E "qerl-engine" || tail -3 "$out/rollout-fp8-7b.err"
fi
if [[ "$part" == all || "$part" == step ]]; then
  # Issue 47's RL step: 8 x 8, 256 + 1024 tokens, the FP8 rollout (activations + KV cache, then activations
  # alone) over NVFP4 against bf16 LoRA.
  python3 -m qerl_pipe bench train-step --shape qwen2.5-7b --quant nvfp4+fp8+fp8kv,bf16,nvfp4+fp8,nvfp4 --timed-steps 2 \
    --out "$out/train-step-fp8-7b.json" 2> "$out/train-step-fp8-7b.err" > /dev/null
  grep -E "^qwen2.5-7b" "$out/train-step-fp8-7b.err" || tail -3 "$out/train-step-fp8-7b.err"
fi
if [[ "$part" == all || "$part" == kv ]]; then
  # Issue 50: the coded-cache attention tests, the kernel alone per configuration, then the
  # decode-step row: batch 256 at a 4,096-token context, bf16 against the coded caches
  # (graph-replayed steps over filled caches: no prefill).
  python3 -m pytest -q -m gpu tests/kernels/test_fp8_gpu.py -k coded_kv_attention -p no:cacheprovider 2>&1 \
    | tee "$out/gpu-tests-kv-attention.log" | tail -2
  python3 -m qerl_pipe bench attention --shapes qwen2.5-7b,qwen2.5-32b --batches 64,256 --context 3712 \
    --out "$out/attention.json" > /dev/null 2> "$out/attention.err"
  grep -v Warn "$out/attention.err" | tail -40
  python3 -m qerl_pipe bench decode-profile --shape qwen2.5-7b --batch 256 \
    --formats nvfp4,nvfp4+fp8kv,nvfp4+int8kv \
    --context 4096 --steps 3 --out "$out/decode-kv-7b.json" 2> "$out/decode-kv-7b.err" > /dev/null
  grep -E "graph replay" "$out/decode-kv-7b.err" || tail -3 "$out/decode-kv-7b.err"
fi
if [[ "$part" == all || "$part" == kv32 ]]; then
  # Issue 50's 32B row: the slots the 80 GB plan gives each cache (16 bf16, 32 coded) at the mean
  # context of a BigMath wave (1,024 + 8,192 / 2 ~ 5.1k), decode tokens/s from graph-replayed steps.
  python3 -m qerl_pipe bench decode-profile --shape qwen2.5-32b \
    --formats nvfp4@16,nvfp4+fp8kv@32,nvfp4+int8kv@32 \
    --batch 16 --context 5120 --steps 3 --out "$out/decode-kv-32b.json" 2> "$out/decode-kv-32b.err" > /dev/null
  grep -E "graph replay" "$out/decode-kv-32b.err" || tail -3 "$out/decode-kv-32b.err"
fi
