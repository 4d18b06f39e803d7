"""The CUDA W4A16 kernels on a Hopper GPU (`pytest -m gpu` on the H200), vs the fp64 reference.

Every check draws fresh inputs and poisons the output memory with NaN first (the caching
allocator hands the poisoned block to the kernel's output), so an unwritten element fails.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from qerl_pipe.kernels import cuda_ext
from qerl_pipe.kernels.tiled import TiledNVFP4, tile_nvfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (7168, 5120), (5120, 5120),
          (55296, 5120), (5120, 27648), (100, 48), (333, 1088), (64, 32), (1000, 512)]
MS = (1, 2, 7, 8, 9, 16, 17, 63, 64, 65, 255, 256, 257, 1024, 4096)


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if not cuda_ext.available("cuda"):
        pytest.skip("the CUDA W4A16 kernels do not run here (see the log)")


def _weight(n: int, k: int, seed: int) -> tuple[TiledNVFP4, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    q = quantize_nvfp4(w)
    return tile_nvfp4(q), dequantize_nvfp4(q, torch.float64)


def _poisoned(call, shape: tuple[int, ...]) -> torch.Tensor:
    torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")  # freed: reused by `call`
    return call()


def _one_rounding(w: torch.Tensor, exact: torch.Tensor) -> bool:
    """Each bf16 weight within one rounding of the exact value (2**-8 relative covers the fp32
    step before the bf16 rounding)."""
    return bool(((w.double() - exact).abs() <= exact.abs() * 2.0**-8).all())


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert bool(torch.isfinite(out).all()), "NaN or inf in the output: an element was not written"
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize(("n", "k"), SHAPES, ids=lambda v: str(v))
def test_gemm_and_dequant_match_the_reference(n: int, k: int) -> None:
    tq, dense = _weight(n, k, n + k)
    w = _poisoned(lambda: cuda_ext.dequantize(tq), (n, k))
    assert _one_rounding(w, dense), "the decode pass must round each weight once"
    del w
    for i, m in enumerate(MS):
        if m * max(n, k) > 2**27:
            continue
        x = torch.randn(m, k, device="cuda", generator=torch.Generator("cuda").manual_seed(i)).to(torch.bfloat16)
        ref = x.double() @ dense.T
        if m <= 4 * cuda_ext.MAX_PASS_TOKENS:
            out = _poisoned(lambda: cuda_ext.gemm(x, tq), (m, n))
            assert _rel(out, ref) < 5e-3, (m, n, k)
        else:
            from qerl_pipe.kernels import nvfp4_linear

            assert _rel(nvfp4_linear(x, tq), ref) < 5e-3, (m, n, k)


@pytest.mark.parametrize("cfg", cuda_ext.compiled_configs(1) + cuda_ext.compiled_configs(3), ids=str)
def test_every_compiled_config(cfg: cuda_ext.GemmConfig) -> None:
    tq, dense = _weight(1000, 1088, 7)
    bias = torch.randn(1000, device="cuda").to(torch.bfloat16)
    b = _lora_b(1000, 48)
    for m in (1, 8 * cfg.nb - 1, 8 * cfg.nb + 3):
        x = torch.randn(m, 1088, device="cuda").to(torch.bfloat16)
        out = _poisoned(lambda: cuda_ext.gemm(x, tq, bias, config=cfg), (m, 1000))
        assert _rel(out, x.double() @ dense.T + bias.double()) < 5e-3, (cfg, m)
        # The LoRA expand in the epilogue; u a column slice of a wider buffer (rows ldu apart).
        u = torch.randn(m, 64, device="cuda").to(torch.bfloat16)[:, 8:56]
        ref = x.double() @ dense.T + bias.double() + u.double() @ b.double().T
        out = _poisoned(lambda: cuda_ext.gemm(x, tq, bias, config=cfg, lora=(u, b)), (m, 1000))
        assert _rel(out, ref) < 5e-3, (cfg, m, "lora")


def _lora_b(n: int, rank: int) -> torch.Tensor:
    """A block-diagonal B as FusedLora stacks it: three row ranges, each with its own 16 columns,
    the last range without an adapter (zeros)."""
    b = torch.zeros(n, rank, device="cuda")
    edges = [0, n // 3, 2 * n // 3, n]
    for j in range(2):
        b[edges[j]:edges[j + 1], 16 * j:16 * (j + 1)] = torch.randn(edges[j + 1] - edges[j], 16, device="cuda")
    b[:, 32:] = 0.0
    return b.to(torch.bfloat16)


def test_bit_identical_on_repeat_and_under_graph_replay() -> None:
    tq, _ = _weight(3584, 18944, 3)
    for m in (1, 16, 64):
        x = torch.randn(m, 18944, device="cuda").to(torch.bfloat16)
        lora = (torch.randn(m, 32, device="cuda").to(torch.bfloat16), _lora_b(3584, 32))
        first = cuda_ext.gemm(x, tq, lora=lora)
        assert torch.equal(first, cuda_ext.gemm(x, tq, lora=lora)), "split-K must sum in a fixed order"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = cuda_ext.gemm(x, tq, lora=lora)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(first, captured), "a graph replay must give the eager result"


def test_strided_rows_and_linear_dispatch() -> None:
    from qerl_pipe.kernels import nvfp4_linear, nvfp4_linear_dx

    tq, dense = _weight(4608, 3584, 11)
    x = torch.randn(3, 5, 3584, device="cuda").to(torch.bfloat16)[1]  # a view at an offset
    assert _rel(nvfp4_linear(x, tq), x.double() @ dense.T) < 5e-3
    big = torch.randn(300, 3584, device="cuda").to(torch.bfloat16)
    assert _rel(nvfp4_linear(big, tq), big.double() @ dense.T) < 5e-3
    dy = torch.randn(70, 4608, device="cuda").to(torch.bfloat16)
    assert _rel(nvfp4_linear_dx(dy, tq), dy.double() @ dense) < 5e-3
    # Bias and LoRA expand: in the GEMM's epilogue at 5 rows, after dequantize + cuBLAS at 300,
    # after the GEMM at a rank the epilogue does not take (24).
    bias = torch.randn(4608, device="cuda").to(torch.bfloat16)
    for rows, rank in ((x, 32), (big, 32), (x, 24)):
        u = torch.randn(rows.shape[0], rank, device="cuda").to(torch.bfloat16)
        b = torch.randn(4608, rank, device="cuda").to(torch.bfloat16)
        ref = rows.double() @ dense.T + bias.double() + u.double() @ b.double().T
        assert _rel(nvfp4_linear(rows, tq, bias, (u, b)), ref) < 5e-3, (rows.shape, rank)


def test_scales_of_every_byte_and_sign() -> None:
    """Every E4M3 scale byte (subnormals, 448, zero, negative) times every code, through the GEMM."""
    n, k = 256, 512
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale_bytes = torch.arange(n * k // 16, dtype=torch.int64).remainder(256).to(torch.uint8)
    scale_bytes[(scale_bytes & 0x7F) == 0x7F] = 0x38  # no NaN scales
    from qerl_pipe.formats.nvfp4 import NVFP4Weight

    q = NVFP4Weight(codes, scale_bytes.view(n, k // 16).view(torch.float8_e4m3fn), torch.tensor(0.37))
    dense = dequantize_nvfp4(q, torch.float64).cuda()
    tq = tile_nvfp4(q.to("cuda"))
    assert _one_rounding(cuda_ext.dequantize(tq), dense)
    x = torch.randn(5, k, device="cuda").to(torch.bfloat16)
    assert _rel(cuda_ext.gemm(x, tq), x.double() @ dense.T) < 5e-3


@pytest.mark.parametrize("m", [4, 20, 64, 200])
def test_chained_launches_overlap_safely(m: int) -> None:
    """Each launch reads the previous one's output: with programmatic dependent launch the
    next kernel starts early, so its wait before reading x (and before writing) must hold. The
    configs alternate between the default and another compiled variant of its pass size, split K
    (from 33 tokens the wgmma kernel, whose launch writes x in fragment order first)."""
    layers = [_weight(2048, 2048, 20 + i)[0] for i in range(4)]
    x = torch.randn(m, 2048, device="cuda").to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default = cuda_ext.default_config(m, 2048, 2048, sms)
    other = None
    if m > 32:
        other = next(c for c in cuda_ext.compiled_configs(3) if c.mt == 1 and 8 * c.nb >= m)
    elif m > 8:
        other = next(c for c in cuda_ext.compiled_configs(3)
                     if c.mt != 1 and c.nb == default.nb and replace(c, splits=default.splits) != default)

    def chain(pdl: bool) -> torch.Tensor:
        y = x
        for i, tq in enumerate(layers):
            cfg = other if other is not None and i % 2 else default
            y = cuda_ext.gemm(y, tq, config=cuda_ext.GemmConfig(**{**cfg.__dict__, "pdl": pdl}))
        return y

    eager = chain(False)
    graph = torch.cuda.CUDAGraph()
    chain(True)
    with torch.cuda.graph(graph):
        captured = chain(True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)


def test_bad_configs_and_devices_are_errors_not_crashes() -> None:
    tq, _ = _weight(256, 512, 9)
    x = torch.randn(4, 512, device="cuda").to(torch.bfloat16)
    for bad in (cuda_ext.GemmConfig(4, 0, 4, 1, 4, 3), cuda_ext.GemmConfig(4, 1, 4, 0, 4, 3),
                cuda_ext.GemmConfig(4, 1, 6, 4, 4, 3), cuda_ext.GemmConfig(3, 1, 4, 1, 4, 1),
                cuda_ext.GemmConfig(4, 1, 4, 1, 0, 1), cuda_ext.GemmConfig(4, 1, 4, 1, 4, 0)):
        with pytest.raises(ValueError, match="compiled GEMM variant|splits"):
            cuda_ext.gemm(x, tq, config=bad)
    # The binding's own checks raise too (they once crashed the process instead).
    with pytest.raises(RuntimeError, match="invalid GEMM config"):
        torch.ops.qerl.w4a16_gemm(x, tq.qweight, tq.scales, tq.global_scale, None, 256, 512, 4, 0, 4, 1, 4, 3, True, 0)
    with pytest.raises(RuntimeError, match="invalid configuration"):  # cudaErrorInvalidConfiguration
        torch.ops.qerl.w4a16_gemm(x, tq.qweight, tq.scales, tq.global_scale, None, 256, 512, 3, 1, 4, 1, 4, 1, True, 0)
    with pytest.raises(RuntimeError, match="bias"):
        cuda_ext.gemm(x, tq, torch.zeros(256, dtype=torch.bfloat16))
    u, b = torch.zeros(4, 24, device="cuda", dtype=torch.bfloat16), torch.zeros(256, 24, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        cuda_ext.gemm(x, tq, lora=(u, b))
    with pytest.raises(RuntimeError, match="lora_b"):
        torch.ops.qerl.w4a16_gemm(x, tq.qweight, tq.scales, tq.global_scale, None, 256, 512, 4, 1, 4, 1, 4, 1, True, 0,
                                  u, b)
    with pytest.raises(RuntimeError, match="lora_u"):
        torch.ops.qerl.w4a16_gemm(x, tq.qweight, tq.scales, tq.global_scale, None, 256, 512, 4, 1, 4, 1, 4, 1, True, 0,
                                  u[:3, :16], b[:, :16].contiguous())
