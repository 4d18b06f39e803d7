"""Which kernel runs an NVFP4 linear of shape [N, K] at M rows: a table measured on each GPU.

Backends:
- `qerl`: our CUDA decode GEMM (`cuda_ext.gemm`, the LoRA expand and bias in its epilogue);
- `humming`: humming-kernels with its batch-invariant schedule (deterministic);
- `humming-fast`: humming's default stream-K schedule (not deterministic run to run);
- `dequant`: our dequantize pass into bf16, then cuBLAS.

A table has one row per (M, N, K) for M in `ROWS_M` (the row serving m rows is the smallest at or
above m, the last for more) and two columns: `deterministic` (the default: the same inputs give
the same bits, so a resumed run repeats an unbroken one) picks among qerl / humming / dequant,
`fast` (`engine.deterministic: false`) among all four. build-engine measures it on its GPU
(`kernels.dispatch_measure`) and stores it in the engine; `kernels/cuda/dispatch-<gpu>.json` are
the shipped tables, used on those GPUs without a measured one. Shapes or GPUs without a
row get the rule the CUDA kernels had before humming: ours up to 64 rows (and up to 256 where
their own table says so), else dequantize + cuBLAS. A humming row whose weight has no humming copy
(humming unavailable, or the memory plan left no room for the copy) falls back to that rule too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROWS_M = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
DETERMINISTIC_BACKENDS = ("qerl", "humming", "dequant")
BACKENDS = (*DETERMINISTIC_BACKENDS, "humming-fast")
# Measured tables shipped with the package, one per GPU (`dispatch-<gpu>.json`).
SHIPPED_DIR = Path(__file__).parent / "cuda"


def row_m(m: int) -> int:
    """The table row that serves m rows."""
    return next((r for r in ROWS_M if r >= m), ROWS_M[-1])


def row_key(m: int, n: int, k: int) -> str:
    return f"m{row_m(m)}:n{n}:k{k}"


@dataclass(frozen=True)
class DispatchTable:
    """Winners per row key, for one GPU (its name and SM count)."""

    gpu: str
    sms: int
    deterministic: dict[str, str] = field(default_factory=dict)
    fast: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for column, allowed in (("deterministic", DETERMINISTIC_BACKENDS), ("fast", BACKENDS)):
            bad = {k: v for k, v in getattr(self, column).items() if v not in allowed}
            if bad:
                raise ValueError(f"dispatch table {column} rows {bad} name backends outside {allowed}")

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


def table_for(device: torch.device) -> DispatchTable | None:
    """The shipped table measured on `device`'s GPU (same name and SMs), else None."""
    if device.type != "cuda":
        return None
    identity = _device_identity(device)
    return next((t for t in shipped_tables() if (t.gpu, t.sms) == identity), None)


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


def humming_shapes(table: DispatchTable | None, deterministic: bool, max_m: int | None = None) -> set[tuple[int, int]]:
    """Layer shapes (N, K) that some row (up to `max_m` rows) sends to humming: those that need a copy."""
    if table is None:
        return set()
    out = set()
    for key, chosen in table.column(deterministic).items():
        m, n, k = (int(part[1:]) for part in key.split(":"))
        if chosen.startswith("humming") and (max_m is None or m <= row_m(max_m)):
            out.add((n, k))
    return out


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
