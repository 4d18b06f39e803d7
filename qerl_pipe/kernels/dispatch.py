"""Which kernel runs an NVFP4 linear of shape [N, K] at M rows: a table measured on each GPU. A row per
(M, N, K) names a backend in two columns, `deterministic` (the default: the same inputs give the same bits) and
`fast`; without a row, a fixed rule. See docs/kernels.md, section "The dispatch"."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROWS_M = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
DETERMINISTIC_BACKENDS = ("qerl", "humming", "humming-ordered", "dequant")
BACKENDS = (*DETERMINISTIC_BACKENDS, "humming-fast")
ROW_KEY = re.compile(r"m\d+:n\d+:k\d+")
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
        for column in ("deterministic", "fast"):
            allowed = DETERMINISTIC_BACKENDS if column == "deterministic" else BACKENDS
            bad = {k: v for k, v in getattr(self, column).items() if v not in allowed or not ROW_KEY.fullmatch(k)}
            if bad:
                # An NF4 row (`nf4:m..`) is refused here too: NF4 runs on bitsandbytes, with no table.
                raise ValueError(f"dispatch table {column} rows {bad}: a row is m<M>:n<N>:k<K> naming one of "
                                 f"{allowed}; measure the table again with `qerl-pipe bench kernels-dispatch`")

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


def table_for(device: torch.device) -> DispatchTable | None:
    """The shipped table measured on `device`'s GPU (same name and SMs), else None."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return next((t for t in shipped_tables() if (t.gpu, t.sms) == (props.name, props.multi_processor_count)), None)


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


def humming_schedules(table: DispatchTable | None, deterministic: bool,
                      max_m: int | None = None) -> dict[tuple[int, int], set[str]]:
    """Layer shapes (N, K) that some row (up to `max_m` rows) sends to humming, each with the
    humming schedules its rows name: the shapes that need a copy, and what to compile for them."""
    if table is None:
        return {}
    out: dict[tuple[int, int], set[str]] = {}
    for key, chosen in table.column(deterministic).items():
        m, n, k = (int(part[1:]) for part in key.split(":"))
        if chosen.startswith("humming") and (max_m is None or m <= row_m(max_m)):
            out.setdefault((n, k), set()).add(chosen)
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
    shapes = set(humming_schedules(table, active_column if deterministic is None else deterministic))
    return shapes if shapes and humming_backend.available(device) else set()
