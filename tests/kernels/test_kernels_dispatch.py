"""The NVFP4 kernel dispatch (kernels/dispatch.py) and what depends on it, on the CPU.

The table's rows and columns, the fallback when a humming row has no humming copy, the shipped
tables, the memory the humming copies cost and how the planner gives them up first.
"""

from __future__ import annotations

import json

import pytest
import torch

from qerl_pipe.model.shapes import QWEN25_SHAPES
from qerl_pipe.kernels import dispatch
from qerl_pipe.kernels.dispatch import ROWS_M, DispatchTable, row_key, row_m
from qerl_pipe.memory.plan import StepShape, plan_step
from qerl_pipe.kernels.base_formats import NVFP4
from qerl_pipe.memory.step import kernel_copy_bytes
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.recipe import EngineSection

QKV, GATE_UP = (4608, 3584), (37888, 3584)


def _table() -> DispatchTable:
    return DispatchTable("GPU X", 100,
                         deterministic={"m1:n37888:k3584": "qerl", "m128:n37888:k3584": "humming",
                                        "m4096:n37888:k3584": "dequant"},
                         fast={"m1:n37888:k3584": "qerl", "m128:n37888:k3584": "humming-fast",
                               "m64:n4608:k3584": "humming-fast"})


def test_rows_round_up_to_the_next_measured_m() -> None:
    assert [row_m(m) for m in (1, 2, 8, 9, 64, 65, 4096, 10240, 10**6)] == [1, 8, 8, 16, 64, 128, 4096, 16384, 16384]
    assert row_key(100, *GATE_UP) == "m128:n37888:k3584"
    assert ROWS_M == tuple(sorted(ROWS_M))


def test_table_refuses_unknown_backends_and_stream_k_in_the_deterministic_column() -> None:
    with pytest.raises(ValueError, match="humming-fast"):
        DispatchTable("g", 1, deterministic={"m1:n8:k16": "humming-fast"})
    with pytest.raises(ValueError, match="cutlass"):
        DispatchTable("g", 1, fast={"m1:n8:k16": "cutlass"})
    with pytest.raises(ValueError, match="deterministic and fast"):
        DispatchTable.from_json({"gpu": "g", "sms": 1})


def test_table_json_round_trip() -> None:
    t = _table()
    assert DispatchTable.from_json(json.loads(json.dumps(t.to_json()))) == t


def test_humming_shapes_follow_the_column() -> None:
    t = _table()
    assert set(dispatch.humming_schedules(t, deterministic=True)) == {GATE_UP}
    assert set(dispatch.humming_schedules(t, deterministic=False)) == {GATE_UP, QKV}
    assert set(dispatch.humming_schedules(t, deterministic=True, max_m=64)) == set()
    assert set(dispatch.humming_schedules(None, deterministic=True)) == set()


def test_humming_schedules_name_what_to_compile_per_shape() -> None:
    t = DispatchTable("g", 1, deterministic={"m64:n4608:k3584": "humming-ordered", "m1024:n4608:k3584": "humming",
                                             "m1:n4608:k3584": "qerl", "m64:n37888:k3584": "humming-ordered"})
    assert dispatch.humming_schedules(t, deterministic=True) == {QKV: {"humming-ordered", "humming"},
                                                                 GATE_UP: {"humming-ordered"}}
    assert dispatch.humming_schedules(t, deterministic=True, max_m=64) == {QKV: {"humming-ordered"},
                                                                           GATE_UP: {"humming-ordered"}}
    assert dispatch.humming_schedules(t, deterministic=False) == {}


@pytest.fixture
def installed(monkeypatch):
    """`_table()` as the active table; the rule without a row answers 'rule'."""
    monkeypatch.setattr(dispatch, "ours_or_dequant", lambda m, n, k, device: "rule")

    def install(deterministic: bool) -> None:
        dispatch.configure(_table(), deterministic)

    yield install
    dispatch.configure(None, True)
    dispatch._ACTIVE.chosen = False


def test_backend_reads_the_row_and_falls_back_without_a_copy(installed) -> None:
    dev = torch.device("cpu")
    installed(True)
    assert dispatch.backend(100, *GATE_UP, dev, has_humming=True) == "humming"
    assert dispatch.backend(100, *GATE_UP, dev, has_humming=False) == "rule"
    assert dispatch.backend(1, *GATE_UP, dev, has_humming=True) == "qerl"
    assert dispatch.backend(10240, *GATE_UP, dev, has_humming=True) == "rule"  # no row 16384
    assert dispatch.backend(64, *QKV, dev, has_humming=True) == "rule"
    installed(False)
    assert dispatch.backend(64, *QKV, dev, has_humming=True) == "humming-fast"
    assert dispatch.backend(100, *GATE_UP, dev, has_humming=True) == "humming-fast"


def test_shipped_tables_parse_and_name_measured_rows() -> None:
    tables = dispatch.shipped_tables()
    assert tables, "the package ships at least one measured dispatch table"
    for t in tables:
        assert t.sms > 0 and t.gpu
        for column in (t.deterministic, t.fast):
            for key, chosen in column.items():
                assert dispatch.ROW_KEY.fullmatch(key) and int(key[1:].split(":")[0]) in ROWS_M, key
                assert chosen in dispatch.BACKENDS, (key, chosen)
    # One table per GPU: a second file of the same GPU would go unread.
    assert len({(t.gpu, t.sms) for t in tables}) == len(tables)


def test_a_table_refuses_rows_it_cannot_serve() -> None:
    """NF4 rows (`nf4:m..`, from before NF4 ran on bitsandbytes alone), backends of another column
    and malformed keys are refused, naming the fix."""
    for column, rows in (("deterministic", {"nf4:m1:n8:k64": "dequant"}), ("fast", {"m1:n8:k64": "bnb"}),
                         ("deterministic", {"m1:n8:k64": "humming-fast"}), ("fast", {"m1:n8": "qerl"})):
        with pytest.raises(ValueError, match="bench kernels-dispatch"):
            DispatchTable("g", 1, **{column: rows})


def test_no_table_and_no_copies_off_cuda() -> None:
    assert dispatch.table_for(torch.device("cpu")) is None
    assert dispatch.humming_copy_shapes(torch.device("cpu"), _table(), True) == set()


def test_kernel_copy_bytes_count_the_nvfp4_bytes_of_the_routed_layers() -> None:
    c = DecoderConfig.from_hf(QWEN25_SHAPES["qwen2.5-7b"])
    per_linear = int(37888 * 3584 * NVFP4.bytes_per_weight) + 4
    assert kernel_copy_bytes(c, {GATE_UP}) == 28 * per_linear
    assert kernel_copy_bytes(c, set()) == 0
    assert kernel_copy_bytes(c, {GATE_UP, QKV}) > kernel_copy_bytes(c, {GATE_UP})


def test_planner_gives_up_the_copies_before_any_step_setting() -> None:
    c = DecoderConfig.from_hf(QWEN25_SHAPES["qwen2.5-7b"])
    shape = StepShape(64, 8, 1280, 256, 32, 64, 8, 1024)
    copies = kernel_copy_bytes(c, {GATE_UP})
    free = plan_step(c, "nvfp4", shape, None, kernel_copies=copies)
    assert free.kernel_copies and free.estimate["kernel_copies"] == copies
    # A budget that holds the recipe's settings but not the copies: same settings, no copies.
    tight = free.estimate["total"] - copies // 2
    plan = plan_step(c, "nvfp4", shape, tight, kernel_copies=copies)
    assert not plan.kernel_copies and plan.estimate["kernel_copies"] == 0
    assert (plan.kv_slots, plan.micro_batch, plan.logprob_chunk) == (free.kv_slots, free.micro_batch,
                                                                      free.logprob_chunk)
    assert "no kernel copies of the base" in plan.describe()
    assert plan.to_json()["kernel_copies_asked_bytes"] == copies
    # Without asking, nothing changes: no copies, no note.
    plain = plan_step(c, "nvfp4", shape, None)
    assert not plain.kernel_copies and "kernel copies" not in plain.describe()


def test_engine_section_is_deterministic_by_default() -> None:
    assert EngineSection().deterministic is True
    assert EngineSection(deterministic=False).deterministic is False
