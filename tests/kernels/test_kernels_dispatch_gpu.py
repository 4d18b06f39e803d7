"""humming-kernels behind the dispatch, on a GPU (`pytest -m gpu`): results against the reference,
the deterministic schedule's guarantees, CUDA-graph capture, and `nvfp4_linear` following a row.
"""

from __future__ import annotations

import pytest
import torch

from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from qerl_pipe.kernels import cuda_ext, dispatch, humming_backend
from qerl_pipe.kernels.dispatch import DispatchTable, row_key
from qerl_pipe.kernels.linear import nvfp4_linear
from qerl_pipe.kernels.tiled import tile_nvfp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [(4608, 3584), (3584, 18944), (256, 512)]
MS = (1, 7, 64, 65, 300, 1024)


@pytest.fixture(scope="module", autouse=True)
def _humming() -> None:
    if not humming_backend.available("cuda"):
        pytest.skip("humming-kernels do not run here (see the log)")


def _weight(n: int, k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = quantize_nvfp4(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    return q, dequantize_nvfp4(q, torch.float64)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert bool(torch.isfinite(out).all())
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("n,k", SHAPES)
def test_humming_matches_the_reference_under_both_schedules(n: int, k: int) -> None:
    q, dense = _weight(n, k, n + k)
    h = humming_backend.HummingNVFP4(q)
    for m in MS:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        ref = x.double() @ dense.T
        for schedule in humming_backend.SCHEDULES:
            assert _rel(h.matmul(x, schedule), ref) < 1e-2, (m, schedule)


@pytest.mark.parametrize("n,k", SHAPES[:2])
def test_the_deterministic_schedule_repeats_and_does_not_depend_on_other_rows(n: int, k: int) -> None:
    q, _ = _weight(n, k, 7)
    h = humming_backend.HummingNVFP4(q)
    x = torch.randn(256, k, device="cuda").to(torch.bfloat16)
    first = h.matmul(x, "humming")
    assert torch.equal(first, h.matmul(x, "humming"))
    assert torch.equal(first[:3], h.matmul(x[:3].contiguous(), "humming"))


@pytest.mark.parametrize("n,k", SHAPES[:2])
@pytest.mark.parametrize("m", (16, 64, 200, 1024, 2048))
def test_the_ordered_stream_k_schedule_repeats_bit_for_bit(n: int, k: int, m: int) -> None:
    q, dense = _weight(n, k, 5)
    h = humming_backend.HummingNVFP4(q)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    first = h.matmul(x, "humming-ordered")
    assert _rel(first, x.double() @ dense.T) < 1e-2
    for _ in range(20):
        assert torch.equal(first, h.matmul(x, "humming-ordered"))


def test_graph_replay_equals_eager() -> None:
    q, _ = _weight(4608, 3584, 3)
    h = humming_backend.HummingNVFP4(q)
    x = torch.randn(64, 3584, device="cuda").to(torch.bfloat16)
    for schedule in ("humming", "humming-ordered"):
        eager = h.matmul(x, schedule)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = h.matmul(x, schedule)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), schedule


def test_nvfp4_linear_follows_the_row() -> None:
    if not cuda_ext.available("cuda"):
        pytest.skip("our CUDA kernels do not run here")
    n, k = 4608, 3584
    q, dense = _weight(n, k, 11)
    w = tile_nvfp4(q)
    w_h = type(w)(w.qweight, w.scales, w.global_scale, n, k, humming=humming_backend.HummingNVFP4(q))
    props = torch.cuda.get_device_properties(0)
    table = DispatchTable(props.name, props.multi_processor_count, deterministic={row_key(128, n, k): "humming"})
    try:
        dispatch.configure(table, deterministic=True)
        x = torch.randn(100, k, device="cuda").to(torch.bfloat16)
        assert torch.equal(nvfp4_linear(x, w_h), w_h.humming.matmul(x, "humming"))
        # Without the copy the same row runs the rule without a table.
        rule = dispatch.ours_or_dequant(100, n, k, x.device)
        expected = cuda_ext.gemm(x, w) if rule == "qerl" else x @ cuda_ext.dequantize(w).T
        assert torch.equal(nvfp4_linear(x, w), expected)
        assert _rel(nvfp4_linear(x, w_h), x.double() @ dense.T) < 1e-2
    finally:
        dispatch.configure(dispatch.table_for(torch.device("cuda")), deterministic=True)
