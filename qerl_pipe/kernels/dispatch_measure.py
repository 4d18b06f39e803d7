"""Measuring the dispatch table on this GPU: every backend, every layer shape, every row M. Every backend is
checked against fp32 before it is timed; a humming schedule enters the deterministic column only where it
repeated bit for bit (`humming` also only if batch invariant). docs/kernels.md, "How a row is measured"."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4_in_row_chunks
from qerl_pipe.kernels import cuda_ext, humming_backend
from qerl_pipe.kernels.dispatch import BACKENDS, DETERMINISTIC_BACKENDS, DispatchTable, row_key
from qerl_pipe.kernels.optional_backend import failure
from qerl_pipe.kernels.tiled import TiledNVFP4, tile_nvfp4
from qerl_pipe.kernels.tuning import rel_err, time_graph, weight_copies

log = logging.getLogger(__name__)

REPS = 30
REPEATS = 8  # calls that must give the same bits for a humming row to count as deterministic
MAX_REL_ERR = 1e-2
# Our GEMM runs more rows in passes of at most 256; past that it is never measured faster.
QERL_MAX_M = 256


@dataclass
class Operands:
    """One random [N, K] layer in every layout, with as many copies of each as keep the L2 cold."""

    n: int
    k: int
    dense: Tensor  # the NVFP4 weight dequantized to fp32: the reference
    tiled: list[TiledNVFP4]  # our layout, each copy carrying its humming copy when there is one
    bf16: list[Tensor]
    humming_compile_s: float | None
    humming_schedules: tuple[str, ...] = ()  # the humming schedules that compiled for this shape


def operands(n: int, k: int, device: torch.device, humming: bool, bf16: bool = False, label: str = "") -> Operands:
    gen = torch.Generator(device=device).manual_seed(n * 31 + k)
    w = torch.randn(n, k, device=device, generator=gen) * 0.02
    wb = w.to(torch.bfloat16) if bf16 else None
    q = quantize_nvfp4_in_row_chunks(w, name=label or f"[{n}, {k}]")
    del w
    tq = tile_nvfp4(q)
    copies = weight_copies(tq.qweight.numel() * 4 + tq.scales.numel())
    tiled = [tq] + [replace(tq, qweight=tq.qweight.clone(), scales=tq.scales.clone()) for _ in range(copies - 1)]
    compile_s, schedules = None, []
    if humming:
        t0 = time.perf_counter()
        try:
            with_copies = [replace(t, humming=humming_backend.HummingNVFP4(q)) for t in tiled]
        except Exception as exc:  # a shape humming refuses: the other backends are measured alone
            _refused(n, k, "", exc)
        else:
            for schedule in humming_backend.SCHEDULES:
                try:
                    with_copies[0].humming.compile(schedule)
                    torch.cuda.synchronize(device)
                    schedules.append(schedule)
                except Exception as exc:  # that schedule is measured without; the others still are
                    _refused(n, k, schedule, exc)
            if schedules:
                tiled, compile_s = with_copies, time.perf_counter() - t0
    wbs = [wb] + [wb.clone() for _ in range(weight_copies(wb.numel() * 2) - 1)] if wb is not None else []
    return Operands(n, k, dequantize_nvfp4(q, torch.float32), tiled, wbs, compile_s, tuple(schedules))


def _refused(n: int, k: int, schedule: str, exc: Exception) -> None:
    log.warning("humming-kernels cannot run [%d, %d]%s (%s); measured without it", n, k,
                f" under {schedule}" if schedule else "", failure(exc))


def _calls(ops: Operands) -> dict[str, tuple[Callable, int]]:
    """backend -> (f(x, i), copies): the product on copy i."""
    t = ops.tiled
    calls: dict[str, tuple[Callable, int]] = {
        "qerl": (lambda x, i: cuda_ext.gemm(x, t[i]), len(t)),
        "dequant": (lambda x, i: x @ cuda_ext.dequantize(t[i]).T, len(t)),
    }
    if t[0].humming is not None:
        for schedule in ops.humming_schedules:
            calls[schedule] = (lambda x, i, s=schedule: t[i].humming.matmul(x, s), len(t))
    if ops.bf16:
        calls["bf16"] = (lambda x, i: x @ ops.bf16[i].T, len(ops.bf16))
    return calls


def inputs(ops: Operands, m: int) -> tuple[Tensor, Tensor]:
    """x [m, K] (bf16, fixed by the shape and m) and its fp32 reference product."""
    gen = torch.Generator(device=ops.dense.device).manual_seed(ops.n * 7 + ops.k * 3 + m)
    x = torch.randn(m, ops.k, device=ops.dense.device, generator=gen).to(torch.bfloat16)
    return x, x.float() @ ops.dense.T


def measure_shape(ops: Operands, ms: Iterable[int]) -> list[dict]:
    """One row per M: each backend's time (µs) and error, the winners, and humming's checks."""
    rows = []
    for m in ms:
        x, ref = inputs(ops, m)
        row: dict = {"N": ops.n, "K": ops.k, "M": m}
        if ops.humming_compile_s is not None:
            row["humming_compile_s"] = ops.humming_compile_s
        for name, (f, copies) in _calls(ops).items():
            if name == "qerl" and m > QERL_MAX_M:
                continue
            if name != "bf16":  # bf16 is the unquantized weight: its distance to ref is the quantization's
                err = row[f"{name}_rel_err"] = rel_err(f(x, 0), ref)
                if err >= MAX_REL_ERR:
                    continue
            row[f"{name}_us"] = time_graph([lambda i=i, f=f: f(x, i) for i in range(copies)], REPS) * 1e6
            if name.startswith("humming"):
                first = f(x, 0)
                row[f"{name}_repeatable"] = all(torch.equal(first, f(x, 0)) for _ in range(REPEATS - 1))
                row[f"{name}_batch_invariant"] = bool(torch.equal(f(x, 0)[:1], f(x[:1].contiguous(), 0)))
        for column, allowed in (("deterministic", DETERMINISTIC_BACKENDS), ("fast", BACKENDS)):
            timed = {b: row[f"{b}_us"] for b in allowed if f"{b}_us" in row}
            if column == "deterministic":  # a humming schedule that failed its checks is not deterministic
                timed = {b: t for b, t in timed.items() if _deterministic(b, row)}
            if timed:
                row[f"{column}_winner"] = min(timed, key=timed.get)
        rows.append(row)
    return rows


def _deterministic(backend: str, row: dict) -> bool:
    """Whether a measured backend may serve the deterministic column of `row`."""
    if not backend.startswith("humming"):
        return True
    return row[f"{backend}_repeatable"] and (backend != "humming" or row[f"{backend}_batch_invariant"])


def table_from_rows(rows: list[dict], device: torch.device) -> DispatchTable:
    """The winners of measured rows as this GPU's table."""
    props = torch.cuda.get_device_properties(device)
    columns: dict[str, dict[str, str]] = {"deterministic": {}, "fast": {}}
    for r in rows:
        for column in columns:
            if f"{column}_winner" in r:
                columns[column][row_key(r["M"], r["N"], r["K"])] = r[f"{column}_winner"]
    return DispatchTable(props.name, props.multi_processor_count, **columns)


def measure_table(shapes: Iterable[tuple[int, int]], ms: Iterable[int], device: torch.device,
                  log: Callable[[str], None] = lambda s: None) -> tuple[DispatchTable, list[dict]]:
    """The dispatch table of `shapes` at row counts `ms` on `device`, and every measured row."""
    humming = humming_backend.available(device)
    ms = tuple(ms)
    rows: list[dict] = []
    for n, k in shapes:
        t0 = time.perf_counter()
        rows += measure_shape(operands(n, k, device, humming), ms)
        log(f"dispatch: [{n}, {k}] at M {', '.join(map(str, ms))} measured in {time.perf_counter() - t0:.1f} s")
        torch.cuda.empty_cache()
    return table_from_rows(rows, device), rows
