"""Kernel tuning's pure parts on CPU: candidate lists, M buckets, table keys, and the selection loop
with the launches and the timer faked (the real ones need a CUDA GPU: tests/kernels/test_kernels_gpu.py,
and the build-engine GPU run)."""

from __future__ import annotations

import pytest
import torch

from qerl_pipe.errors import QerlError
from qerl_pipe.kernels import nf4_linear, nf4_linear_dx, nvfp4_linear, nvfp4_linear_dx
from qerl_pipe.kernels.configs import M_BUCKETS, KernelConfig, table_key
from qerl_pipe.kernels.tuning import (
    _representative_ms, _tune_table, dx_candidates, fwd_candidates, tune_kernels, weight_copies,
)


def test_every_m_bucket_has_candidates():
    for m in (*M_BUCKETS, 4096):
        fwd, dx = fwd_candidates(m), dx_candidates(m)
        assert fwd and dx and len(set(fwd)) == len(fwd) and len(set(dx)) == len(dx)
        if m <= 16:
            assert all(c.kernel != "dequant" for c in fwd)  # decode: never a full decode pass
        if m >= 1024:
            assert all(c.kernel == "dequant" for c in fwd + dx)  # decode once, then cuBLAS
        # A tiled dX tile covers M without more than one 64-row block of waste.
        assert all(c.block_m >= min(m, 16) for c in dx if c.kernel == "tiled")


def test_buckets_are_timed_at_the_largest_requested_m():
    assert _representative_ms([1, 3, 1024, 4096, 2]) == {1: 1, 2: 2, 4: 3, 1024: 4096}
    with pytest.raises(ValueError):
        _representative_ms([0])
    assert weight_copies(1) == 32 and weight_copies(10 * 2**30) == 1


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_the_fastest_correct_candidate_wins_per_shape_bucket_and_op(fmt):
    fwd_op, dx_op = {"nvfp4": (nvfp4_linear, nvfp4_linear_dx), "nf4": (nf4_linear, nf4_linear_dx)}[fmt]
    used: list[KernelConfig] = []

    def launch(op):
        def run(a, w, cfg):
            used.append(cfg)
            out = op(a, w)  # the CPU reference
            return torch.zeros_like(out) if cfg.ptx_decode else out  # PTX "broken": must be dropped
        return run

    def cost(cfg: KernelConfig) -> float:
        return 1.0 / (cfg.block_n * cfg.block_k * cfg.split_k)

    def timer(calls):
        used.clear()
        calls[-1]()
        return cost(used[-1])

    shapes = [(64, 64), (128, 64), (64, 64)]
    table = _tune_table(shapes, [1, 16, 1024], fmt, torch.device("cpu"), launch(fwd_op), launch(dx_op), timer)
    expected = {}
    for n, k in [(64, 64), (128, 64)]:
        for m in (1, 16, 1024):
            for op, cands in (("fwd", fwd_candidates(m)), ("dx", dx_candidates(m))):
                expected[table_key(op, fmt, m, n, k)] = min((c for c in cands if not c.ptx_decode), key=cost)
    assert table == expected


def test_no_correct_candidate_and_no_gpu_are_errors():
    def wrong(a, w, cfg):
        return torch.full((a.shape[0], w.out_features), float("nan"))

    with pytest.raises(QerlError, match="no nvfp4 fwd kernel config gave a correct result"):
        _tune_table([(32, 64)], [1], "nvfp4", torch.device("cpu"), wrong, wrong, lambda calls: 1.0)
    with pytest.raises(QerlError, match="CUDA GPU"):
        tune_kernels([(32, 64)], [1], "nvfp4", "cpu")
