"""`bench nf4-dispatch` on a CUDA GPU: it measures the NF4 rows and makes a dispatch table of them."""

from __future__ import annotations

import torch

from tests.kernels.test_bnb_gpu import MAX_REL, SHAPES, _bnb, pytestmark, rule  # noqa: F401 (fixtures and marks, shared)


def test_the_bench_measures_nf4_rows_and_makes_a_table(rule) -> None:
    from qerl_lab.nf4_dispatch import measure_nf4_shape, nf4_operands, nf4_table, time_dispatch

    device = torch.device("cuda", torch.cuda.current_device())
    ops = nf4_operands(*SHAPES[2], device)
    rows = measure_nf4_shape(ops, (1, 16, 64))
    assert [(r["op"], r["M"]) for r in rows] == [(op, m) for op in ("nf4", "nf4-dx") for m in (1, 16, 64)]
    assert all(r["winner"] in ("triton", "bnb", "dequant") and r["bf16_us"] > 0 for r in rows)
    rule(nf4_table(rows, device), True)
    for r in rows:
        time_dispatch(ops, r)
        assert r["dispatch_backend"] == r["winner"] and r["dispatch_rel_err"] < MAX_REL
