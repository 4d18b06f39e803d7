"""bitsandbytes' NF4 kernels, what NF4 runs on a GPU (`pytest -m gpu`; needs the qlora extra).

Its matmul (gemv_4bit at one row, dequantize_4bit + cuBLAS above) and dX against the fp32 product
of the same NF4 weight at M = 1, 16, 64; `nf4_linear` / `nf4_linear_dx` on bitsandbytes at every M,
and on the reference without it; CUDA-graph capture of both; and how far bitsandbytes' own CUDA
quantizer (fast-math reciprocal, a decision tree) is from our bytes, which equal its CPU quantizer's.
"""

from __future__ import annotations

import pytest
import torch

from qerl_pipe.formats.nf4 import NF4_BLOCK, dequantize_nf4, quantize_nf4, unpack_nf4
from qerl_pipe.kernels import bnb_backend
from qerl_pipe.kernels.linear import nf4_linear, nf4_linear_dx
from qerl_pipe.kernels.packing import prepare_nf4, unprepare_nf4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [(4608, 3584), (3584, 18944), (192, 512)]
MS = (1, 16, 64)
# bf16 output of an fp32-accumulated product is ~2**-9 relative; dequantize + cuBLAS also rounds each
# weight (level x absmax) to bf16 first, as the reference does: a few 1e-3 in all.
MAX_REL = 1e-2


@pytest.fixture(scope="module", autouse=True)
def _bnb() -> None:
    """Skipped without the qlora extra; with it installed, bitsandbytes must run here (a probe that
    fails on an installed bitsandbytes once made every test below skip unnoticed)."""
    pytest.importorskip("bitsandbytes", reason="needs the qlora extra")
    why = bnb_backend.why_unavailable("cuda")
    assert why is None, f"bitsandbytes is installed but does not run: {why}"
    # Cache the availability now: its probe runs `bnb_backend.matmul`, which a test below counts.
    assert bnb_backend.available("cuda")


@pytest.fixture
def without_bitsandbytes(monkeypatch):
    """NF4 as a GPU without bitsandbytes runs it (the plain-torch reference)."""
    monkeypatch.setattr(bnb_backend, "available", lambda device: False)


def _weight(n: int, k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = quantize_nf4(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    return prepare_nf4(q), dequantize_nf4(q, torch.float64)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert bool(torch.isfinite(out).all())
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", MS)
def test_bitsandbytes_forward_and_dx_match_the_reference(n, k, m) -> None:
    w, dense = _weight(n, k, seed=n + k + m)
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    y = bnb_backend.matmul(x, w)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, x.double() @ dense.T) < MAX_REL
    dx = bnb_backend.matmul_dx(dy, w)
    assert dx.shape == (m, k) and _rel(dx, dy.double() @ dense) < MAX_REL
    assert torch.equal(bnb_backend.matmul(x, w), y)  # the same bits again


@pytest.mark.parametrize("m", MS)
def test_nf4_linear_runs_bitsandbytes_at_every_m(monkeypatch, m) -> None:
    n, k = SHAPES[0]
    w, dense = _weight(n, k, seed=5)
    x = torch.randn(1, m, k, device="cuda").bfloat16()  # leading dims are flattened
    calls: list[str] = []
    for name in ("matmul", "matmul_dx"):
        real = getattr(bnb_backend, name)
        monkeypatch.setattr(bnb_backend, name, lambda a, b, real=real, name=name: calls.append(name) or real(a, b))
    y = nf4_linear(x, w)
    dx = nf4_linear_dx(y, w)
    assert y.shape == (1, m, n) and dx.shape == (1, m, k)
    assert _rel(y, x.double() @ dense.T) < MAX_REL and _rel(dx, y.double() @ dense) < MAX_REL
    assert calls == ["matmul", "matmul_dx"]
    assert torch.equal(nf4_linear(x.float(), w), x.float() @ dequantize_nf4(unprepare_nf4(w), torch.float32).T)
    assert calls == ["matmul", "matmul_dx"]  # fp32 activations: the reference, bitsandbytes takes bf16/fp16


@pytest.mark.parametrize("m", MS)
def test_without_bitsandbytes_nf4_runs_the_reference(without_bitsandbytes, m) -> None:
    n, k = SHAPES[2]
    w, dense = _weight(n, k, seed=7)
    x = torch.randn(m, k, device="cuda").bfloat16()
    checkpoint = unprepare_nf4(w)
    y = nf4_linear(x, w)
    assert torch.equal(y, x @ dequantize_nf4(checkpoint, torch.bfloat16).T)
    assert _rel(y, x.double() @ dense.T) < MAX_REL
    assert torch.equal(nf4_linear_dx(y, w), y @ dequantize_nf4(checkpoint, torch.bfloat16))


@pytest.mark.parametrize("bnb", [True, False], ids=["bitsandbytes", "reference"])
def test_nf4_runs_inside_a_cuda_graph(monkeypatch, bnb) -> None:
    if not bnb:
        monkeypatch.setattr(bnb_backend, "available", lambda device: False)
    n, k = SHAPES[2]
    w, _ = _weight(n, k, seed=9)
    for m in (1, 8):  # gemv_4bit, and dequantize_4bit + cuBLAS (or the reference's dequantize + cuBLAS)
        x = torch.randn(m, k, device="cuda").bfloat16()
        eager = nf4_linear(x, w)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            nf4_linear(x, w)  # warm-up outside the capture (one-time probes and tables happen here)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = nf4_linear(x, w)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_bitsandbytes_cuda_quantizer_is_within_a_level_of_our_bytes() -> None:
    """Its CUDA kernel (--use_fast_math reciprocal, `x > midpoint` tree) may move a rare code to the
    neighbouring level; the absmax is the same. Counted here so a change in that is seen."""
    import bitsandbytes.functional as F

    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(4096, 4096, device="cuda", generator=gen) * 0.02).bfloat16()
    packed, state = F.quantize_4bit(w, blocksize=NF4_BLOCK, quant_type="nf4", compress_statistics=False)
    ours = quantize_nf4(w)
    assert torch.equal(state.absmax.reshape(ours.absmax.shape), ours.absmax)
    theirs_codes = unpack_nf4(packed.reshape(ours.packed.shape)).int()
    diff = (theirs_codes - unpack_nf4(ours.packed).int()).abs()
    assert int(diff.max()) <= 1
    assert float(diff.float().mean()) < 1e-4, f"{int(diff.sum())} of {diff.numel()} codes differ"
