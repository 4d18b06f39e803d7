// NVFP4 W4A16 decode GEMM (M <= 64 per pass) and the full-bandwidth dequantize pass.
//
// GEMM: out[M, N] = x[M, K] @ W^T with W in the chunk layout (tiled.py). Each warp owns 16 * MT
// output rows and walks the chunks of one K split: per chunk it loads 16 * MT / 2 bytes of codes
// and 4 * MT / 2 bytes of scales per lane (the 1152-byte chunk stream of its rows), decodes them
// in registers straight into mma.m16n8k16 A fragments (weights = A, tokens = B: a token count of
// 1-8 wastes no MMA rows of weights), and keeps DEPTH chunks of loads in flight in a register
// ring. K splits are summed in a fixed order by the last CTA of each column slice to arrive (an
// atomic ticket, no atomics on the output), so a given config gives bit-identical results. The
// epilogue adds a bias and a LoRA expand (u @ B^T, as more MMAs) before the one bf16 rounding.
#include "w4a16.cuh"

namespace qerl_w4a16 {
namespace {

__device__ __forceinline__ uint4 load_stream(const uint4* p, uint64_t policy) {
  // Weights are read once: keep them out of L1 (the activations live there) and first in line
  // for eviction from L2.
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p), "l"(policy));
  return v;
}

__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  // code * scale is exact in bf16 (at most 5 significant bits), so the rounding mode is moot.
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Programmatic dependent launch (a no-op when the kernel was launched without it).
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// 16 bytes global -> shared without a register round trip; `valid` false writes zeros (a token
// past M or columns past K must add nothing, whatever the padded weights hold).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ uint32_t low_pair(uint32_t v) { return __byte_perm(v, 0, 0x1010); }
__device__ __forceinline__ uint32_t high_pair(uint32_t v) { return __byte_perm(v, 0, 0x3232); }

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  // Not volatile: the compiler may then schedule the MMAs among the decodes (a volatile asm
  // keeps program order, which serialized decode -> MMA -> decode on one set of registers).
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Scale word [s(T, g), s(T+1, g), s(T, g+8), s(T+1, g+8)] -> bf16 pairs {s(T, g), s(T, g+8)}
// and {s(T+1, g), s(T+1, g+8)}.
__device__ __forceinline__ void decode_scales(uint32_t w, uint32_t& first, uint32_t& second) {
  first = ((w << 4) & kScaleAnd) | kScaleOr;
  second = ((w >> 4) & kScaleAnd) | kScaleOr;
}

// The 4 A registers of word `q`, times the tile's scales: registers 0 and 2 are row g, 1 and 3
// row g + 8.
__device__ __forceinline__ void scaled_fragment(uint32_t q, uint32_t scale_pair, uint32_t (&a)[4]) {
  decode_word(q, a);
  const uint32_t lo = low_pair(scale_pair), hi = high_pair(scale_pair);
  a[0] = bf16x2_mul(a[0], lo);
  a[1] = bf16x2_mul(a[1], hi);
  a[2] = bf16x2_mul(a[2], lo);
  a[3] = bf16x2_mul(a[3], hi);
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// f(row, token, value) for each accumulator of this lane: the mma C fragment holds rows g (c0, c1)
// and g + 8 (c2, c3) of each m16 tile, tokens 2t and 2t + 1 of each n8 block.
template <int MT, int NB, class F>
__device__ __forceinline__ void for_each_output(const float (&acc)[MT][NB][4], int row_base, int m0, int g, int t,
                                                F&& f) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(row_base + i * 16 + g + (e >> 1) * 8, m0 + b * 8 + 2 * t + (e & 1), acc[i][b][e]);
}

__device__ __forceinline__ float add_bias(float v, const __nv_bfloat16* bias, int row) {
  return bias != nullptr ? v + __bfloat162float(bias[row]) : v;
}

template <int MT, int NB>
__device__ __forceinline__ void scale_all(float (&acc)[MT][NB][4], float gs) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][b][e] *= gs;
}

// 2 bf16 at `p` (4-byte aligned) as one register, or zeros.
__device__ __forceinline__ uint32_t pair_or_zero(const __nv_bfloat16* p, bool ok) {
  return ok ? *reinterpret_cast<const uint32_t*>(p) : 0u;
}

// The LoRA expand, out += u @ B^T, as more MMAs into the global-scaled accumulators of this
// warp's 16 * MT rows and the pass's 8 * NB tokens: A = B's rows, the MMA's B operand = u's rows,
// over the stacked rank in k16 steps (the plain mma k order: nothing here is tiled). B is
// block-diagonal across fused projections (zeros outside a row's own adapter), so no row needs to
// know its projection, and each output adds its rank's products in one fixed order. At decode
// token counts (NB <= 2) steps run in groups of four whose loads are all issued before their MMAs
// (the main loop's registers are free by now), so a rank of 64 waits out one load latency, not
// four; with more tokens the loads of the NB blocks already overlap, and four steps' worth of them
// would spill. Plain loads: under PDL, u is written by the previous kernel (visible after
// griddepcontrol.wait).
template <int MT, int NB>
__device__ __forceinline__ void add_lora(const GemmParams& p, float (&acc)[MT][NB][4], int row_base, int m0, int g,
                                         int t) {
  constexpr int kLoraSteps = NB <= 2 ? 4 : 1;
#pragma unroll 1
  for (int k00 = 0; k00 < p.lora_rank; k00 += 16 * kLoraSteps) {
    uint32_t a[kLoraSteps][MT][4];
#pragma unroll
    for (int s = 0; s < kLoraSteps; ++s) {
      const int k0 = k00 + 16 * s + 2 * t;
      const bool step = k00 + 16 * s < p.lora_rank;
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const int r0 = row_base + i * 16 + g, r1 = r0 + 8;
        const __nv_bfloat16* b0 = p.lora_b + (size_t)r0 * p.lora_rank + k0;
        const __nv_bfloat16* b1 = p.lora_b + (size_t)r1 * p.lora_rank + k0;
        a[s][i][0] = pair_or_zero(b0, step && r0 < p.N);
        a[s][i][1] = pair_or_zero(b1, step && r1 < p.N);
        a[s][i][2] = pair_or_zero(b0 + 8, step && r0 < p.N);
        a[s][i][3] = pair_or_zero(b1 + 8, step && r1 < p.N);
      }
    }
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const int token = m0 + b * 8 + g;
      const __nv_bfloat16* u = p.lora_u + (size_t)token * p.ldu + k00 + 2 * t;
      uint32_t u0[kLoraSteps], u1[kLoraSteps];
#pragma unroll
      for (int s = 0; s < kLoraSteps; ++s) {
        const bool ok = k00 + 16 * s < p.lora_rank && token < p.M;
        u0[s] = pair_or_zero(u + 16 * s, ok);
        u1[s] = pair_or_zero(u + 16 * s + 8, ok);
      }
#pragma unroll
      for (int s = 0; s < kLoraSteps; ++s)
#pragma unroll
        for (int i = 0; i < MT; ++i) mma_bf16(acc[i][b], a[s][i], u0[s], u1[s]);
    }
  }
}

// Pull this warp's rows of the LoRA B into L2 while the main loop runs (B is a weight, read once
// per step from HBM; the epilogue would otherwise wait out that latency at the end).
__device__ __forceinline__ void prefetch_lora(const GemmParams& p, int row_base, int rows, int lane) {
  if (p.lora_b == nullptr) return;
  const int bytes = rows * p.lora_rank * 2;  // contiguous: the rows are consecutive
  const char* base = reinterpret_cast<const char*>(p.lora_b + (size_t)row_base * p.lora_rank);
  const int limit = (p.N - row_base) * p.lora_rank * 2;
  for (int off = lane * 128; off < bytes && off < limit; off += 32 * 128)
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(base + off));
}

// The rows of x and out a CTA multiplies. A plain launch: all of them (these inline to M and 0,
// so the dense kernels compile as they did before grouped launches existed).
template <bool GROUPED>
struct Rows {
  __device__ __forceinline__ void place(const GemmParams&, int&, int&) {}
  __device__ __forceinline__ int64_t token0() const { return 0; }  // first row of x / out
  __device__ __forceinline__ int m(const GemmParams& p) const { return p.M; }  // rows
  __device__ __forceinline__ int group() const { return 0; }  // the weight (its global scale)
  __device__ __forceinline__ int out_block(int nblock) const { return nblock; }  // block within it
  __device__ __forceinline__ int n_pad(int n_blocks) const { return n_blocks * kRows; }  // its rows, padded
  __device__ __forceinline__ int row_shift() const { return 0; }  // first grid row of its slot
};

// A grouped launch (a MoE layer's experts): the CTA's expert's rows, from the offsets on the
// device. The host makes a CTA's rows divide an expert's, so every warp of a CTA has one slot;
// `place` re-points nblock at the stacked block of the slot's expert.
template <>
struct Rows<true> {
  int64_t first;
  int rows, weight, block, padded, shift;
  __device__ __forceinline__ void place(const GemmParams& p, int& nblock, int& n_blocks) {
    const int slot = nblock / p.group_blocks;
    block = nblock - slot * p.group_blocks;
    shift = slot * p.group_blocks * kRows;
    const int chosen = p.group_active != nullptr ? p.group_active[slot] : slot;
    weight = chosen >= 0 ? chosen : 0;
    first = p.group_offsets[weight];
    rows = chosen >= 0 ? static_cast<int>(p.group_offsets[weight + 1] - first) : 0;
    n_blocks = p.groups * p.group_blocks;
    nblock = weight * p.group_blocks + block;
    padded = p.group_blocks * kRows;
  }
  __device__ __forceinline__ int64_t token0() const { return first; }
  __device__ __forceinline__ int m(const GemmParams&) const { return rows; }
  __device__ __forceinline__ int group() const { return weight; }
  __device__ __forceinline__ int out_block(int) const { return block; }
  __device__ __forceinline__ int n_pad(int) const { return padded; }
  __device__ __forceinline__ int row_shift() const { return shift; }
};

// Where a CTA's warp sits: its n8 rows (warp tile), its share of K, its tokens. The passes over
// M of one (column slice, K split) are consecutive in launch order, so they run side by side and
// share each weight chunk through L2: M > 8 * NB still reads the weights from HBM once.
template <int MT, int WN, int WK, int NB, bool GROUPED = false>
struct Place {
  int lane, wn, wk, g, t;
  int columns, bx, by, bz;  // column slice, K split, pass over M
  int nblock, pair0, n_blocks, kc0, kc1, m0;
  Rows<GROUPED> rows;
  __device__ __forceinline__ Place(const GemmParams& p) {
    constexpr int kWarpTilesPerBlock = kRows / (16 * MT);
    lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    wn = warp / WK;
    wk = warp % WK;
    g = lane >> 2;
    t = lane & 3;
    const int passes = gridDim.z;
    columns = gridDim.x;
    const int linear = blockIdx.x + columns * (blockIdx.y + gridDim.y * blockIdx.z);
    bz = linear % passes;
    bx = linear / passes % columns;
    by = linear / passes / columns;
    const int warp_tile = bx * WN + wn;
    nblock = warp_tile / kWarpTilesPerBlock;
    pair0 = MT == 4 ? 0 : warp_tile % kWarpTilesPerBlock;
    n_blocks = (p.N + kRows - 1) / kRows;
    kc0 = by * p.chunks_per_split;
    kc1 = min(kc0 + p.chunks_per_split, p.KC);
    m0 = bz * 8 * NB;
    rows.place(p, nblock, n_blocks);
  }
  // The rows whose LoRA expand this warp will add (first K split only; see add_lora).
  __device__ __forceinline__ void prefetch_lora_rows(const GemmParams& p) const {
    if (wk == 0 && by == 0 && nblock < n_blocks) prefetch_lora(p, nblock * kRows + pair0 * 16 * MT, 16 * MT, lane);
  }
};

template <int MT, int NB>
__device__ __forceinline__ void zero(float (&acc)[MT][NB][4]) {
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][b][e] = 0.f;
}

// Decode a whole chunk (codes[q] and scale words of this lane's 16 * MT rows) into A fragments
// before its MMAs, so that the MMAs have independent operands to overlap.
template <int MT>
__device__ __forceinline__ void decode_chunk(const uint4 (&codes)[MT / 2], const uint32_t (&scales)[MT / 2],
                                             uint32_t (&a)[MT][2][4]) {
#pragma unroll
  for (int q = 0; q < MT / 2; ++q) {
    uint32_t sp[2];
    decode_scales(scales[q], sp[0], sp[1]);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) scaled_fragment(word_of(codes[q], i * 2 + j), sp[i], a[2 * q + i][j]);
  }
}

// The MMAs of n8 block b: x holds token 8b + g's 8 activations of this lane (both k16 steps).
template <int MT, int NB>
__device__ __forceinline__ void mma_block(float (&acc)[MT][NB][4], const uint32_t (&a)[MT][2][4], int b,
                                          const uint4& x) {
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int tile = 0; tile < MT; ++tile) mma_bf16(acc[tile][b], a[tile][j], word_of(x, 2 * j), word_of(x, 2 * j + 1));
}

// After the main loop: sum the K-warps of each warp tile through `red` (shared memory, at least
// (WK - 1) * WN * 32 * MT * NB float4s; free for reuse), then write out[] (one K split) or park
// this split's sums and let the last CTA of the column slice add them up in split order (an atomic
// ticket, no atomics on the output: a given config gives bit-identical results).
template <int MT, int NB, int WN, int WK, bool GROUPED>
__device__ __forceinline__ void finish_tile(const GemmParams& p, const Place<MT, WN, WK, NB, GROUPED>& at,
                                            float (&acc)[MT][NB][4], float4* red) {
  constexpr int kAcc4 = MT * NB;  // float4s of accumulators per lane
  if constexpr (WK > 1) {
    // A fixed order (warp order), so results repeat exactly.
    if (at.wk > 0) {
      float4* dst = red + ((at.wk - 1) * WN + at.wn) * 32 * kAcc4 + at.lane;
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int b = 0; b < NB; ++b)
          dst[(i * NB + b) * 32] = make_float4(acc[i][b][0], acc[i][b][1], acc[i][b][2], acc[i][b][3]);
    }
    __syncthreads();
    if (at.wk == 0) {
      for (int w = 1; w < WK; ++w) {
        const float4* src = red + ((w - 1) * WN + at.wn) * 32 * kAcc4 + at.lane;
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
          for (int b = 0; b < NB; ++b) {
            const float4 v = src[(i * NB + b) * 32];
            acc[i][b][0] += v.x;
            acc[i][b][1] += v.y;
            acc[i][b][2] += v.z;
            acc[i][b][3] += v.w;
          }
      }
    }
  }
  const bool writer = at.wk == 0 && at.nblock < at.n_blocks;
  const int row_base = at.rows.out_block(at.nblock) * kRows + at.pair0 * 16 * MT;  // in this CTA's weight
  if (writer) {
    // The global scale in fp32 before anything is added (each split's sums too), then the LoRA
    // expand once per output (by the first K split).
    scale_all(acc, p.global_scale[at.rows.group()] * kProductScale);
    if (p.lora_b != nullptr && at.by == 0) add_lora<MT, NB>(p, acc, row_base, at.m0, at.g, at.t);
  }
  if (gridDim.y == 1) {
    if (!writer) return;
    for_each_output(acc, row_base, at.m0, at.g, at.t, [&](int row, int token, float v) {
      if (row < p.N && token < at.rows.m(p))
        p.out[(size_t)(at.rows.token0() + token) * p.ldo + row] = __float2bfloat16_rn(add_bias(v, p.bias, row));
    });
    return;
  }
  const int n_pad = at.rows.n_pad(at.n_blocks);
  if (writer) {
    for_each_output(acc, row_base, at.m0, at.g, at.t, [&](int row, int token, float v) {
      if (token < at.rows.m(p)) __stcg(p.partials + ((size_t)at.by * p.M + at.rows.token0() + token) * n_pad + row, v);
    });
  }
  __threadfence();
  __syncthreads();
  __shared__ int is_last;
  int* counter = p.counters + at.bz * at.columns + at.bx;
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == (int)gridDim.y - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // Four rows per thread (16-byte loads; rows of the padded workspace are 64-aligned) and the
  // splits' loads unrolled, so this one CTA's tail is bandwidth-, not latency-bound: at 64 tokens
  // it reads splits x 64 x 4 * kCtaRows bytes. Each sum still runs in split order.
  constexpr int kCtaRows = WN * 16 * MT;
  constexpr int kQuads = kCtaRows / 4;
  const int row0 = at.bx * kCtaRows - at.rows.row_shift();
  const int tokens = min(8 * NB, at.rows.m(p) - at.m0);
  const int splits = gridDim.y;
  const size_t split_stride = (size_t)p.M * n_pad;
  for (int idx = threadIdx.x; idx < tokens * kQuads; idx += blockDim.x) {
    const int64_t token = at.rows.token0() + at.m0 + idx / kQuads;
    const int row = row0 + idx % kQuads * 4;
    if (row >= p.N) continue;
    const float* part = p.partials + (size_t)token * n_pad + row;
    float4 sum = __ldcg(reinterpret_cast<const float4*>(part));
#pragma unroll 4
    for (int s = 1; s < splits; ++s) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(part + s * split_stride));
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    const float v[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (row + j < p.N) p.out[(size_t)token * p.ldo + row + j] = __float2bfloat16_rn(add_bias(v[j], p.bias, row + j));
  }
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (and CUDA-graph replay)
}

template <int MT, int NB>
struct Stage {
  uint4 codes[MT / 2];
  uint32_t scales[MT / 2];
  uint4 x[NB];
};

// Register-ring kernel. One CTA: WN x WK warps. The WN warps of a K-warp group own consecutive
// 16 * MT-row warp tiles; the WK warps that share a warp tile take every WK-th chunk of the CTA's
// K split and are summed through shared memory in warp order at the end (more warps streaming
// one tile without more global split-K traffic, which grows with M). Each warp keeps DEPTH chunks
// of its own weight and activation loads in flight in registers. One pass of 8 * NB tokens:
template <int MT, int NB, int WN, int WK, int DEPTH, bool GROUPED>
__device__ __forceinline__ void gemm_pass(const GemmParams& p, const Place<MT, WN, WK, NB, GROUPED>& at, float4* red) {
  const int g = at.g, t = at.t, wk = at.wk, kc0 = at.kc0;
  // This warp's chunks: kc0 + wk + j * WK for j < mine.
  const int mine = at.kc1 - kc0 > wk ? (at.kc1 - kc0 - wk + WK - 1) / WK : 0;

  float acc[MT][NB][4];
  zero(acc);

  if (at.nblock < at.n_blocks) {
    const uint64_t policy = evict_first_policy();
    const uint4* wbase = p.qweight + ((size_t)at.nblock * p.KC + kc0 + wk) * (kWords / 4) + at.pair0 * 32 + at.lane;
    const uint8_t* sbase = p.scales + ((size_t)at.nblock * p.KC + kc0 + wk) * kScaleBytes + (g * 2 + (t >> 1)) * 8 +
                           (MT == 2 ? 4 * at.pair0 : 0);
    const __nv_bfloat16* xrow[NB];
    bool xvalid[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const int token = at.m0 + b * 8 + g;
      xvalid[b] = token < at.rows.m(p);
      xrow[b] = p.x + (size_t)(at.rows.token0() + (xvalid[b] ? token : 0)) * p.ldx + (kc0 + wk) * kCols + t * 8;
    }
    auto load_weights = [&](Stage<MT, NB>& st, int j) {  // this warp's j-th chunk
      const size_t step = (size_t)j * WK;
#pragma unroll
      for (int q = 0; q < MT / 2; ++q) st.codes[q] = load_stream(wbase + step * (kWords / 4) + q * 32, policy);
      if (MT == 4) {
        const uint2 s = __ldg(reinterpret_cast<const uint2*>(sbase + step * kScaleBytes));
        st.scales[0] = s.x;
        st.scales[MT / 2 - 1] = s.y;
      } else {
        st.scales[0] = __ldg(reinterpret_cast<const uint32_t*>(sbase + step * kScaleBytes));
      }
    };
    auto load_x = [&](Stage<MT, NB>& st, int j) {
      const size_t step = (size_t)j * WK;
      const bool kvalid = (kc0 + wk + (int)step) * kCols + t * 8 < p.K;
#pragma unroll
      for (int b = 0; b < NB; ++b)
        // A coherent load, not __ldg: under programmatic dependent launch x is written by the
        // previous kernel during this one's lifetime, which the non-coherent path does not allow.
        st.x[b] = (xvalid[b] && kvalid) ? *reinterpret_cast<const uint4*>(xrow[b] + step * kCols)
                                        : make_uint4(0, 0, 0, 0);
    };
    auto compute = [&](const Stage<MT, NB>& st) {
      uint32_t a[MT][2][4];
      decode_chunk<MT>(st.codes, st.scales, a);
#pragma unroll
      for (int b = 0; b < NB; ++b) mma_block<MT, NB>(acc, a, b, st.x[b]);
    };
    Stage<MT, NB> ring[DEPTH];
    // Weights do not depend on the previous kernel: under programmatic dependent launch their
    // first chunks stream while it finishes; x (its output) is read only after the wait.
#pragma unroll
    for (int u = 0; u < DEPTH; ++u)
      if (u < mine) load_weights(ring[u], u);
    grid_dependency_wait();
#pragma unroll
    for (int u = 0; u < DEPTH; ++u)
      if (u < mine) load_x(ring[u], u);
    // Whole groups of DEPTH chunks without a branch around the MMAs (a branch there costs a
    // warp re-convergence per chunk); only the refill loads are predicated.
    int j = 0;
    for (; j + DEPTH <= mine; j += DEPTH) {
#pragma unroll
      for (int u = 0; u < DEPTH; ++u) {
        compute(ring[u]);
        if (j + u + DEPTH < mine) {
          load_weights(ring[u], j + u + DEPTH);
          load_x(ring[u], j + u + DEPTH);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < DEPTH - 1; ++u)
      if (j + u < mine) compute(ring[u]);
  } else {
    grid_dependency_wait();  // no global write before the previous kernel is done with it
  }
  launch_dependents();
  finish_tile(p, at, acc, red);
}

// The pass of the grid's z index.
template <int MT, int NB, int WN, int WK, int DEPTH>
__global__ void __launch_bounds__(WN * WK * 32) gemm_kernel(const GemmParams p) {
  const Place<MT, WN, WK, NB> at(p);
  at.prefetch_lora_rows(p);
  __shared__ float4 red[WK > 1 ? (WK - 1) * WN * 32 * MT * NB : 1];
  gemm_pass<MT, NB, WN, WK, DEPTH>(p, at, red);
}

// Grouped: the pass of the grid's z index over this CTA's expert's rows. A kernel of its own, so
// that the plain kernels compile without the grouped bookkeeping (`Rows<true>`).
template <int MT, int NB, int WN, int WK, int DEPTH>
__global__ void __launch_bounds__(WN * WK * 32) grouped_kernel(const GemmParams p) {
  const Place<MT, WN, WK, NB, true> at(p);
  // An expert without rows, a slot past the routed ones, or a pass past its expert's rows: the
  // whole CTA alike (its rows lie within one expert's).
  if (at.m0 >= at.rows.m(p)) return;
  __shared__ float4 red[WK > 1 ? (WK - 1) * WN * 32 * MT * NB : 1];
  gemm_pass<MT, NB, WN, WK, DEPTH>(p, at, red);
}

// wgmma kernel (M = 33-256 per pass): a warpgroup owns one 64-row block and each of its warps one
// m16 tile; the warps decode their weights from shared memory into registers (the A operand of
// wgmma.m64nNk16, whose per-warp register layout is mma.m16n8k16's) and the tensor cores read the
// activations (B) straight from shared memory, all 64 * P tokens of a pass in one instruction per
// k16 step, accumulators 32 * P floats per thread. Stage s holds one group of two chunks (64
// columns of K): the activations of the pass's tokens in wgmma's K-major, 128-byte swizzled
// layout (rows 128 B, 8-row atoms 1024 B apart), and per warpgroup its block's two chunks of codes
// and scales as copied from the tiled layout. The kernel reads x in fragment order (see
// tiled.fragment_order, written by fragment_kernel just before it): a token's 128 bytes of a group
// are then wgmma's B row in the A fragments' k order, copied as eight 16-byte pieces.
__device__ __forceinline__ uint64_t swizzled_desc(uint32_t addr) {
  // Matrix descriptor: start address >> 4, leading byte offset 16 (unused by swizzled K-major
  // layouts), stride byte offset 1024 (between 8-row atoms), 128-byte swizzle (bits 62-63 = 1).
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(16 >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// Keeps the compiler from moving reads or writes of the accumulators across the asynchronous
// MMAs that own them between issue and wait.
template <int NB>
__device__ __forceinline__ void fence_accumulators(float (&acc)[1][NB][4]) {
#pragma unroll
  for (int b = 0; b < NB; ++b)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[0][b][e])::"memory");
}

// acc += A (this warp's 16 x 16 slice of the 64 x 16 weight tile, in registers) x B (64 * P tokens
// x 16 columns at `desc`), fp32 accumulate; acc[0][b] is mma's C fragment of n8 block b.
template <int P>
__device__ __forceinline__ void wgmma_rs(float (&acc)[1][8 * P][4], const uint32_t (&a)[4], uint64_t desc);
// The accumulator operands of one wgmma: 4 floats per n8 block, 8 blocks per 64 tokens.
#define QERL_ACC(b) "+f"(acc[0][b][0]), "+f"(acc[0][b][1]), "+f"(acc[0][b][2]), "+f"(acc[0][b][3])
#define QERL_ACC64(b)                                                                                \
  QERL_ACC(b), QERL_ACC(b + 1), QERL_ACC(b + 2), QERL_ACC(b + 3), QERL_ACC(b + 4), QERL_ACC(b + 5), \
      QERL_ACC(b + 6), QERL_ACC(b + 7)
template <>
__device__ __forceinline__ void wgmma_rs<1>(float (&acc)[1][8][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
      : QERL_ACC64(0)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma_rs<2>(float (&acc)[1][16][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"
      : QERL_ACC64(0), QERL_ACC64(8)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma_rs<4>(float (&acc)[1][32][4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "{%128, %129, %130, %131}, %132, 1, 1, 1, 0;\n"
      : QERL_ACC64(0), QERL_ACC64(8), QERL_ACC64(16), QERL_ACC64(24)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
#undef QERL_ACC64
#undef QERL_ACC

template <int P, int WG, int STAGES>
struct WgmmaShape {
  static constexpr int kTokens = 64 * P;
  static constexpr int kXBytes = kTokens * 128;                    // per stage
  static constexpr int kChunkBytes = kWords * 4 + kScaleBytes;      // codes, then scales
  static constexpr int kBlockBytes = 2 * kChunkBytes;               // per warpgroup per stage
  static constexpr int kBytes = 1024 + STAGES * (kXBytes + WG * kBlockBytes);  // + alignment slack
  // CTAs per SM that its shared memory allows (228 KB per SM, 1 KB reserved per CTA), at most 4,
  // for one warpgroup: the register budget ptxas must meet so that registers do not cap the CTAs
  // below it (the epilogue's LoRA loads, hoisted, took 130 -> 173 registers at P = 2, 3 -> 2 CTAs).
  static constexpr int kSmemBlocks = 233472 / (kBytes + 1024);
  static constexpr int kMinBlocks = WG == 1 && kSmemBlocks > 1 ? (kSmemBlocks < 4 ? kSmemBlocks : 4) : 1;
};

// x in fragment order (tiled.fragment_order): one thread per (row, chunk) reads the chunk row's 16
// column pairs (words w[4t + u]) and writes them transposed (w[4t + u] to position 4u + t). Rows
// past M and columns past K become zeros: the wgmma kernel then copies whole rows and pieces.
__global__ void __launch_bounds__(256) fragment_kernel(const __nv_bfloat16* x, int64_t ldx, uint4* xf, int M, int K,
                                                       int KC, int rows) {
  // x is the previous kernel's output; the GEMM after this one may start streaming its weights.
  grid_dependency_wait();
  launch_dependents();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<int64_t>(rows) * KC) return;
  const int row = static_cast<int>(i / KC), kc = static_cast<int>(i % KC);
  uint4 in[4] = {};
  if (row < M) {
    // K % 16 == 0 and rows are 16-byte aligned (the binding checks): a chunk holds 2 or 4 pieces.
    const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(row) * ldx + kc * kCols);
    const int pieces = min(4, (K - kc * kCols) / 8);
#pragma unroll
    for (int t = 0; t < 4; ++t)
      if (t < pieces) in[t] = src[t];
  }
  uint4* dst = xf + i * 4;
  dst[0] = make_uint4(in[0].x, in[1].x, in[2].x, in[3].x);
  dst[1] = make_uint4(in[0].y, in[1].y, in[2].y, in[3].y);
  dst[2] = make_uint4(in[0].z, in[1].z, in[2].z, in[3].z);
  dst[3] = make_uint4(in[0].w, in[1].w, in[2].w, in[3].w);
}

template <int P, int WG, int STAGES>
__global__ void __launch_bounds__(WG * 128, (WgmmaShape<P, WG, STAGES>::kMinBlocks)) wgmma_kernel(const GemmParams p) {
  constexpr int NB = 8 * P;
  using Shape = WgmmaShape<P, WG, STAGES>;
  // A group's copies are issued STAGES - 2 groups ahead: the stage being refilled must be neither
  // the one about to be read nor the one the previous group's MMAs may still be reading.
  constexpr int kAhead = STAGES - 2;
  static_assert(STAGES >= 3, "the wgmma pipeline needs three stages");
  extern __shared__ uint8_t smem_raw[];
  // The swizzle is a function of the shared-memory address: stage tiles start 1024-aligned.
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* smem = smem_raw + ((1024 - (raw & 1023)) & 1023);
  uint8_t* ws = smem + STAGES * Shape::kXBytes;
  const uint32_t xs_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

  const Place<1, 4 * WG, 1, NB> at(p);
  at.prefetch_lora_rows(p);
  const int warp = threadIdx.x >> 5, wg = warp >> 2, wq = warp & 3;
  const int groups = (at.kc1 - at.kc0 + 1) / 2;
  const int block0 = at.bx * WG;

  // Every copy's source and destination are fixed per thread up to a per-group stride, so they
  // are worked out once here: the copies are most of the instructions a group issues.
  // Weights: the CTA's WG blocks x 2 chunks x 72 16-byte pieces (64 of codes, 8 of scales); this
  // thread copies pieces threadIdx.x and threadIdx.x + WG * 128 (the second only for i < 16 * WG).
  constexpr int kVecs = Shape::kChunkBytes / 16;  // 72
  constexpr int kPieces = WG * 2 * kVecs, kThreads = WG * 128;
  const char* w_src[2];
  int w_stride[2], w_dst[2], w_h[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = min((int)threadIdx.x + r * kThreads, kPieces - 1);
    const int blk = i / (2 * kVecs), h = i / kVecs % 2, v = i % kVecs;
    // A warpgroup past N (the last CTA column) streams the last real block (L2 hits, results
    // dropped): it must join every barrier of its CTA.
    const size_t chunk0 = (size_t)min(block0 + blk, at.n_blocks - 1) * p.KC + at.kc0 + h;
    w_src[r] = v < kWords / 4 ? reinterpret_cast<const char*>(p.qweight + chunk0 * (kWords / 4) + v)
                              : reinterpret_cast<const char*>(p.scales + chunk0 * kScaleBytes + (v - kWords / 4) * 16);
    w_stride[r] = 2 * (v < kWords / 4 ? kWords * 4 : kScaleBytes);  // bytes per group
    w_dst[r] = (blk * 2 + h) * Shape::kChunkBytes + v * 16;
    w_h[r] = h;
  }
  const bool second_piece = (int)threadIdx.x + kThreads < kPieces;
  auto weights_of_group = [&](int c) {
    uint8_t* dst = ws + (c % STAGES) * WG * Shape::kBlockBytes;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (r == 1 && !second_piece) break;
      const bool ok = 2 * c + w_h[r] < at.kc1 - at.kc0;  // chunk within the split (else zeros)
      // No L2 eviction hint here: with one, ptxas 13.0 emitted a copy whose cache-policy operand
      // sat in an odd uniform register, an illegal instruction on the H200 (compute-sanitizer).
      cp_async16(dst + w_dst[r], ok ? w_src[r] + (size_t)c * w_stride[r] : w_src[r], ok);
    }
  };
  // Activations (fragment order, rows padded to whole passes): piece v (16 bytes) of rows
  // row0 + r * kRowStep. kRowStep is a multiple of 8, so every row of a thread has the same
  // swizzle phase and the same destination column. Pieces of a chunk past the split are
  // zero-filled (their weights are zeros, but x there may hold an inf).
  constexpr int kRowStep = kThreads / 8, kCopies = Shape::kTokens / kRowStep;
  const int v = threadIdx.x & 7, row0 = threadIdx.x >> 3;
  const char* x0 = reinterpret_cast<const char*>(p.x + (size_t)(at.m0 + row0) * p.ldx + at.kc0 * kCols) + 16 * v;
  const int x_step = kRowStep * static_cast<int>(p.ldx) * 2;  // bytes between a thread's rows
  const uint32_t x_dst = row0 * 128 + ((v ^ (row0 & 7)) << 4);
  auto x_of_group = [&](int c) {
    uint8_t* dst = smem + (c % STAGES) * Shape::kXBytes + x_dst;
    const bool ok = 2 * c + (v >> 2) < at.kc1 - at.kc0;
    const char* src = x0 + (ok ? 128 * c : 0);  // an address in bounds either way
#pragma unroll
    for (int r = 0; r < kCopies; ++r) cp_async16(dst + r * kRowStep * 128, src + r * x_step, ok);
  };

  float acc[1][NB][4];
  zero(acc);
  // Weights do not depend on the previous kernel: under programmatic dependent launch the first
  // groups' weights stream while it finishes (one commit group); x only after the wait.
  for (int s = 0; s < kAhead; ++s)
    if (s < groups) weights_of_group(s);
  cp_async_commit();
  grid_dependency_wait();
  for (int s = 0; s < kAhead; ++s) {
    if (s < groups) x_of_group(s);
    cp_async_commit();
  }
  // One group: its copies landed, the next copies issued, its weights decoded into `a` and its
  // MMAs issued; they run on while the next group decodes into the other register set (a set is
  // overwritten only after the wait that retires its MMAs).
  auto group = [&](int c, uint32_t (&a)[4][4]) {
    // Group c's copies are the first c + 2 commit groups of this thread; kAhead + 1 + c are committed.
    cp_async_wait<kAhead - 1>();
    // Group c has landed for every thread, and every warpgroup has retired group c - 2's MMAs
    // (each waits for all but the last group's), so stage (c + kAhead) % STAGES is free.
    __syncthreads();
    if (c + kAhead < groups) {
      weights_of_group(c + kAhead);
      x_of_group(c + kAhead);
    }
    cp_async_commit();
    const uint8_t* w = ws + ((c % STAGES) * WG + wg) * Shape::kBlockBytes;
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // k16 steps 2h + j
      const uint8_t* chunk = w + h * Shape::kChunkBytes;
      // m16 tile wq = 2q + i of the block: words 2i, 2i + 1 of the lane's uint4 q, scale word q.
      const uint2 q = *reinterpret_cast<const uint2*>(chunk + ((wq >> 1) * 32 + at.lane) * 16 + (wq & 1) * 8);
      const uint32_t sw = *reinterpret_cast<const uint32_t*>(chunk + kWords * 4 + (at.g * 2 + (at.t >> 1)) * 8 + (wq >> 1) * 4);
      uint32_t sp[2];
      decode_scales(sw, sp[0], sp[1]);
      const uint32_t s = (wq & 1) ? sp[1] : sp[0];
      scaled_fragment(q.x, s, a[2 * h]);
      scaled_fragment(q.y, s, a[2 * h + 1]);
    }
    const uint32_t x_addr = xs_addr + (c % STAGES) * Shape::kXBytes;
    // Every input of the MMAs (A registers and descriptors) is computed before the fence: ptxas
    // serializes all MMAs of a kernel where another instruction defines one between the fence and
    // the commit.
    uint64_t desc[4];
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      desc[kk] = swizzled_desc(x_addr + kk * 32);
      asm volatile("" : "+l"(desc[kk])::"memory");
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs<P>(acc, a[kk], desc[kk]);
    wgmma_commit();
    wgmma_wait<1>();
  };
  // Pairs of groups with a branch only around whole pairs: ptxas serializes every MMA of a kernel
  // whose MMA pipeline spans a branch (a conditional second group did that).
  uint32_t a0[4][4], a1[4][4];
  fence_accumulators(acc);
  int c = 0;
  for (; c + 1 < groups; c += 2) {
    group(c, a0);
    group(c + 1, a1);
  }
  if (c < groups) group(c, a0);
  wgmma_wait<0>();
  fence_accumulators(acc);
  cp_async_wait<0>();
  launch_dependents();
  finish_tile(p, at, acc, nullptr);
}

template <int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    dequant_kernel(const uint4* qweight, const uint8_t* scales, const float* global_scale,
                   __nv_bfloat16* out, int64_t ldo, int N, int K, int KC, int chunks) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int chunk = blockIdx.x * WARPS + warp;
  if (chunk >= chunks) return;
  const int nblock = chunk / KC, kc = chunk % KC;
  const uint64_t policy = evict_first_policy();
  const uint4* w = qweight + (size_t)chunk * (kWords / 4) + lane;
  const uint4 codes[2] = {load_stream(w, policy), load_stream(w + 32, policy)};
  const uint2 s = __ldg(reinterpret_cast<const uint2*>(scales + (size_t)chunk * kScaleBytes + (g * 2 + (t >> 1)) * 8));
  const uint32_t sw[2] = {s.x, s.y};
  const float gs = *global_scale * kProductScale;
  const int col = kc * kCols + t * 8;
  if (col >= K) return;
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    uint32_t sp[2];
    decode_scales(sw[q], sp[0], sp[1]);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      // rows[h][c]: row g + 8h, columns 8t + c, as bf16 pairs.
      uint32_t rows[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t a[4];
        scaled_fragment(word_of(codes[q], i * 2 + j), sp[i], a);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&a[r]);
          const __nv_bfloat162 o = __floats2bfloat162_rn(__low2float(v) * gs, __high2float(v) * gs);
          // register r: row half r % 2, column pair 2 * j + r / 2
          rows[r & 1][2 * j + (r >> 1)] = *reinterpret_cast<const uint32_t*>(&o);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = nblock * kRows + (2 * q + i) * 16 + g + 8 * h;
        if (row < N)
          *reinterpret_cast<uint4*>(out + (size_t)row * ldo + col) =
              make_uint4(rows[h][0], rows[h][1], rows[h][2], rows[h][3]);
      }
    }
  }
}

template <class Kernel>
cudaError_t launch(Kernel kernel, const GemmParams& p, int cta_rows, int nb, int threads, int smem, int splits,
                   bool pdl, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  const bool grouped = p.group_offsets != nullptr;
  const int rows = grouped ? p.group_slots * p.group_blocks * kRows : p.N;
  const int tokens = grouped ? p.group_max_rows : p.M;  // the most rows one expert can get
  cfg.gridDim = dim3((rows + cta_rows - 1) / cta_rows, splits, (tokens + 8 * nb - 1) / (8 * nb));
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

template <int P, int WG, int S>
const void* wgmma_ready() {
  static const cudaError_t err = cudaFuncSetAttribute(wgmma_kernel<P, WG, S>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                      WgmmaShape<P, WG, S>::kBytes);
  return err == cudaSuccess ? reinterpret_cast<const void*>(wgmma_kernel<P, WG, S>) : nullptr;
}

// x in fragment order into p.xf for the wgmma kernel, under the same launch attributes.
cudaError_t launch_fragment_order(const GemmParams& p, int rows, bool pdl, cudaStream_t stream) {
  const int64_t threads = static_cast<int64_t>(rows) * p.KC;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>((threads + 255) / 256));
  cfg.blockDim = dim3(256);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, fragment_kernel, p.x, p.ldx, reinterpret_cast<uint4*>(p.xf), p.M, p.K, p.KC, rows);
}

}  // namespace

int fragment_rows(const GemmConfig& c, int M) {
  if (c.mt != 1) return 0;
  const int tokens = 8 * c.nb;
  return (M + tokens - 1) / tokens * tokens;
}

// The compiled configs: those a row of the shipped config table (configs-h200.json) or the
// default variant of a pass size (cuda_ext._VARIANT) launches; variants no row picked were
// deleted. Register ring: (rows per warp / 16, tokens per pass / 8, warps along N, warps along K,
// chunks in flight per warp); in step with COMPILED in cuda_ext.py (a CPU test checks). wgmma (a
// warpgroup per 64-row block, mt = 1): (64-token blocks per pass, warpgroups per CTA, pipeline
// stages); in step with WGMMA in cuda_ext.py.
#define QERL_W4A16_CONFIGS(X)                                                                       \
  X(4, 1, 4, 1, 4) X(4, 1, 1, 4, 4) X(4, 1, 2, 2, 4) X(2, 1, 1, 8, 4) X(4, 2, 1, 4, 4)            \
  X(2, 2, 8, 1, 4) X(2, 2, 1, 8, 4) X(4, 4, 1, 4, 2) X(2, 4, 8, 1, 2) X(2, 8, 1, 4, 2)
#define QERL_W4A16_WGMMA(X)                                                                         \
  X(1, 1, 4) X(1, 1, 6) X(1, 2, 4) X(1, 2, 6) X(2, 1, 4) X(2, 2, 6) X(4, 2, 4) X(4, 2, 5)
// Grouped kernels (register ring, as QERL_W4A16_CONFIGS): the default variant of each tokens per
// pass (cuda_ext._VARIANT) and other 8-token passes; in step with GROUPED in cuda_ext.py.
#define QERL_W4A16_GROUPED(X)                                                                       \
  X(2, 1, 1, 8, 4) X(2, 2, 1, 8, 4) X(4, 4, 1, 4, 2) X(2, 8, 1, 4, 2) X(2, 1, 8, 1, 4) X(4, 1, 1, 8, 4)

int gemm_blocks_per_sm(const GemmConfig& c) {
  int blocks = 0;
#define QERL_W4A16_OCCUPANCY(MT, NB, WN, WK, D)                                                     \
  if (c.stages == 0 && c.mt == MT && c.nb == NB && c.warps == WN * WK && c.wk == WK && c.depth == D) \
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, gemm_kernel<MT, NB, WN, WK, D>, WN * WK * 32, 0);
  QERL_W4A16_CONFIGS(QERL_W4A16_OCCUPANCY)
#undef QERL_W4A16_OCCUPANCY
#define QERL_W4A16_WGMMA_OCCUPANCY(P, WG, S)                                                         \
  if (c.mt == 1 && c.stages == S && c.nb == 8 * P && c.warps == 4 * WG && c.wk == 1 && wgmma_ready<P, WG, S>()) \
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, wgmma_kernel<P, WG, S>, WG * 128,                  \
                                                  WgmmaShape<P, WG, S>::kBytes);
  QERL_W4A16_WGMMA(QERL_W4A16_WGMMA_OCCUPANCY)
#undef QERL_W4A16_WGMMA_OCCUPANCY
  return blocks;
}

cudaError_t launch_gemm(const GemmParams& p, const GemmConfig& c, cudaStream_t stream) {
  if (p.M <= 0) return cudaSuccess;
  if (p.group_offsets != nullptr) {
    // One K split (its tickets would need a pass index per expert); a CTA must not straddle two
    // weights; the offsets are read at the start (no PDL); the epilogue's LoRA and bias take one
    // weight.
    if (c.stages != 0 || c.wk <= 0 || c.splits != 1 || c.pdl || p.group_blocks <= 0 || p.groups <= 0 ||
        p.group_slots <= 0 || p.group_slots > p.groups || (p.group_blocks * kRows) % ((c.warps / c.wk) * 16 * c.mt) != 0 ||
        p.lora_b != nullptr || p.bias != nullptr)
      return cudaErrorInvalidConfiguration;
    if (p.group_max_rows <= 0) return cudaSuccess;
#define QERL_W4A16_GROUPED_DISPATCH(MT, NB, WN, WK, D)                                              \
  if (c.mt == MT && c.nb == NB && c.warps == WN * WK && c.wk == WK && c.depth == D)                  \
    return launch(grouped_kernel<MT, NB, WN, WK, D>, p, WN * 16 * MT, NB, WN * WK * 32, 0, 1, false, stream);
    QERL_W4A16_GROUPED(QERL_W4A16_GROUPED_DISPATCH)
#undef QERL_W4A16_GROUPED_DISPATCH
    return cudaErrorInvalidConfiguration;
  }
#define QERL_W4A16_DISPATCH(MT, NB, WN, WK, D)                                                      \
  if (c.stages == 0 && c.mt == MT && c.nb == NB && c.warps == WN * WK && c.wk == WK && c.depth == D) \
    return launch(gemm_kernel<MT, NB, WN, WK, D>, p, WN * 16 * MT, NB, WN * WK * 32, 0, c.splits, c.pdl != 0, stream);
  QERL_W4A16_CONFIGS(QERL_W4A16_DISPATCH)
#undef QERL_W4A16_DISPATCH
#define QERL_W4A16_WGMMA_DISPATCH(P, WG, S)                                                          \
  if (c.mt == 1 && c.stages == S && c.nb == 8 * P && c.warps == 4 * WG && c.wk == 1) {            \
    if (wgmma_ready<P, WG, S>() == nullptr) return cudaErrorInvalidConfiguration;                  \
    const cudaError_t err = launch_fragment_order(p, fragment_rows(c, p.M), c.pdl != 0, stream);  \
    if (err != cudaSuccess) return err;                                                            \
    GemmParams q = p;                                                                              \
    q.x = p.xf;                                                                                    \
    q.ldx = static_cast<int64_t>(p.KC) * kCols;                                                    \
    return launch(wgmma_kernel<P, WG, S>, q, WG * 64, 8 * P, WG * 128, WgmmaShape<P, WG, S>::kBytes, c.splits, \
                  c.pdl != 0, stream);                                                             \
  }
  QERL_W4A16_WGMMA(QERL_W4A16_WGMMA_DISPATCH)
#undef QERL_W4A16_WGMMA_DISPATCH
  return cudaErrorInvalidConfiguration;
}

cudaError_t launch_dequant(const uint4* qweight, const uint8_t* scales, const float* global_scale,
                           __nv_bfloat16* out, int64_t ldo, int N, int K, int KC,
                           cudaStream_t stream) {
  constexpr int kWarps = 8;
  const int chunks = ((N + kRows - 1) / kRows) * KC;
  const int blocks = (chunks + kWarps - 1) / kWarps;
  dequant_kernel<kWarps><<<blocks, kWarps * 32, 0, stream>>>(qweight, scales, global_scale, out, ldo,
                                                             N, K, KC, chunks);
  return cudaGetLastError();
}

}  // namespace qerl_w4a16
