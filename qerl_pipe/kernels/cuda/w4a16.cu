// NVFP4 W4A16 decode GEMM (M <= 64 per pass) and the full-bandwidth dequantize pass.
//
// GEMM: out[M, N] = x[M, K] @ W^T with W in the chunk layout (tiled.py). Each warp owns 16 * MT
// output rows and walks the chunks of one K split: per chunk it loads 16 * MT / 2 bytes of codes
// and 4 * MT / 2 bytes of scales per lane (the 1152-byte chunk stream of its rows), decodes them
// in registers straight into mma.m16n8k16 A fragments (weights = A, tokens = B: a token count of
// 1-8 wastes no MMA rows of weights), and keeps DEPTH chunks of loads in flight in a register
// ring. K splits are summed in a fixed order by the last CTA of each column slice to arrive (an
// atomic ticket, no atomics on the output), so a given config gives bit-identical results.
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

template <int MT, int NB>
struct Stage {
  uint4 codes[MT / 2];
  uint32_t scales[MT / 2];
  uint4 x[NB];
};

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

__device__ __forceinline__ float finish(float acc, float gs, const __nv_bfloat16* bias, int row) {
  float v = acc * gs;
  if (bias != nullptr) v += __bfloat162float(bias[row]);
  return v;
}

// One CTA: WN x WK warps. The WN warps of a K-warp group own consecutive 16 * MT-row warp tiles;
// the WK warps that share a warp tile take every WK-th chunk of the CTA's K split and are summed
// through shared memory in warp order at the end (more warps streaming one tile without more
// global split-K traffic, which grows with M). XS > 0 stages each chunk's activations in shared
// memory (XS chunks deep) for all warps of the CTA, which then walk the same chunks (WK = 1).
template <int MT, int NB, int WN, int WK, int DEPTH, int XS>
__global__ void __launch_bounds__(WN * WK * 32, XS > 0 ? 1 : 0) gemm_kernel(const GemmParams p) {
  static_assert(XS == 0 || (WK == 1 && XS >= 2), "staged activations need WK = 1 and at least 2 stages");
  constexpr int kWarpRows = 16 * MT;
  constexpr int kWarpTilesPerBlock = kRows / kWarpRows;
  constexpr int kAcc4 = MT * NB;  // float4s of accumulators per lane
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wn = warp / WK, wk = warp % WK;
  const int g = lane >> 2, t = lane & 3;
  // (column slice, K split, pass over M) of this CTA, with the passes of one slice and split
  // consecutive in launch order: they run side by side and share each weight chunk through L2,
  // so M > 8 * NB reads the weights from HBM once.
  const int passes = gridDim.z, columns = gridDim.x;
  const int linear = blockIdx.x + columns * (blockIdx.y + gridDim.y * blockIdx.z);
  const int bz = linear % passes, bx = linear / passes % columns, by = linear / passes / columns;
  const int warp_tile = bx * WN + wn;
  const int nblock = warp_tile / kWarpTilesPerBlock;
  const int pair0 = MT == 4 ? 0 : warp_tile % kWarpTilesPerBlock;
  const int n_blocks = (p.N + kRows - 1) / kRows;
  const int kc0 = by * p.chunks_per_split;
  const int kc1 = min(kc0 + p.chunks_per_split, p.KC);
  const int m0 = bz * 8 * NB;
  // This warp's chunks: kc0 + wk + j * WK for j < mine.
  const int mine = kc1 - kc0 > wk ? (kc1 - kc0 - wk + WK - 1) / WK : 0;

  float acc[MT][NB][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][b][e] = 0.f;

  const bool active = nblock < n_blocks;
  // A warp past N (the last CTA column) streams the last real block instead (L2 hits, results
  // dropped): with staged activations it must still join every barrier of its CTA.
  const int wblock = active ? nblock : n_blocks - 1;
  const uint64_t policy = evict_first_policy();
  const uint4* wbase = p.qweight + ((size_t)wblock * p.KC + kc0 + wk) * (kWords / 4) + pair0 * 32 + lane;
  const uint8_t* sbase = p.scales + ((size_t)wblock * p.KC + kc0 + wk) * kScaleBytes + (g * 2 + (t >> 1)) * 8 +
                         (MT == 2 ? 4 * pair0 : 0);
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
  // Decode a whole chunk before its MMAs, so that they have independent operands to overlap.
  auto decode_chunk = [&](const Stage<MT, NB>& st, uint32_t (&a)[MT][2][4]) {
#pragma unroll
    for (int q = 0; q < MT / 2; ++q) {
      uint32_t sp[2];
      decode_scales(st.scales[q], sp[0], sp[1]);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) scaled_fragment(word_of(st.codes[q], i * 2 + j), sp[i], a[2 * q + i][j]);
    }
  };
  // The MMAs of n8 block b: x holds token 8b + g's 8 activations of this lane (both k16 steps).
  auto mma_block = [&](const uint32_t (&a)[MT][2][4], int b, const uint4& x) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int tile = 0; tile < MT; ++tile) mma_bf16(acc[tile][b], a[tile][j], word_of(x, 2 * j), word_of(x, 2 * j + 1));
  };
  Stage<MT, NB> ring[DEPTH];

  if constexpr (XS > 0) {
    // Activations staged per chunk in shared memory, XS chunks deep: one copy per CTA instead of
    // one per warp through L1, so that a warp can take 64 rows x 64 tokens.
    __shared__ __align__(16) uint4 xs[XS][NB * 32];  // [stage][token * 4 + 16-byte part]
    auto issue_x = [&](int c) {
      for (int i = threadIdx.x; i < NB * 32; i += WN * 32) {
        const int token = m0 + (i >> 2);
        const int col = (kc0 + c) * kCols + (i & 3) * 8;
        const bool ok = token < p.M && col < p.K;
        cp_async16(&xs[c % XS][i], p.x + (ok ? (size_t)token * p.ldx + col : 0), ok);
      }
    };
    auto step = [&](const Stage<MT, NB>& st, int c) {
      cp_async_wait<XS - 2>();
      __syncthreads();  // chunk c has landed for every thread; stage (c - 1) % XS is free again
      if (c + XS - 1 < mine) issue_x(c + XS - 1);
      cp_async_commit();  // an empty group too: the wait above counts groups
      uint32_t a[MT][2][4];
      decode_chunk(st, a);
      const uint4* xc = xs[c % XS] + g * 4 + t;
#pragma unroll
      for (int b = 0; b < NB; ++b) mma_block(a, b, xc[b * 32]);
    };
#pragma unroll
    for (int u = 0; u < DEPTH; ++u)
      if (u < mine) load_weights(ring[u], u);
    grid_dependency_wait();  // x is the previous kernel's output
#pragma unroll
    for (int s = 0; s < XS - 1; ++s) {
      if (s < mine) issue_x(s);
      cp_async_commit();
    }
    int j = 0;
    for (; j + DEPTH <= mine; j += DEPTH) {
#pragma unroll
      for (int u = 0; u < DEPTH; ++u) {
        step(ring[u], j + u);
        if (j + u + DEPTH < mine) load_weights(ring[u], j + u + DEPTH);
      }
    }
#pragma unroll
    for (int u = 0; u < DEPTH - 1; ++u)
      if (j + u < mine) step(ring[u], j + u);
  } else if (active) {
    const __nv_bfloat16* xrow[NB];
    bool xvalid[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const int token = m0 + b * 8 + g;
      xvalid[b] = token < p.M;
      xrow[b] = p.x + (size_t)(xvalid[b] ? token : 0) * p.ldx + (kc0 + wk) * kCols + t * 8;
    }
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
      decode_chunk(st, a);
#pragma unroll
      for (int b = 0; b < NB; ++b) mma_block(a, b, st.x[b]);
    };
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

  if constexpr (WK > 1) {
    // Sum the K-warps of each warp tile in warp order: a fixed order, so results repeat exactly.
    __shared__ float4 red[(WK - 1) * WN * 32 * kAcc4];
    if (wk > 0) {
      float4* dst = red + ((wk - 1) * WN + wn) * 32 * kAcc4 + lane;
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int b = 0; b < NB; ++b)
          dst[(i * NB + b) * 32] = make_float4(acc[i][b][0], acc[i][b][1], acc[i][b][2], acc[i][b][3]);
    }
    __syncthreads();
    if (wk == 0) {
      for (int w = 1; w < WK; ++w) {
        const float4* src = red + ((w - 1) * WN + wn) * 32 * kAcc4 + lane;
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
  const bool writer = wk == 0 && nblock < n_blocks;

  const float gs = *p.global_scale * kProductScale;
  const int row_base = nblock * kRows + pair0 * 32;
  if (gridDim.y == 1) {
    if (!writer) return;
    for_each_output(acc, row_base, m0, g, t, [&](int row, int token, float v) {
      if (row < p.N && token < p.M) p.out[(size_t)token * p.ldo + row] = __float2bfloat16_rn(finish(v, gs, p.bias, row));
    });
    return;
  }

  // Split K: park this split's sums, and let the last CTA of the column slice add them up in
  // split order.
  const int n_pad = n_blocks * kRows;
  if (writer) {
    for_each_output(acc, row_base, m0, g, t, [&](int row, int token, float v) {
      if (token < p.M) __stcg(p.partials + ((size_t)by * p.M + token) * n_pad + row, v);
    });
  }
  __threadfence();
  __syncthreads();
  __shared__ int is_last;
  int* counter = p.counters + bz * columns + bx;
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == (int)gridDim.y - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  constexpr int kCtaRows = WN * kWarpRows;
  const int row0 = bx * kCtaRows;
  const int tokens = min(8 * NB, p.M - m0);
  for (int idx = threadIdx.x; idx < tokens * kCtaRows; idx += blockDim.x) {
    const int token = m0 + idx / kCtaRows, row = row0 + idx % kCtaRows;
    if (row >= p.N) continue;
    float sum = 0.f;
    for (int s = 0; s < (int)gridDim.y; ++s) sum += __ldcg(p.partials + ((size_t)s * p.M + token) * n_pad + row);
    p.out[(size_t)token * p.ldo + row] = __float2bfloat16_rn(finish(sum, gs, p.bias, row));
  }
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (and CUDA-graph replay)
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

template <int MT, int NB, int WN, int WK, int DEPTH, int XS>
cudaError_t launch(const GemmParams& p, int splits, bool pdl, cudaStream_t stream) {
  constexpr int kCtaRows = WN * 16 * MT;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((p.N + kCtaRows - 1) / kCtaRows, splits, (p.M + 8 * NB - 1) / (8 * NB));
  cfg.blockDim = dim3(WN * WK * 32);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, gemm_kernel<MT, NB, WN, WK, DEPTH, XS>, p);
}

}  // namespace

// The compiled configs: (rows per warp / 16, tokens per pass / 8, warps along N, warps along K,
// chunks in flight per warp, activation stages in shared memory or 0). Keep in step with COMPILED
// in cuda_ext.py (a CPU test checks).
#define QERL_W4A16_CONFIGS(X)                                                                       \
  X(4, 1, 4, 1, 4, 0) X(4, 1, 1, 4, 4, 0) X(4, 1, 2, 2, 4, 0) X(2, 1, 8, 1, 4, 0)                  \
  X(4, 1, 1, 8, 4, 0) X(2, 1, 1, 8, 4, 0) X(4, 2, 4, 1, 4, 0) X(4, 2, 1, 4, 4, 0)                  \
  X(4, 2, 2, 2, 4, 0) X(2, 2, 8, 1, 4, 0) X(4, 2, 1, 8, 4, 0) X(2, 2, 1, 8, 4, 0)                  \
  X(4, 4, 4, 1, 2, 0) X(4, 4, 1, 4, 2, 0) X(4, 4, 2, 2, 2, 0) X(2, 4, 8, 1, 2, 0)                  \
  X(2, 8, 4, 1, 2, 0) X(2, 8, 8, 1, 2, 0) X(2, 8, 1, 4, 2, 0) X(2, 8, 2, 2, 2, 0)                  \
  X(4, 2, 4, 1, 4, 4) X(4, 2, 8, 1, 4, 4) X(4, 4, 4, 1, 4, 4) X(4, 4, 8, 1, 4, 4)                  \
  X(4, 8, 4, 1, 2, 4) X(4, 8, 8, 1, 2, 4) X(4, 4, 2, 1, 4, 4) X(2, 8, 8, 1, 2, 4)

int gemm_blocks_per_sm(const GemmConfig& c) {
  int blocks = 0;
#define QERL_W4A16_OCCUPANCY(MT, NB, WN, WK, D, XS)                                                 \
  if (c.mt == MT && c.nb == NB && c.warps == WN * WK && c.wk == WK && c.depth == D && c.xs == XS)  \
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, gemm_kernel<MT, NB, WN, WK, D, XS>, WN * WK * 32, 0);
  QERL_W4A16_CONFIGS(QERL_W4A16_OCCUPANCY)
#undef QERL_W4A16_OCCUPANCY
  return blocks;
}

cudaError_t launch_gemm(const GemmParams& p, const GemmConfig& c, cudaStream_t stream) {
  if (p.M <= 0) return cudaSuccess;
#define QERL_W4A16_DISPATCH(MT, NB, WN, WK, D, XS)                                                  \
  if (c.mt == MT && c.nb == NB && c.warps == WN * WK && c.wk == WK && c.depth == D && c.xs == XS)  \
    return launch<MT, NB, WN, WK, D, XS>(p, c.splits, c.pdl != 0, stream);
  QERL_W4A16_CONFIGS(QERL_W4A16_DISPATCH)
#undef QERL_W4A16_DISPATCH
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
