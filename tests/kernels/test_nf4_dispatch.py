"""NF4 rows of the kernel dispatch (kernels/dispatch.py) and the bitsandbytes backend's switches, on the CPU.

Without a row bitsandbytes serves a one-row forward and our decode pass + cuBLAS the rest; a row overrides
that per op (forward, dX), M and layer shape; a bitsandbytes row without bitsandbytes falls back
to Triton. GPU results: tests/kernels/test_bnb_gpu.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from qerl_pipe.kernels import bnb_backend, dispatch
from qerl_pipe.kernels.dispatch import NF4_BNB_MAX_M, DispatchTable, merge_tables, nf4_row_key

CPU = torch.device("cpu")
SHAPE = (4608, 3584)


@pytest.fixture
def restore_dispatch():
    yield dispatch.configure
    dispatch.configure(None, True)
    dispatch._ACTIVE.chosen = False


def test_without_a_row_bitsandbytes_serves_one_row_and_the_decode_pass_the_rest(restore_dispatch) -> None:
    restore_dispatch(None, True)
    ms = (1, 2, 16, 17, 64, 10240)
    assert [dispatch.nf4_backend("nf4", m, *SHAPE, CPU, True) for m in ms] == ["bnb"] + ["dequant"] * 5
    assert [dispatch.nf4_backend("nf4-dx", m, *SHAPE, CPU, True) for m in ms] == ["dequant"] * 6
    # Without bitsandbytes our Triton GEMV takes the one-row forward (it beats the decode pass there).
    assert [dispatch.nf4_backend("nf4", m, *SHAPE, CPU, False) for m in (1, 2, 64)] == ["triton", "dequant", "dequant"]
    assert NF4_BNB_MAX_M == 1


def test_a_row_chooses_per_op_m_and_shape(restore_dispatch) -> None:
    rows = {nf4_row_key("nf4", 64, *SHAPE): "bnb", nf4_row_key("nf4", 1, *SHAPE): "dequant",
            nf4_row_key("nf4-dx", 16, *SHAPE): "triton"}
    restore_dispatch(DispatchTable("GPU X", 100, deterministic=rows, fast=dict(rows)), True)
    assert dispatch.nf4_backend("nf4", 40, *SHAPE, CPU, True) == "bnb"  # row 64 serves 33..64
    assert dispatch.nf4_backend("nf4", 40, *SHAPE, CPU, False) == "triton"  # no bitsandbytes here
    assert dispatch.nf4_backend("nf4", 1, *SHAPE, CPU, True) == "dequant"
    assert dispatch.nf4_backend("nf4-dx", 9, *SHAPE, CPU, True) == "triton"
    assert dispatch.nf4_backend("nf4-dx", 1, *SHAPE, CPU, True) == "dequant"  # no row: the rule
    assert dispatch.nf4_backend("nf4", 1, 256, 512, CPU, True) == "bnb"  # another shape: the rule


def test_nf4_rows_name_nf4_backends_and_leave_humming_alone() -> None:
    with pytest.raises(ValueError, match="bnb"):
        DispatchTable("g", 1, deterministic={"m1:n8:k64": "bnb"})
    with pytest.raises(ValueError, match="triton"):
        DispatchTable("g", 1, fast={"nf4:m1:n8:k64": "humming"})
    with pytest.raises(ValueError, match="nf4-dx"):
        nf4_row_key("dx", 1, 8, 64)
    t = DispatchTable("g", 1, deterministic={"nf4:m64:n8:k64": "triton", "m64:n8:k64": "humming"})
    assert DispatchTable.from_json(json.loads(json.dumps(t.to_json()))) == t
    assert dispatch.humming_shapes(t, deterministic=True) == {(8, 64)}


def test_tables_of_one_gpu_merge() -> None:
    nvfp4 = DispatchTable("H", 132, deterministic={"m1:n8:k64": "qerl"}, fast={"m1:n8:k64": "humming-fast"})
    nf4 = DispatchTable("H", 132, deterministic={"nf4:m1:n8:k64": "bnb"}, fast={"nf4:m1:n8:k64": "bnb"})
    merged = merge_tables([nvfp4, nf4])
    assert merged.deterministic == {"m1:n8:k64": "qerl", "nf4:m1:n8:k64": "bnb"}
    assert merged.fast == {"m1:n8:k64": "humming-fast", "nf4:m1:n8:k64": "bnb"}
    assert nvfp4.deterministic == {"m1:n8:k64": "qerl"}  # the inputs are left as they were
    assert merge_tables([]) is None


def test_bitsandbytes_is_off_the_gpu_and_when_turned_off(monkeypatch) -> None:
    assert bnb_backend.why_unavailable("cpu") == "not a CUDA device"
    monkeypatch.setenv("QERL_BNB", "0")
    assert bnb_backend.why_unavailable("cuda") == "QERL_BNB=0"
