"""Which kernel runs a 4-bit linear of shape [N, K] at M rows: a table measured on each GPU.

A row per (M, N, K) names a backend in two columns, `deterministic` (the default: the same inputs
give the same bits) and `fast`; NF4 has rows of its own; without a row, a fixed rule. See
docs/kernels.md, sections "The dispatch" and "NF4, the QLoRA baseline"."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROWS_M = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
DETERMINISTIC_BACKENDS = ("qerl", "humming", "humming-ordered", "dequant")
BACKENDS = (*DETERMINISTIC_BACKENDS, "humming-fast")
NF4_OPS = ("nf4", "nf4-dx")
NF4_BACKENDS = ("triton", "bnb", "dequant")
# Without a table row, bitsandbytes' gemv serves NF4 forwards up to this many rows and our decode
# pass + cuBLAS (`dequant`) the rest, dX included: on the H200 (7B layers, L2-cold; docs/kernels.md,
# "NF4") the decode pass beats bitsandbytes' dequantize + cuBLAS by 12-19% at 2-32 rows and every
# dX, and is within 2.5% of the per-layer best from 64 rows; our Triton GEMM is 5-27x slower below 64.
NF4_BNB_MAX_M = 1
# Measured tables shipped with the package, one per GPU (`dispatch-<gpu>.json`).
SHIPPED_DIR = Path(__file__).parent / "cuda"


def row_m(m: int) -> int:
    """The table row that serves m rows."""
    return next((r for r in ROWS_M if r >= m), ROWS_M[-1])


def row_key(m: int, n: int, k: int) -> str:
    return f"m{row_m(m)}:n{n}:k{k}"


def nf4_row_key(op: str, m: int, n: int, k: int) -> str:
    """The key of an NF4 row: `op` is `nf4` (forward) or `nf4-dx`."""
    if op not in NF4_OPS:
        raise ValueError(f"NF4 dispatch op {op!r}: choose one of {', '.join(NF4_OPS)}")
    return f"{op}:{row_key(m, n, k)}"


def _allowed(key: str, column: str) -> tuple[str, ...]:
    """The backends a row may name: NF4's for an `nf4*:` key, else the NVFP4 column's."""
    if key.split(":", 1)[0] in NF4_OPS:
        return NF4_BACKENDS
    return DETERMINISTIC_BACKENDS if column == "deterministic" else BACKENDS


def _nvfp4_rows(rows: dict[str, str]) -> dict[str, str]:
    return {key: v for key, v in rows.items() if key.startswith("m")}


@dataclass(frozen=True)
class DispatchTable:
    """Winners per row key, for one GPU (its name and SM count)."""

    gpu: str
    sms: int
    deterministic: dict[str, str] = field(default_factory=dict)
    fast: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for column in ("deterministic", "fast"):
            bad = {k: v for k, v in getattr(self, column).items() if v not in _allowed(k, column)}
            if bad:
                key = next(iter(bad))
                raise ValueError(f"dispatch table {column} rows {bad} name backends outside {_allowed(key, column)}")

    def column(self, deterministic: bool) -> dict[str, str]:
        return self.deterministic if deterministic else self.fast

    def to_json(self) -> dict:
        return {"gpu": self.gpu, "sms": self.sms, "deterministic": dict(sorted(self.deterministic.items())),
                "fast": dict(sorted(self.fast.items()))}

    @classmethod
    def from_json(cls, data: dict) -> DispatchTable:
        try:
            return cls(str(data["gpu"]), int(data["sms"]), dict(data["deterministic"]), dict(data["fast"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"a dispatch table needs gpu, sms, deterministic and fast ({e})") from e


def shipped_tables() -> list[DispatchTable]:
    return [DispatchTable.from_json(json.loads(p.read_text())) for p in sorted(SHIPPED_DIR.glob("dispatch-*.json"))]


def _device_identity(device: torch.device) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(device)
    return props.name, props.multi_processor_count


def merge_tables(tables: list[DispatchTable]) -> DispatchTable | None:
    """One table of the rows of `tables` (measured on one GPU; a later table's row wins a clash)."""
    if not tables:
        return None
    merged = DispatchTable(tables[0].gpu, tables[0].sms)
    for t in tables:
        merged.deterministic.update(t.deterministic)
        merged.fast.update(t.fast)
    return merged


def table_for(device: torch.device) -> DispatchTable | None:
    """The shipped tables measured on `device`'s GPU (same name and SMs), merged; else None."""
    if device.type != "cuda":
        return None
    identity = _device_identity(device)
    return merge_tables([t for t in shipped_tables() if (t.gpu, t.sms) == identity])


@dataclass
class _Active:
    table: DispatchTable | None = None
    deterministic: bool = True
    chosen: bool = False  # a table was installed (else the shipped one is looked up on first use)


_ACTIVE = _Active()


def configure(table: DispatchTable | None, deterministic: bool = True) -> None:
    """Use `table` (None: the rule without a table) and the schedule column for every later call."""
    _ACTIVE.table, _ACTIVE.deterministic, _ACTIVE.chosen = table, deterministic, True


def active(device: torch.device) -> tuple[DispatchTable | None, bool]:
    """The table in use and whether the deterministic column is, looking up the shipped table for
    `device` on first use when none was configured."""
    if not _ACTIVE.chosen:
        configure(table_for(device), _ACTIVE.deterministic)
    return _ACTIVE.table, _ACTIVE.deterministic


def ours_or_dequant(m: int, n: int, k: int, device: torch.device) -> str:
    """The rule without a table row: our GEMM where its own config table says it wins."""
    from qerl_pipe.kernels import cuda_ext

    return "qerl" if cuda_ext.gemm_wins(m, n, k, cuda_ext.sm_count(device)) else "dequant"


def backend(m: int, n: int, k: int, device: torch.device, has_humming: bool) -> str:
    """The backend for an `[m, k] x [n, k]^T` product on `device` (a CUDA device our kernels run on)."""
    table, deterministic = active(device)
    chosen = table.column(deterministic).get(row_key(m, n, k)) if table is not None else None
    if chosen is None or (chosen.startswith("humming") and not has_humming):
        return ours_or_dequant(m, n, k, device)
    return chosen


def nf4_backend(op: str, m: int, n: int, k: int, device: torch.device, has_bnb: bool) -> str:
    """The backend for an NF4 product (`op` `nf4`: `[m, k] x [n, k]^T`; `nf4-dx`: `[m, n] x [n, k]`)
    on `device` (CUDA); `has_bnb`: bitsandbytes runs there."""
    table, deterministic = active(device)
    chosen = table.column(deterministic).get(nf4_row_key(op, m, n, k)) if table is not None else None
    if chosen is None:
        chosen = "bnb" if op != "nf4-dx" and m <= NF4_BNB_MAX_M else "dequant"
    return "triton" if chosen == "bnb" and not has_bnb else chosen


def humming_schedules(table: DispatchTable | None, deterministic: bool,
                      max_m: int | None = None) -> dict[tuple[int, int], set[str]]:
    """Layer shapes (N, K) that some row (up to `max_m` rows) sends to humming, each with the
    humming schedules its rows name: the shapes that need a copy, and what to compile for them."""
    if table is None:
        return {}
    out: dict[tuple[int, int], set[str]] = {}
    for key, chosen in _nvfp4_rows(table.column(deterministic)).items():
        m, n, k = (int(part[1:]) for part in key.split(":"))
        if chosen.startswith("humming") and (max_m is None or m <= row_m(max_m)):
            out.setdefault((n, k), set()).add(chosen)
    return out


def humming_shapes(table: DispatchTable | None, deterministic: bool, max_m: int | None = None) -> set[tuple[int, int]]:
    """Layer shapes (N, K) that some row (up to `max_m` rows) sends to humming: those that need a copy."""
    return set(humming_schedules(table, deterministic, max_m))


def humming_copy_shapes(device: torch.device, table: DispatchTable | None = None,
                        deterministic: bool | None = None) -> set[tuple[int, int]]:
    """The layer shapes that would get humming copies on `device` under `table` and its column
    (default: the active ones): none off CUDA or where humming cannot run."""
    from qerl_pipe.kernels import humming_backend

    if device.type != "cuda":
        return set()
    active_table, active_column = active(device)
    table = active_table if table is None else table
    shapes = humming_shapes(table, active_column if deterministic is None else deterministic)
    return shapes if shapes and humming_backend.available(device) else set()
