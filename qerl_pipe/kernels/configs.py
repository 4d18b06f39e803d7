"""Kernel launch configurations: a plain table from shape key to config, JSON in and out.

A key is `"{op}:{fmt}:m{bucket}"`, or `"{op}:{fmt}:m{bucket}:n{N}:k{K}"` for one layer (that one
wins); build-engine tunes the table and stores it in the engine. See docs/kernels.md, section
"The Triton kernels"."""

from __future__ import annotations

from dataclasses import asdict, dataclass

M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
KERNELS = ("skinny", "gemv", "tiled", "dequant")


@dataclass(frozen=True)
class KernelConfig:
    """One launch. `skinny`: fp32-FMA GEMV over split-K slices, reduced once; `gemv`: reduced every
    K tile; `tiled`: tl.dot GEMM; `dequant`: decode W into bf16 tiles, then cuBLAS (block_m and
    split_k unused). For `dx`, block_n is the contracted (N) tile, block_k the output (K) tile."""

    kernel: str
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    # NVFP4 only: decode through inline PTX (bf16x2 FMA) instead of pure Triton; compiled code
    # only, the interpreter always runs the pure-Triton decode.
    ptx_decode: bool = False

    def __post_init__(self) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError("split_k and num_stages must be at least 1")
        if self.kernel == "tiled" and min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError("tiled configs need block_m, block_n, block_k >= 16 (tl.dot minimum)")


ConfigTable = dict[str, KernelConfig]


def m_bucket(m: int) -> int:
    """Smallest bucket >= m (the last bucket for anything larger)."""
    for b in M_BUCKETS:
        if m <= b:
            return b
    return M_BUCKETS[-1]


def table_key(op: str, fmt: str, m: int, n: int | None = None, k: int | None = None) -> str:
    base = f"{op}:{fmt}:m{m_bucket(m)}"
    return base if n is None else f"{base}:n{n}:k{k}"


# Config shorthands, shared with the tuning candidates (`kernels.tuning`).
def _sk(bm: int, bn: int, bk: int, split: int = 1, warps: int = 4, stages: int = 1,
        ptx: bool = False) -> KernelConfig:
    return KernelConfig("skinny", bm, bn, bk, split, warps, stages, ptx_decode=ptx)


def _gv(bm: int, bn: int, bk: int, split: int = 1, warps: int = 4, stages: int = 1,
        ptx: bool = False) -> KernelConfig:
    return KernelConfig("gemv", bm, bn, bk, split, warps, stages, ptx_decode=ptx)


def _t(bm: int, bn: int, bk: int, warps: int, stages: int, split: int = 1,
       ptx: bool = False) -> KernelConfig:
    return KernelConfig("tiled", bm, bn, bk, split, warps, stages, ptx_decode=ptx)


def _dq(bn: int = 32, bk: int = 256, warps: int = 4, ptx: bool = False) -> KernelConfig:
    return KernelConfig("dequant", 1, bn, bk, 1, warps, 1, ptx_decode=ptx)


def default_table() -> ConfigTable:
    """Per-M-bucket configs: the winners of the H200 sweep in bench/results/kernels-h200.json.

    Tuned per-layer entries (`...:n{N}:k{K}`) override them.
    """
    fwd = {
        1: _sk(1, 8, 512, ptx=True),
        2: _sk(2, 8, 256),
        4: _sk(4, 8, 128),
        8: _t(16, 64, 128, 4, 4, split=4, ptx=True),
        16: _t(16, 64, 128, 4, 4, split=4, ptx=True),
        32: _t(32, 128, 128, 4, 4),
        64: _dq(),
        128: _dq(),
        256: _dq(),
        512: _dq(),
        1024: _dq(),
    }
    # From M = 64 the decoded weight is reused by enough rows that one decode pass plus cuBLAS
    # beats re-decoding it in every output tile (except on the widest layers at M = 64).
    dx = {m: _t(max(m, 16), 64, 128, 4, 3, ptx=True) if m < 64 else _dq(ptx=m == 64)
          for m in M_BUCKETS}
    table: ConfigTable = {}
    for fmt in ("nvfp4", "nf4"):
        for m, cfg in fwd.items():
            table[f"fwd:{fmt}:m{m}"] = cfg
        for m, cfg in dx.items():
            table[f"dx:{fmt}:m{m}"] = cfg
    return table


_ACTIVE: ConfigTable = default_table()


def set_table(table: ConfigTable) -> None:
    """Use `table` (merged over the defaults) for every later call."""
    global _ACTIVE
    _ACTIVE = {**default_table(), **table}


def get_config(op: str, fmt: str, m: int, n: int, k: int) -> KernelConfig:
    """The config for one call: the layer-specific entry if tuned, else the bucket's."""
    return _ACTIVE.get(table_key(op, fmt, m, n, k)) or _ACTIVE[table_key(op, fmt, m)]


def table_to_json(table: ConfigTable) -> dict[str, dict[str, int | str]]:
    return {key: asdict(cfg) for key, cfg in sorted(table.items())}


def table_from_json(data: dict[str, dict[str, int | str]]) -> ConfigTable:
    return {key: KernelConfig(**cfg) for key, cfg in data.items()}  # type: ignore[arg-type]
