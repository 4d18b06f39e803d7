// Torch glue for w4a16.cu: argument checks, output allocation and the current stream.
// Every TORCH_CHECK message here is one C string: a message built from several parts becomes a
// std::string that crosses into libtorch, which crashed the process (SIGSEGV) on the H200 image
// instead of raising (bench/scripts/binding_errors.py); the details go in cuda_ext's checks.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "w4a16.cuh"

namespace {

void check_weight(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& global_scale,
                  int64_t n, int64_t k) {
  TORCH_CHECK(qweight.is_cuda() && qweight.scalar_type() == at::kInt && qweight.is_contiguous() &&
                  qweight.dim() == 3 && qweight.size(2) == qerl_w4a16::kWords,
              "qweight must be a contiguous CUDA int32 [N/64, K/32, 256] tensor");
  TORCH_CHECK(scales.is_cuda() && scales.scalar_type() == at::kByte && scales.is_contiguous() &&
                  scales.dim() == 3 && scales.size(0) == qweight.size(0) && scales.size(1) == qweight.size(1) &&
                  scales.size(2) == qerl_w4a16::kScaleBytes,
              "scales must be a contiguous CUDA uint8 [N/64, K/32, 128] tensor");
  TORCH_CHECK(global_scale.is_cuda() && global_scale.scalar_type() == at::kFloat && global_scale.numel() == 1,
              "global_scale must be a 1-element CUDA float32 tensor");
  TORCH_CHECK(qweight.size(0) * qerl_w4a16::kRows >= n && qweight.size(0) * qerl_w4a16::kRows < n + qerl_w4a16::kRows &&
                  qweight.size(1) * qerl_w4a16::kCols >= k && qweight.size(1) * qerl_w4a16::kCols < k + qerl_w4a16::kCols &&
                  k % 16 == 0,
              "N, K do not match the tiled weight");
  TORCH_CHECK(n > 0 && k > 0, "N and K must be positive");
  TORCH_CHECK(scales.device() == qweight.device() && global_scale.device() == qweight.device(),
              "qweight, scales and global_scale must be on one device");
}

// K chunks per split for `splits` (clamped to 1..KC, then to the number that leaves no split empty).
int64_t chunks_per_split(int64_t kc, int64_t& splits) {
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, kc));
  const int64_t per_split = (kc + splits - 1) / splits;
  splits = (kc + per_split - 1) / per_split;
  return per_split;
}

// What every launch sets: the operands, the output, the split-K workspace and the shape.
qerl_w4a16::GemmParams base_params(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                                   const at::Tensor& global_scale, const at::Tensor& out, const at::Tensor& partials,
                                   const at::Tensor& counters, int64_t n, int64_t k, int64_t per_split) {
  qerl_w4a16::GemmParams p{};
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  p.ldx = x.stride(0);
  p.qweight = reinterpret_cast<const uint4*>(qweight.data_ptr());
  p.scales = scales.data_ptr<uint8_t>();
  p.global_scale = global_scale.data_ptr<float>();
  p.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  p.ldo = n;
  p.partials = partials.defined() ? partials.data_ptr<float>() : nullptr;
  p.counters = counters.data_ptr<int>();
  p.M = static_cast<int>(x.size(0));
  p.N = static_cast<int>(n);
  p.K = static_cast<int>(k);
  p.KC = static_cast<int>(qweight.size(1));
  p.chunks_per_split = static_cast<int>(per_split);
  return p;
}

at::Tensor gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                const at::Tensor& global_scale, const c10::optional<at::Tensor>& bias, int64_t n, int64_t k,
                int64_t mt, int64_t nb, int64_t warps, int64_t wk, int64_t depth, int64_t splits, bool pdl,
                int64_t stages, const at::Tensor& counters, const c10::optional<at::Tensor>& lora_u,
                const c10::optional<at::Tensor>& lora_b) {
  check_weight(qweight, scales, global_scale, n, k);
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == k && x.stride(1) == 1 &&
                  x.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "x must be a CUDA bf16 [M, K] tensor with 16-byte aligned rows");
  TORCH_CHECK(qweight.device() == x.device(), "x and the weight must be on one device");
  TORCH_CHECK(mt > 0 && nb > 0 && wk > 0 && warps > 0 && warps % wk == 0 && stages >= 0 && (stages > 0 || depth > 0),
              "invalid GEMM config: mt, nb, warps, wk must be positive, warps a multiple of wk, and depth or stages "
              "positive (cuda_ext.gemm checks the config against the compiled list first)");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const int64_t n_pad = qweight.size(0) * qerl_w4a16::kRows;
  const int64_t kc = qweight.size(1);
  const int64_t per_split = chunks_per_split(kc, splits);
  at::Tensor partials;
  if (splits > 1) {
    partials = at::empty({splits, m, n_pad}, x.options().dtype(at::kFloat));
    const int64_t cta_rows = warps / wk * 16 * mt;
    const int64_t ctas = ((n + cta_rows - 1) / cta_rows) * ((m + 8 * nb - 1) / (8 * nb));
    TORCH_CHECK(counters.is_cuda() && counters.scalar_type() == at::kInt && counters.numel() >= ctas,
                "the split-K counter buffer is too small for this launch");
  }
  const __nv_bfloat16* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device() == x.device() && bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                    bias->numel() == n,
                "bias must be a contiguous bf16 [N] tensor on x's device");
    bias_ptr = reinterpret_cast<const __nv_bfloat16*>(bias->data_ptr());
  }
  TORCH_CHECK(lora_u.has_value() == lora_b.has_value(), "lora_u and lora_b go together");
  const __nv_bfloat16* u_ptr = nullptr;
  const __nv_bfloat16* b_ptr = nullptr;
  int64_t ldu = 0, rank = 0;
  if (lora_b.has_value()) {
    rank = lora_b->dim() == 2 ? lora_b->size(1) : 0;
    TORCH_CHECK(lora_b->device() == x.device() && lora_b->scalar_type() == at::kBFloat16 && lora_b->is_contiguous() &&
                    lora_b->dim() == 2 && lora_b->size(0) == n && rank > 0 && rank % 16 == 0,
                "lora_b must be a contiguous bf16 [N, R] tensor on x's device, R a positive multiple of 16");
    TORCH_CHECK(lora_u->device() == x.device() && lora_u->scalar_type() == at::kBFloat16 && lora_u->dim() == 2 &&
                    lora_u->size(0) == x.size(0) && lora_u->size(1) == rank && lora_u->stride(1) == 1 &&
                    lora_u->stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(lora_u->data_ptr()) % 4 == 0,
                "lora_u must be a bf16 [M, R] tensor on x's device with 4-byte aligned rows");
    u_ptr = reinterpret_cast<const __nv_bfloat16*>(lora_u->data_ptr());
    b_ptr = reinterpret_cast<const __nv_bfloat16*>(lora_b->data_ptr());
    ldu = lora_u->stride(0);
  }
  qerl_w4a16::GemmParams p = base_params(x, qweight, scales, global_scale, out, partials, counters, n, k, per_split);
  p.lora_u = u_ptr;
  p.ldu = ldu;
  p.lora_b = b_ptr;
  p.lora_rank = static_cast<int>(rank);
  p.bias = bias_ptr;
  const qerl_w4a16::GemmConfig c{static_cast<int>(mt),    static_cast<int>(nb),    static_cast<int>(warps),
                                 static_cast<int>(wk),    static_cast<int>(depth), static_cast<int>(splits),
                                 pdl ? 1 : 0,             static_cast<int>(stages)};
  // The wgmma kernel reads x in fragment order, from a copy the launch writes first.
  const int frag_rows = qerl_w4a16::fragment_rows(c, static_cast<int>(m));
  at::Tensor xf;
  if (frag_rows > 0) {
    xf = at::empty({frag_rows, kc * qerl_w4a16::kCols}, x.options());
    p.xf = reinterpret_cast<__nv_bfloat16*>(xf.data_ptr());
  }
  const cudaError_t err = qerl_w4a16::launch_gemm(p, c, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, cudaGetErrorString(err));
  return out;
}

// x [R, K] rows sorted by weight, weight e's at offsets[e]:offsets[e + 1], through E stacked
// weights (qweight [E * NB, KC, 256] with NB blocks each, global_scale [E]) -> out [R, N]. `active`
// (int32 [E], the weights with rows first, then -1) lets the grid cover `slots` weights, not E.
at::Tensor grouped_gemm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& global_scale, const at::Tensor& offsets,
                        const c10::optional<at::Tensor>& active, int64_t slots, int64_t n, int64_t k,
                        int64_t max_rows, int64_t mt, int64_t nb, int64_t warps, int64_t wk, int64_t depth,
                        const at::Tensor& counters) {
  const int64_t groups = offsets.numel() - 1;
  TORCH_CHECK(offsets.is_cuda() && offsets.scalar_type() == at::kLong && offsets.dim() == 1 && groups > 0 &&
                  offsets.is_contiguous() && offsets.device() == x.device(),
              "offsets must be a contiguous CUDA int64 [E + 1] tensor on x's device");
  TORCH_CHECK(slots > 0 && slots <= groups && (active.has_value() || slots == groups),
              "slots must be 1..E, and E without an active list");
  if (active.has_value())
    TORCH_CHECK(active->is_cuda() && active->scalar_type() == at::kInt && active->is_contiguous() &&
                    active->numel() >= slots && active->device() == x.device(),
                "active must be a contiguous CUDA int32 tensor of at least `slots` weights on x's device");
  TORCH_CHECK(qweight.dim() == 3 && qweight.size(0) % groups == 0 && qweight.is_contiguous() && scales.is_contiguous(),
              "qweight must stack E weights of equal blocks, contiguous: [E * N/64, K/32, 256]");
  const int64_t blocks = qweight.size(0) / groups;
  TORCH_CHECK(global_scale.is_cuda() && global_scale.scalar_type() == at::kFloat && global_scale.numel() == groups &&
                  global_scale.is_contiguous() && global_scale.device() == qweight.device(),
              "global_scale must be a contiguous CUDA float32 tensor of one scale per weight");
  // One weight's slice passes the single-weight checks (shapes, dtypes, devices).
  check_weight(qweight.narrow(0, 0, blocks), scales.narrow(0, 0, blocks), global_scale.narrow(0, 0, 1), n, k);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == qweight.size(0), "scales must stack as qweight does");
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == k && x.stride(1) == 1 &&
                  x.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "x must be a CUDA bf16 [R, K] tensor with 16-byte aligned rows");
  TORCH_CHECK(qweight.device() == x.device(), "x and the weights must be on one device");
  TORCH_CHECK(mt > 1 && nb > 0 && wk > 0 && warps > 0 && warps % wk == 0 && depth > 0,
              "invalid grouped GEMM config: the register-ring kernel (mt 2 or 4, depth > 0)");
  TORCH_CHECK((blocks * qerl_w4a16::kRows) % (warps / wk * 16 * mt) == 0,
              "a CTA's rows must divide each weight's padded rows");
  TORCH_CHECK(max_rows >= 0, "max_rows must be >= 0");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  int64_t splits = 1;  // split-K tickets would need a pass index per weight
  const int64_t per_split = chunks_per_split(qweight.size(1), splits);
  qerl_w4a16::GemmParams p =
      base_params(x, qweight, scales, global_scale, out, at::Tensor(), counters, n, k, per_split);
  p.group_offsets = offsets.data_ptr<int64_t>();
  p.group_active = active.has_value() ? active->data_ptr<int>() : nullptr;
  p.groups = static_cast<int>(groups);
  p.group_slots = static_cast<int>(slots);
  p.group_blocks = static_cast<int>(blocks);
  p.group_max_rows = static_cast<int>(max_rows);
  const qerl_w4a16::GemmConfig c{static_cast<int>(mt), static_cast<int>(nb), static_cast<int>(warps),
                                 static_cast<int>(wk), static_cast<int>(depth), 1, 0, 0};
  const cudaError_t err = qerl_w4a16::launch_gemm(p, c, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, cudaGetErrorString(err));
  return out;
}

at::Tensor dequant(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& global_scale, int64_t n,
                   int64_t k) {
  check_weight(qweight, scales, global_scale, n, k);
  const c10::cuda::CUDAGuard guard(qweight.device());
  at::Tensor out = at::empty({n, k}, qweight.options().dtype(at::kBFloat16));
  const cudaError_t err = qerl_w4a16::launch_dequant(
      reinterpret_cast<const uint4*>(qweight.data_ptr()), scales.data_ptr<uint8_t>(), global_scale.data_ptr<float>(),
      reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), k, static_cast<int>(n), static_cast<int>(k),
      static_cast<int>(qweight.size(1)), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, cudaGetErrorString(err));
  return out;
}

int64_t blocks_per_sm(int64_t mt, int64_t nb, int64_t warps, int64_t wk, int64_t depth, int64_t stages) {
  return qerl_w4a16::gemm_blocks_per_sm({static_cast<int>(mt), static_cast<int>(nb), static_cast<int>(warps),
                                         static_cast<int>(wk), static_cast<int>(depth), 1, 0, static_cast<int>(stages)});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm", &gemm, "x @ W^T (+ bias) (+ u @ B^T) for a tiled NVFP4 W");
  m.def("grouped_gemm", &grouped_gemm, "rows of x sorted by weight, each through its own stacked tiled NVFP4 W");
  m.def("blocks_per_sm", &blocks_per_sm, "CTAs of a GEMM config resident per SM");
  m.def("dequant", &dequant, "W as bf16 [N, K] from a tiled NVFP4 W");
}
