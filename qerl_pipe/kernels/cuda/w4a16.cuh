// NVFP4 x bf16 (W4A16) kernels for Hopper over the chunk layout of qerl_pipe/kernels/tiled.py.
// Torch-free: the launchers take raw pointers and a stream, so CI compiles this file with nvcc
// alone (binding.cpp is the torch glue). The layout constants and the code decode come from the
// generated header w4a16_layout.h, rendered from the Python spec.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "w4a16_layout.h"

namespace qerl_w4a16 {

struct GemmParams {
  const __nv_bfloat16* x;  // [M, K], rows ldx elements apart
  int64_t ldx;
  const uint4* qweight;    // [NB, KC, kWords / 4]
  const uint8_t* scales;   // [NB, KC, kScaleBytes]
  const float* global_scale;  // [1]
  const __nv_bfloat16* bias;  // [N] or null
  // LoRA expand in the epilogue (out += u @ lora_b^T), or null: u = x A^T of the stacked adapters
  // [M, lora_rank] (rows ldu elements apart), lora_b [N, lora_rank] contiguous, block-diagonal
  // across fused projections, scaling folded in; lora_rank a multiple of 16.
  const __nv_bfloat16* lora_u;
  int64_t ldu;
  const __nv_bfloat16* lora_b;
  int lora_rank;
  __nv_bfloat16* out;      // [M, N], rows ldo elements apart
  int64_t ldo;
  __nv_bfloat16* xf;       // [fragment_rows, KC * kCols]: x in fragment order (wgmma configs)
  float* partials;         // [splits, M, NB * kRows] when splits > 1
  int* counters;           // one per CTA of a (x, z) grid slice, zero between launches
  int M, N, K, KC, chunks_per_split;
  // Grouped (a MoE layer's experts), or null: `groups` weights stacked along their 64-row blocks,
  // `group_blocks` blocks each, N one weight's rows. Weight e multiplies rows group_offsets[e] to
  // group_offsets[e + 1] of x (int64 [groups + 1] on the device; M = the last) into the same rows
  // of out, with global_scale[e]; no weight gets more than group_max_rows of them (the grid's
  // passes). The grid has group_slots slots of a weight's blocks: slot s serves weight
  // group_active[s] (int32 on the device, the weights with rows first, -1 past them: a batch-1
  // step launches 8 experts' CTAs, not 128), or weight s where group_active is null. The
  // register-ring kernel, one K split, no LoRA, no bias, no PDL (the offsets are read first).
  const int64_t* group_offsets;
  const int* group_active;
  int groups, group_slots, group_blocks, group_max_rows;
};

// Launch config of the decode GEMM: rows per warp = 16 * mt (2 or 4 m16 tiles; 1: the wgmma
// kernel, a warpgroup per 64 rows), tokens per pass = 8 * nb (1, 2, 4 or 8 n8 blocks; wgmma 8, 16
// or 32), warps per CTA, of which wk share each warp tile along K, chunks in flight per warp
// (register-ring kernel), K splits across CTAs, whether the launch may overlap the previous kernel
// (programmatic dependent launch: weights prefetched before its results are read), and stages: 0
// for the register-ring kernel, else the depth of the wgmma kernel's shared-memory pipeline.
struct GemmConfig {
  int mt, nb, warps, wk, depth, splits, pdl, stages;
};

// CTAs of config `c` that fit on one SM at once (0 for a config with no compiled kernel).
int gemm_blocks_per_sm(const GemmConfig& c);

// Rows of the fragment-order copy of x that config `c` needs for M tokens (whole passes; 0 for
// the kernels that read x as it is).
int fragment_rows(const GemmConfig& c, int M);

// Returns cudaErrorInvalidConfiguration for a config with no compiled kernel.
cudaError_t launch_gemm(const GemmParams& p, const GemmConfig& c, cudaStream_t stream);

// W as bf16 [N, K] (rows ldo elements apart): code * scale * global_scale, rounded once.
cudaError_t launch_dequant(const uint4* qweight, const uint8_t* scales, const float* global_scale,
                           __nv_bfloat16* out, int64_t ldo, int N, int K, int KC,
                           cudaStream_t stream);

}  // namespace qerl_w4a16
