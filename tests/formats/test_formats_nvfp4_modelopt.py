"""quantize_nvfp4 against NVIDIA Model Optimizer itself, byte for byte.

modelopt is imported lazily (about 6-8 s) through one module-scoped fixture.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from qerl_pipe.errors import QuantizationError
from qerl_pipe.formats.names import fused_group_key
from qerl_pipe.formats.nvfp4 import (
    E2M1_GRID,
    NVFP4Weight,
    dequantize_nvfp4,
    global_scale_from_amax,
    pack_fp4,
    quantize_nvfp4,
    quantize_nvfp4_in_row_chunks,
    shared_global_scale,
    unpack_fp4,
)


@pytest.fixture(scope="module")
def modelopt_nvfp4():
    """`(weight, global_scale or None) -> NVFP4Weight` computed by modelopt's export math."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "transformers X is not tested with modelopt"
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    def quantize(weight: torch.Tensor, global_scale: torch.Tensor | None = None) -> NVFP4Weight:
        qtensor, scales, s2 = NVFP4QTensor.quantize(weight, 16, None, global_scale, try_tensorrt=False)
        return NVFP4Weight(qtensor._quantized_data, scales, s2)

    quantize.cls = NVFP4QTensor
    return quantize


def assert_same_bytes(ours: NVFP4Weight, ref: NVFP4Weight) -> None:
    assert ours.packed.dtype == torch.uint8 and ours.block_scales.dtype == torch.float8_e4m3fn
    assert ours.global_scale.dtype == torch.float32 and ours.global_scale.shape == ()
    assert torch.equal(ours.packed, ref.packed), "packed codes differ"
    assert torch.equal(ours.block_scales.view(torch.uint8), ref.block_scales.view(torch.uint8))
    assert torch.equal(ours.global_scale.view(torch.int32), ref.global_scale.view(torch.int32))


def check(weight: torch.Tensor, modelopt_nvfp4, global_scale: torch.Tensor | None = None) -> NVFP4Weight:
    ours = quantize_nvfp4(weight, global_scale)
    assert_same_bytes(ours, modelopt_nvfp4(weight.clone(), global_scale))
    return ours


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (64, 256), (576, 1536)])
def test_random_normal(shape, dtype, modelopt_nvfp4):
    # crc32, not hash(): str hashes are salted per process, so a failure would not reproduce.
    gen = torch.Generator().manual_seed(zlib.crc32(f"{shape}{dtype}".encode()))
    check((torch.randn(shape, generator=gen) * 0.02).to(dtype), modelopt_nvfp4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_heavy_tailed(dtype, modelopt_nvfp4):
    gen = torch.Generator().manual_seed(1)
    with torch.random.fork_rng():  # StudentT.sample takes no generator: seed the global one, then restore it
        torch.manual_seed(2)
        student_t = torch.distributions.StudentT(torch.tensor(2.0)).sample((128, 512))
    check(student_t.to(dtype), modelopt_nvfp4)
    outliers = torch.randn(128, 512, generator=gen)
    outliers.view(-1)[torch.randint(0, outliers.numel(), (40,), generator=gen)] *= 300.0
    check(outliers.to(dtype), modelopt_nvfp4)


# (tie, the E2M1 value it must round to): round half to even, per NVFP4.md.
TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


@pytest.mark.parametrize("block_scale", [1.0, 2.0, 0.5])
def test_exact_ties(block_scale, modelopt_nvfp4):
    # One element of 2688 makes the global scale exactly 1.0; each tie block also holds
    # 6 * block_scale, so q = w / block_scale lands exactly on the tie points.
    rows = []
    for sign in (1.0, -1.0):
        ties = [sign * t * block_scale for t, _ in TIES]
        nudged = [sign * torch.nextafter(torch.tensor(t), torch.tensor(9.0)).item() * block_scale
                  for t, _ in TIES]
        rows.append([6.0 * block_scale, *ties, *nudged, 0.0])
    w = torch.tensor(rows)
    w = torch.cat([w, torch.full((2, 16), 0.0)], dim=1)
    w[0, 16] = 2688.0
    ours = check(w, modelopt_nvfp4)
    assert float(ours.global_scale) == 1.0 and float(ours.block_scales[0, 0].float()) == block_scale
    values = dequantize_nvfp4(ours)[:, 1:8] / block_scale
    expected = torch.tensor([v for _, v in TIES])
    assert torch.equal(values[0], expected) and torch.equal(values[1], -expected)


def test_every_grid_value_is_exact(modelopt_nvfp4):
    grid = torch.tensor(E2M1_GRID)
    w = torch.cat([grid, -grid]).reshape(1, 16)
    w = torch.cat([w, torch.tensor([[2688.0] + [0.0] * 15])], dim=1)
    ours = check(w, modelopt_nvfp4)
    expected = torch.arange(16, dtype=torch.uint8)
    expected[8] = 0  # -0.0 is not < 0: code 0, not 0x8
    assert torch.equal(unpack_fp4(ours.packed)[0, :16], expected)


def test_zero_blocks_and_tiny_negatives(modelopt_nvfp4):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(8, 128, generator=gen)
    w[:, 16:32] = 0.0  # all-zero blocks: scale 1.0
    w[0, 32:48] = -1e-7  # blocks of tiny negatives: scale clamps at 2**-9, codes 0x8
    w[1, 48:64] = -torch.rand(16, generator=gen) * 1e-5
    w[2, 64:80] = torch.where(torch.arange(16) % 2 == 0, -1e-3, 1e-3)
    w[3, 80:96] = -0.0  # negative zeros stay code 0 (sign bit is q < 0)
    w[4, 96] = 50.0  # one big value; its block's other negatives round to 0x8
    w[4, 97:112] = -0.01
    ours = check(w, modelopt_nvfp4)
    codes = unpack_fp4(ours.packed)
    assert (codes[0, 32:48] == 0x8).all() and (codes[3, 80:96] == 0).all()
    assert (codes[4, 97:112] == 0x8).all()
    assert (ours.block_scales[:, 1].float() == 1.0).all()
    assert float(ours.block_scales[0, 2].float()) == 2.0**-9


def test_near_zero_blocks_next_to_global_max(modelopt_nvfp4):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(16, 64, generator=gen) * 1e-4
    w[:, 0] = 1000.0 * torch.sign(torch.randn(16, generator=gen))
    ours = check(w, modelopt_nvfp4)
    assert (ours.block_scales[:, 1:].float() == 2.0**-9).all()  # clamped, not underflowed to 0


def test_block_scales_saturate_at_448(modelopt_nvfp4):
    # Blocks holding the tensor max have scale 448 (or a rounding above it, clamped to 448);
    # sweep magnitudes so the fp32 rounding of amax / (6 * amax / 2688) falls on both sides.
    amax = torch.logspace(-6, 6, 64)
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(4)).clamp(-1, 1) * 0.5
    w[:, 0] = 1.0
    w[:, 16] = -1.0
    for row, a in enumerate(amax):
        ours = check((w[row : row + 1] * a).repeat(3, 1), modelopt_nvfp4)
        assert (ours.block_scales.float() == 448.0).all()


def test_shared_global_scale_fused_qkv(modelopt_nvfp4):
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, 64, generator=gen).bfloat16() * s for n, s in ((64, 0.02), (32, 0.5), (32, 0.1)))
    s2 = shared_global_scale([q, k, v])
    assert torch.equal(s2, modelopt_nvfp4.cls.get_weights_scaling_factor_2(torch.cat([q, k, v])))
    for w in (q, k, v):
        assert torch.equal(check(w, modelopt_nvfp4, s2).global_scale, s2)


def test_tiny_llama_every_linear(modelopt_nvfp4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(6)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    linears = {name: m.weight.detach() for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    groups: dict[str, list[torch.Tensor]] = {}
    for name, w in linears.items():
        groups.setdefault(fused_group_key(name) or name, []).append(w)
    assert sum(len(g) == 3 for g in groups.values()) == 2 and sum(len(g) == 2 for g in groups.values()) == 2
    for name, w in linears.items():
        group = groups[fused_group_key(name) or name]
        ref_s2 = modelopt_nvfp4.cls.get_weights_scaling_factor_2(torch.cat(group))
        s2 = shared_global_scale(group)
        assert torch.equal(s2.view(torch.int32), ref_s2.view(torch.int32)), name
        check(w, modelopt_nvfp4, s2)


def test_dequantize_matches_modelopt(modelopt_nvfp4):
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(7)).bfloat16()
    ours = quantize_nvfp4(w)
    ref = modelopt_nvfp4.cls(w.shape, w.dtype, ours.packed).dequantize(
        torch.float32, scale=ours.block_scales, double_scale=ours.global_scale, block_sizes={-1: 16}
    )
    assert torch.equal(dequantize_nvfp4(ours), ref)


def test_all_zero_tensor_decodes_to_zero(modelopt_nvfp4):
    w = torch.zeros(4, 32)
    ours = quantize_nvfp4(w)
    assert float(ours.global_scale) == 0.0 and not ours.packed.any()
    assert (ours.block_scales.float() == 1.0).all() and torch.equal(dequantize_nvfp4(ours), w)
    # The one deliberate difference (docs/formats.md): modelopt computes 0/0 and writes NaN
    # scales. If this starts failing, modelopt fixed it: match what it does now.
    assert torch.isnan(modelopt_nvfp4(w).block_scales.float()).all()


def test_round_trip_error_is_bounded():
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(8))
    err = (dequantize_nvfp4(quantize_nvfp4(w)) - w).norm() / w.norm()
    assert 0.02 < float(err) < 0.15


def test_non_contiguous_input():
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(9))
    a, b = quantize_nvfp4(w.t()), quantize_nvfp4(w.t().contiguous())
    assert torch.equal(a.packed, b.packed) and torch.equal(a.block_scales.view(torch.uint8), b.block_scales.view(torch.uint8))


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (5, 32) and torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(packed[0, 0], codes[0, 0] | (codes[0, 1] << 4))  # element 2j in the low nibble
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(1, 256)
    assert torch.equal(pack_fp4(unpack_fp4(every_byte)), every_byte)


def test_global_scale_from_amax():
    s = global_scale_from_amax(torch.tensor([2688.0]))
    assert s.shape == () and s.dtype == torch.float32 and float(s) == 1.0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_raises_with_name(bad):
    w = torch.randn(4, 32)
    w[2, 5] = bad
    with pytest.raises(QuantizationError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*non-finite"):
        quantize_nvfp4(w.bfloat16(), name="model.layers.0.mlp.up_proj.weight")


def test_bad_shapes_raise():
    with pytest.raises(QuantizationError, match=r"\(4, 24\).*multiple of 16"):
        quantize_nvfp4(torch.randn(4, 24), name="w")
    with pytest.raises(QuantizationError, match="2-D"):
        quantize_nvfp4(torch.randn(2, 4, 16))


def test_too_small_shared_scale_raises():
    w = torch.randn(4, 32)
    too_small = global_scale_from_amax(w.abs().amax()) * 0.5
    with pytest.raises(QuantizationError, match="fused group"):
        quantize_nvfp4(w, too_small, name="k_proj")


def test_vanishing_tensor_raises():
    with pytest.raises(QuantizationError, match="too small"):
        quantize_nvfp4(torch.full((2, 16), 1e-35))


def test_weight_properties():
    w = quantize_nvfp4(torch.randn(24, 64))
    assert (w.out_features, w.in_features) == (24, 64)
    assert w.to("cpu").packed.shape == (24, 32) and w.block_scales.shape == (24, 4)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_cuda_matches_modelopt_on_cuda(modelopt_nvfp4):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = (torch.randn(576, 1536, generator=torch.Generator().manual_seed(10)) * 0.02).to(dtype).cuda()
        assert check(w, modelopt_nvfp4).packed.is_cuda


@pytest.mark.gpu
@needs_cuda
def test_cuda_equals_cpu_given_the_global_scale():
    # On CUDA `amax / 2688.0` is computed as amax * (1/2688), one ulp off the CPU's correctly
    # rounded quotient for about a quarter of amaxes (modelopt has the same device dependence).
    # Every other step is device-independent, so a global scale computed once gives equal bytes.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w = (torch.randn(576, 1536, generator=torch.Generator().manual_seed(11)) * 0.02).to(dtype)
        s2 = global_scale_from_amax(w.float().abs().amax())
        assert_same_bytes(quantize_nvfp4(w.cuda(), s2.cuda()).to("cpu"), quantize_nvfp4(w, s2))


def test_row_chunks_give_the_same_bytes_as_one_call():
    # Heavy-tailed rows so the global scale comes from one row: each chunk must use the whole
    # tensor's scale, not its own.
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(37, 96, generator=gen, dtype=torch.float32)
    w[5, 3] = 40.0
    w = w.to(torch.bfloat16)
    whole = quantize_nvfp4(w)
    seen = []
    chunked = quantize_nvfp4_in_row_chunks(w, chunk_elements=96 * 4, on_chunk=lambda c, q: seen.append(c.shape[0]))
    assert seen == [4] * 9 + [1]
    assert torch.equal(chunked.packed, whole.packed)
    assert torch.equal(chunked.block_scales.view(torch.uint8), whole.block_scales.view(torch.uint8))
    assert torch.equal(chunked.global_scale, whole.global_scale)
