"""Build, load and call the CUDA W4A16 kernels (`kernels/cuda/`), as torch custom ops. Built on first use for
`sm_90a`, cached by a hash of its inputs; `available(device)` says whether they run there (if not, NVFP4 runs
dequantize + cuBLAS). Split-K launches must not run at once on two streams of one device. See docs/kernels.md,
section "The CUDA W4A16 kernels"."""

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from qerl_pipe.kernels import tiled
from qerl_pipe.kernels.optional_backend import availability

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "cuda"
SOURCES = ("w4a16.cuh", "w4a16.cu", "binding.cpp")
CUDA_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas=-v")
# Split-K tickets: one int per CTA column slice; 64k covers N up to 4M rows at 64 rows per CTA.
_COUNTERS = 1 << 16
# Most tokens one pass of the mma.sync kernels takes (8 n8 blocks; the wgmma kernel takes up to
# 256); larger M runs in several passes. Up to this M the GEMM always beats dequantize + cuBLAS.
MAX_PASS_TOKENS = 64


@dataclass(frozen=True)
class GemmConfig:
    """A compiled decode-GEMM variant (see `QERL_W4A16_CONFIGS` in w4a16.cu) and its K splits."""

    mt: int  # m16 tiles of weight rows per warp (2 or 4; 1: the wgmma kernel, a warpgroup per 64 rows)
    nb: int  # n8 blocks of tokens per pass (1, 2, 4 or 8; the wgmma kernel 8, 16 or 32)
    warps: int  # per CTA
    wk: int  # warps that share a warp tile, splitting its K chunks (summed in shared memory)
    depth: int  # chunks of loads in flight per warp
    splits: int  # K splits across CTAs (summed in a workspace by the last CTA)
    # Programmatic dependent launch: the first weight chunks stream while the previous kernel
    # finishes (x and every write wait for it).
    pdl: bool = True
    # 0 with mt 2 or 4: the register-ring kernel; with mt = 1, the depth of the wgmma kernel's
    # shared-memory pipeline (weights and activations copied with cp.async).
    stages: int = 0


# Register-ring kernel (mt, nb, warps along N, warps along K, depth) and wgmma kernel (64-token
# blocks per pass, warpgroups per CTA, stages): must match QERL_W4A16_CONFIGS and QERL_W4A16_WGMMA
# in w4a16.cu (a CPU test checks it). Only variants that a row of the shipped table or `_VARIANT`
# launches are compiled (a CPU test checks that too): a variant no row picks is dead code.
COMPILED: tuple[tuple[int, int, int, int, int], ...] = (
    (4, 1, 4, 1, 4), (4, 1, 1, 4, 4), (4, 1, 2, 2, 4), (2, 1, 1, 8, 4), (4, 2, 1, 4, 4),
    (2, 2, 8, 1, 4), (2, 2, 1, 8, 4), (4, 4, 1, 4, 2), (2, 4, 8, 1, 2), (2, 8, 1, 4, 2),
)
WGMMA: tuple[tuple[int, int, int], ...] = (
    (1, 1, 4), (1, 1, 6), (1, 2, 4), (1, 2, 6), (2, 1, 4), (2, 2, 6), (4, 2, 4), (4, 2, 5),
)
# The grouped kernel's variants (as COMPILED; QERL_W4A16_GROUPED): `_VARIANT`'s and other 8-token passes.
GROUPED: tuple[tuple[int, int, int, int, int], ...] = (
    (2, 1, 1, 8, 4), (2, 2, 1, 8, 4), (4, 4, 1, 4, 2), (2, 8, 1, 4, 2), (2, 1, 8, 1, 4), (4, 1, 1, 8, 4),
)


def compiled_configs(splits: int = 1) -> list[GemmConfig]:
    """Every compiled variant as a GemmConfig with `splits`."""
    return ([GemmConfig(mt, nb, wn * wk, wk, depth, splits) for mt, nb, wn, wk, depth in COMPILED]
            + [GemmConfig(1, 8 * blocks, 4 * wg, 1, 0, splits, stages=st) for blocks, wg, st in WGMMA])


def source_hash() -> str:
    """Hash of everything that makes the built module: sources, header, flags, versions."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((SOURCE_DIR / name).read_bytes())
    h.update(tiled.constants_header().encode())
    h.update(" ".join(CUDA_FLAGS).encode())
    h.update(f"{torch.__version__} {torch.version.cuda}".encode())
    return h.hexdigest()[:16]


def write_build_tree(directory: Path) -> Path:
    """The sources plus the generated layout header in `directory` (what nvcc compiles)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        shutil.copyfile(SOURCE_DIR / name, directory / name)
    (directory / "w4a16_layout.h").write_text(tiled.constants_header())
    return directory


@lru_cache(maxsize=1)
def _module() -> ModuleType:
    from torch.utils.cpp_extension import load

    digest = source_hash()
    cache = os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")
    build = Path(os.environ.get("QERL_KERNEL_CACHE") or Path(cache) / "qerl-pipe") / "kernels" / digest
    src = write_build_tree(build / "src")
    start = time.perf_counter()
    module = load(name=f"qerl_w4a16_{digest}", sources=[str(src / "binding.cpp"), str(src / "w4a16.cu")],
                  extra_include_paths=[str(src)], extra_cflags=["-O3", "-std=c++17"],
                  extra_cuda_cflags=list(CUDA_FLAGS), build_directory=str(build), verbose=False)
    log.info("CUDA W4A16 kernels ready in %.1f s (%s)", time.perf_counter() - start, build)
    return module


def why_unavailable(device: torch.device | str) -> str | None:
    """Why the CUDA kernels cannot run on `device` (None when they can; builds them on first call)."""
    device = torch.device(device)
    if os.environ.get("QERL_CUDA_KERNELS", "1") == "0":
        return "QERL_CUDA_KERNELS=0"
    if not torch.cuda.is_available():
        return "no CUDA GPU here"
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}, the kernels are built for sm_90a (Hopper)"
    from torch.utils.cpp_extension import CUDA_HOME

    if shutil.which("nvcc") is None and not (CUDA_HOME and Path(CUDA_HOME, "bin", "nvcc").exists()):
        return "nvcc not found (install the CUDA toolkit or set CUDA_HOME)"
    try:
        _module()
    except Exception as exc:  # a failed build must leave dequantize + cuBLAS working
        return f"the build failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
    return None


_available_on_gpu = availability(why_unavailable, "CUDA W4A16 kernels", "NVFP4 runs dequantize + cuBLAS")


def available(device: torch.device | str) -> bool:
    """Whether the CUDA kernels run on `device` (built on the first call; logged once if not)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and _available_on_gpu(device)


@lru_cache(maxsize=None)
def _counters(device: torch.device) -> Tensor:
    return torch.zeros(_COUNTERS, dtype=torch.int32, device=device)


def counters(device: torch.device) -> Tensor:
    """The split-K ticket buffer of `device`. Allocate it before capturing CUDA graphs."""
    return _counters(torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device()))


@lru_cache(maxsize=None)
def blocks_per_sm(config: GemmConfig) -> int:
    """CTAs of a compiled GEMM variant that one SM holds at once (its registers decide)."""
    return int(_module().blocks_per_sm(config.mt, config.nb, config.warps, config.wk, config.depth, config.stages))


# A model of a launch, for choosing K splits (fitted by eye to the H200 sweeps in
# bench/results/kernels-cuda-h200.json; the benchmark also times the neighbours of its pick):
# HBM streams BYTES_PER_US once WARPS_FOR_BANDWIDTH warps per SM have loads in flight (fewer warps
# get a proportional share); a warp takes CHUNK_US per chunk plus FIXED_CHUNKS chunks of start-up
# and epilogue; the last CTA of a split column re-reads every split's sums at REDUCE_BYTES_PER_US.
BYTES_PER_US = 3.5e6
WARPS_FOR_BANDWIDTH = 16
CHUNK_US = 0.25
FIXED_CHUNKS = 2
REDUCE_BYTES_PER_US = 5e4


def choose_splits(m: int, n: int, k: int, config: GemmConfig, sms: int, per_sm: int) -> int:
    """K splits across CTAs that should finish soonest under the model above: more splits give
    more warps in flight and shorter CTAs, and cost M x N x 8 bytes each (fp32 sums written and
    read back) plus a longer final reduction, which is why the pick shrinks as M grows."""
    cta_rows = 16 * config.mt * config.warps // config.wk
    columns = -(-n // cta_rows)
    chunks = -(-k // tiled.COLS)
    passes = -(-m // (8 * config.nb))
    tokens = min(m, 8 * config.nb)
    slots = sms * max(1, per_sm)

    def cost(s: int) -> float:
        ctas = columns * s * passes
        resident_warps = min(ctas, slots) * config.warps
        bandwidth = BYTES_PER_US * min(1.0, resident_warps / (WARPS_FOR_BANDWIDTH * sms))
        traffic = n * k * (0.5 + 1 / 16) * passes + (2 * s * m * n * 4 if s > 1 else 0)
        waves = -(-ctas // slots)
        compute = waves * (-(-chunks // (s * config.wk)) + FIXED_CHUNKS) * CHUNK_US
        tail = s * tokens * cta_rows * 4 / REDUCE_BYTES_PER_US if s > 1 else 0.0
        return max(traffic / bandwidth, compute) + tail

    return min(range(1, max(1, chunks // 4) + 1), key=lambda s: (cost(s), s))


# The variant for each tokens-per-pass count (n8 blocks), for shapes the table below lacks:
# (mt, warps, wk, depth) of the register-ring kernel, the most frequent winner per M in the H200 sweep.
_VARIANT = {1: (2, 8, 8, 4), 2: (2, 8, 8, 4), 4: (4, 4, 4, 2), 8: (2, 4, 4, 2)}
# Measured best configs per (M, N, K) on a 132-SM H200, used on GPUs with that many SMs; rows of M = 128 and
# 256 only where the GEMM beat dequantize + cuBLAS (a row there is what sends those M to it: `gemm_wins`).
# QERL_W4A16_TABLE names another file of the same form. docs/kernels.md, "Which config".
TABLE_FILE = SOURCE_DIR / "configs-h200.json"
TABLE_MS = (1, 8, 16, 32, 64, 128, 256)


def table_key(m: int, n: int, k: int) -> str:
    """The row serving M tokens: the smallest measured M at or above it (the largest for more: any M runs)."""
    return f"m{next((t for t in TABLE_MS if t >= m), TABLE_MS[-1])}:n{n}:k{k}"


def table_path() -> Path:
    """The config table in use: QERL_W4A16_TABLE, else the shipped one (read once per process)."""
    return Path(os.environ.get("QERL_W4A16_TABLE") or TABLE_FILE)


@lru_cache(maxsize=1)
def _table() -> tuple[int, dict]:
    path = table_path()
    try:
        data = json.loads(path.read_text())
        sms, configs = int(data["sms"]), data["configs"]
        for key, config in configs.items():
            try:
                check_config(GemmConfig(**config))
            except (TypeError, ValueError) as e:
                raise ValueError(f"row {key}: {e}") from e
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"the W4A16 config table {path} is unusable ({type(e).__name__}: {e}); it needs "
                           "\"sms\" and \"configs\" of compiled configs (as kernels/cuda/configs-h200.json); fix "
                           "or unset QERL_W4A16_TABLE") from e
    return sms, configs


def default_config(m: int, n: int, k: int, sms: int, per_sm: int | None = None) -> GemmConfig:
    """The launch config for an `[m, k] x [n, k]^T` product: the measured best for this shape when the GPU
    matches the table's, else the usual variant for m's tokens per pass with the K splits of `choose_splits`."""
    table_sms, configs = _table()
    hit = configs.get(table_key(m, n, k)) if sms == table_sms else None
    if hit is not None:
        return GemmConfig(**hit)
    tokens = min(m, MAX_PASS_TOKENS)
    nb = 1 if tokens <= 8 else 2 if tokens <= 16 else 4 if tokens <= 32 else 8
    mt, warps, wk, depth = _VARIANT[nb]
    config = GemmConfig(mt, nb, warps, wk, depth, 1)
    per_sm = per_sm if per_sm is not None else blocks_per_sm(config)
    return replace(config, splits=choose_splits(m, n, k, config, sms, per_sm))


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (looked up once: linears ask on every call)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def gemm_wins(m: int, n: int, k: int, sms: int) -> bool:
    """Whether `[m, k] x [n, k]^T` runs as the decode GEMM rather than dequantize + cuBLAS: always up to
    MAX_PASS_TOKENS rows; up to 256 where the measured table (same SM count) has the shape's row; never above."""
    if m <= MAX_PASS_TOKENS:
        return True
    if m > TABLE_MS[-1]:
        return False
    table_sms, configs = _table()
    return sms == table_sms and table_key(m, n, k) in configs


@torch.library.custom_op("qerl::w4a16_gemm", mutates_args=())
def _gemm_op(x: Tensor, qweight: Tensor, scales: Tensor, global_scale: Tensor, bias: Optional[Tensor],
             n: int, k: int, mt: int, nb: int, warps: int, wk: int, depth: int, splits: int,
             pdl: bool, stages: int, lora_u: Optional[Tensor] = None, lora_b: Optional[Tensor] = None) -> Tensor:
    return _module().gemm(x, qweight, scales, global_scale, bias, n, k, mt, nb, warps, wk, depth, splits, pdl,
                          stages, counters(x.device), lora_u, lora_b)


@_gemm_op.register_fake
def _(x, qweight, scales, global_scale, bias, n, k, mt, nb, warps, wk, depth, splits, pdl, stages, lora_u=None,
      lora_b=None):
    return x.new_empty(x.shape[0], n)


@torch.library.custom_op("qerl::w4a16_grouped_gemm", mutates_args=())
def _grouped_op(x: Tensor, qweight: Tensor, scales: Tensor, global_scale: Tensor, offsets: Tensor,
                active: Optional[Tensor], slots: int, n: int, k: int, max_rows: int, mt: int, nb: int, warps: int,
                wk: int, depth: int) -> Tensor:
    return _module().grouped_gemm(x, qweight, scales, global_scale, offsets, active, slots, n, k, max_rows, mt, nb,
                                  warps, wk, depth, counters(x.device))


@_grouped_op.register_fake
def _(x, qweight, scales, global_scale, offsets, active, slots, n, k, max_rows, mt, nb, warps, wk, depth):
    return x.new_empty(x.shape[0], n)


@torch.library.custom_op("qerl::w4a16_dequant", mutates_args=())
def _dequant_op(qweight: Tensor, scales: Tensor, global_scale: Tensor, n: int, k: int) -> Tensor:
    return _module().dequant(qweight, scales, global_scale, n, k)


@_dequant_op.register_fake
def _(qweight, scales, global_scale, n, k):
    return qweight.new_empty(n, k, dtype=torch.bfloat16)


@lru_cache(maxsize=1)
def _compiled() -> frozenset[GemmConfig]:
    return frozenset(compiled_configs())


def check_config(config: GemmConfig) -> None:
    """Raise ValueError unless `config` names a compiled variant with at least one K split."""
    if replace(config, splits=1, pdl=True) not in _compiled():
        raise ValueError(f"{config} is not a compiled GEMM variant; choose one of cuda_ext.compiled_configs()")
    if config.splits < 1:
        raise ValueError(f"{config} has splits < 1")


# The stacked LoRA rank the GEMM's epilogue takes is a multiple of this (its k16 MMA steps).
LORA_RANK_MULTIPLE = 16


def gemm(x: Tensor, w: tiled.TiledNVFP4, bias: Tensor | None = None, config: GemmConfig | None = None,
         lora: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """`x @ W^T (+ bias) (+ u @ B^T)` for bf16 `x [M, K]`, in passes of the config's tokens (8 * nb). `lora` =
    (u [M, R], B [N, R]), bf16, R a multiple of LORA_RANK_MULTIPLE: the expand runs as more MMAs in the
    epilogue, added in fp32 before the output's one rounding."""
    m = x.shape[0]
    if config is None:
        config = default_config(m, w.out_features, w.in_features, sm_count(x.device))
    else:
        check_config(config)
    u, b = (None, None) if lora is None else lora
    if b is not None and (b.dim() != 2 or b.shape[0] != w.out_features or b.shape[1] % LORA_RANK_MULTIPLE
                          or u.dim() != 2 or tuple(u.shape) != (m, b.shape[1])):
        raise ValueError(f"lora needs u [{m}, R] and B [{w.out_features}, R] with R a multiple of "
                         f"{LORA_RANK_MULTIPLE}; got u {tuple(u.shape)} and B {tuple(b.shape)}")
    return _gemm_op(x, w.qweight, w.scales, w.global_scale, bias, w.out_features, w.in_features,
                    config.mt, config.nb, config.warps, config.wk, config.depth, config.splits, config.pdl,
                    config.stages, u, b)


def dequantize(w: tiled.TiledNVFP4) -> Tensor:
    """W as bf16 `[N, K]`: each value rounded once, at full memory bandwidth."""
    return _dequant_op(w.qweight, w.scales, w.global_scale, w.out_features, w.in_features)


def grouped_configs() -> list[GemmConfig]:
    """Every compiled variant of the grouped kernel."""
    return [GemmConfig(mt, nb, wn * wk, wk, depth, 1, pdl=False) for mt, nb, wn, wk, depth in GROUPED]


def grouped_config(max_rows: int) -> GemmConfig:
    """The grouped GEMM's launch config for up to `max_rows` rows per weight: the usual register-ring variant
    for that many tokens per pass, so up to MAX_PASS_TOKENS rows take one pass (its CTAs take 32 or 64 rows,
    which divide any stacked weight's 64-row blocks), one K split, no PDL (the kernel reads the offsets first).
    A smaller pass (`config=`) runs more of them in the grid's z dimension, CTAs past their rows exit at once."""
    tokens = min(max(max_rows, 1), MAX_PASS_TOKENS)
    nb = 1 if tokens <= 8 else 2 if tokens <= 16 else 4 if tokens <= 32 else 8
    mt, warps, wk, depth = _VARIANT[nb]
    return GemmConfig(mt, nb, warps, wk, depth, 1, pdl=False)


def grouped_gemm(rows: Tensor, qweight: Tensor, scales: Tensor, global_scale: Tensor, offsets: Tensor,
                 out_features: int, in_features: int, max_rows: int, active: Tensor | None = None,
                 config: GemmConfig | None = None) -> Tensor:
    """E weights' `rows @ W_e^T` in one launch from their tiled NVFP4 stack; bf16 `rows` [R, K]
    sorted by weight, weight e's at offsets[e]:offsets[e + 1] (int64 [E + 1], trusted: read on the
    device), at most `max_rows` per weight; `active` (int32 [E], weights with rows first, then -1)
    bounds the grid. Deterministic (no split-K); `config` overrides `grouped_config` (probes)."""
    e = qweight.shape[0]
    config = grouped_config(max_rows) if config is None else config
    if config not in grouped_configs():
        raise ValueError(f"{config} is not a compiled grouped GEMM variant; choose one of cuda_ext.grouped_configs()")
    slots = e if active is None else max(1, min(e, rows.shape[0]))
    return _grouped_op(rows, qweight.reshape(-1, *qweight.shape[2:]), scales.reshape(-1, *scales.shape[2:]),
                       global_scale.reshape(-1), offsets, active, slots, out_features, in_features, max_rows,
                       config.mt, config.nb, config.warps, config.wk, config.depth)
