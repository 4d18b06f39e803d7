"""Build, load and call the CUDA W4A16 kernels (`kernels/cuda/`), as torch custom ops.

The sources are compiled on first use with torch's extension toolchain (nvcc + ninja) for
`sm_90a`, into a cache directory named by a hash of the sources, the generated layout header, the
flags and the torch / CUDA versions, so a second process loads the built module in milliseconds.
`available(device)` says whether they can run there: a Hopper GPU, nvcc present, the build
succeeded, and `QERL_CUDA_KERNELS` is not `0`. When not, it logs one line saying why and the
callers keep the Triton path.

The ops are registered as `qerl::w4a16_gemm` and `qerl::w4a16_dequant` with fake (meta)
implementations, so they trace under `torch.compile` and record into CUDA graphs. Split-K uses a
per-device counter buffer that every launch leaves zeroed; launches that split K must therefore
not run concurrently on two streams of one device (the engine and trainer use one stream).
"""

import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from qerl_pipe.kernels import tiled

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "cuda"
SOURCES = ("w4a16.cuh", "w4a16.cu", "binding.cpp")
CUDA_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas=-v")
# Split-K tickets: one int per CTA column slice; 64k covers N up to 4M rows at 64 rows per CTA.
_COUNTERS = 1 << 16
# Most tokens one GEMM pass takes (8 n8 blocks); larger M runs in several passes.
MAX_PASS_TOKENS = 64


@dataclass(frozen=True)
class GemmConfig:
    """A compiled decode-GEMM variant (see `QERL_W4A16_CONFIGS` in w4a16.cu) and its K splits."""

    mt: int  # m16 tiles of weight rows per warp (2 or 4)
    nb: int  # n8 blocks of tokens per pass (1, 2, 4 or 8)
    warps: int
    depth: int  # chunks of loads in flight per warp
    splits: int


# Must match QERL_W4A16_CONFIGS in w4a16.cu (a CPU test checks it).
COMPILED: tuple[tuple[int, int, int, int], ...] = (
    (4, 1, 4, 4), (4, 1, 8, 4), (4, 1, 4, 8), (4, 2, 4, 4), (4, 2, 8, 4), (4, 4, 4, 2),
    (4, 4, 8, 2), (2, 1, 8, 4), (2, 2, 8, 4), (2, 4, 8, 2), (2, 8, 4, 2), (2, 8, 8, 2),
)


def source_hash() -> str:
    """Hash of everything that makes the built module: sources, header, flags, versions."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((SOURCE_DIR / name).read_bytes())
    h.update(tiled.constants_header().encode())
    h.update(" ".join(CUDA_FLAGS).encode())
    h.update(f"{torch.__version__} {torch.version.cuda}".encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    root = os.environ.get("QERL_KERNEL_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qerl-pipe"
    return Path(root) / "kernels"


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
    build = cache_dir() / digest
    src = write_build_tree(build / "src")
    start = time.perf_counter()
    module = load(
        name=f"qerl_w4a16_{digest}",
        sources=[str(src / "binding.cpp"), str(src / "w4a16.cu")],
        extra_include_paths=[str(src)],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=list(CUDA_FLAGS),
        build_directory=str(build),
        verbose=False,
    )
    log.info("CUDA W4A16 kernels ready in %.1f s (%s)", time.perf_counter() - start, build)
    return module


def _why_unavailable(device: torch.device) -> str | None:
    if os.environ.get("QERL_CUDA_KERNELS", "1") == "0":
        return "QERL_CUDA_KERNELS=0"
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}, the kernels are built for sm_90a (Hopper)"
    from torch.utils.cpp_extension import CUDA_HOME

    if shutil.which("nvcc") is None and not (CUDA_HOME and Path(CUDA_HOME, "bin", "nvcc").exists()):
        return "nvcc not found (install the CUDA toolkit or set CUDA_HOME)"
    try:
        _module()
    except Exception as exc:  # a failed build must leave the Triton path working
        return f"the build failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
    return None


@lru_cache(maxsize=None)
def _available(device: torch.device) -> bool:
    why = _why_unavailable(device)
    if why is not None:
        if device.type == "cuda":
            log.warning("CUDA W4A16 kernels off on %s (%s); using the Triton kernels", device, why)
        return False
    return True


def available(device: torch.device | str) -> bool:
    """Whether the CUDA kernels run on `device` (built on the first call; logged once if not)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _available(device)


@lru_cache(maxsize=None)
def _counters(device: torch.device) -> Tensor:
    return torch.zeros(_COUNTERS, dtype=torch.int32, device=device)


def counters(device: torch.device) -> Tensor:
    """The split-K ticket buffer of `device`. Allocate it before capturing CUDA graphs."""
    return _counters(torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device()))


def default_config(m: int, n: int, k: int, sms: int) -> GemmConfig:
    """The launch config for an `[m, k] x [n, k]^T` product: tokens per pass from m, then enough
    K splits that about 16 warps per SM stream weights (bytes in flight, Little's law)."""
    tokens = min(m, MAX_PASS_TOKENS)
    nb = 1 if tokens <= 8 else 2 if tokens <= 16 else 4 if tokens <= 32 else 8
    mt, warps, depth = {1: (4, 4, 4), 2: (4, 4, 4), 4: (4, 4, 2), 8: (2, 8, 2)}[nb]
    warp_tiles = -(-n // (16 * mt))
    chunks = -(-k // tiled.COLS)
    splits = max(1, min(round(16 * sms / warp_tiles), chunks // 4))
    return GemmConfig(mt, nb, warps, depth, splits)


@torch.library.custom_op("qerl::w4a16_gemm", mutates_args=())
def _gemm_op(x: Tensor, qweight: Tensor, scales: Tensor, global_scale: Tensor, bias: Optional[Tensor],
             n: int, k: int, mt: int, nb: int, warps: int, depth: int, splits: int) -> Tensor:
    return _module().gemm(x, qweight, scales, global_scale, bias, n, k, mt, nb, warps, depth, splits,
                          counters(x.device))


@_gemm_op.register_fake
def _(x, qweight, scales, global_scale, bias, n, k, mt, nb, warps, depth, splits):
    return x.new_empty(x.shape[0], n)


@torch.library.custom_op("qerl::w4a16_dequant", mutates_args=())
def _dequant_op(qweight: Tensor, scales: Tensor, global_scale: Tensor, n: int, k: int) -> Tensor:
    return _module().dequant(qweight, scales, global_scale, n, k)


@_dequant_op.register_fake
def _(qweight, scales, global_scale, n, k):
    return qweight.new_empty(n, k, dtype=torch.bfloat16)


def gemm(x: Tensor, w: tiled.TiledNVFP4, bias: Tensor | None = None, config: GemmConfig | None = None) -> Tensor:
    """`x @ W^T (+ bias)` for bf16 `x [M, K]`, M <= 64 per pass (more runs as several passes)."""
    m = x.shape[0]
    if config is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        config = default_config(m, w.out_features, w.in_features, sms)
    return _gemm_op(x, w.qweight, w.scales, w.global_scale, bias, w.out_features, w.in_features,
                    config.mt, config.nb, config.warps, config.depth, config.splits)


def dequantize(w: tiled.TiledNVFP4) -> Tensor:
    """W as bf16 `[N, K]`: each value rounded once, at full memory bandwidth."""
    return _dequant_op(w.qweight, w.scales, w.global_scale, w.out_features, w.in_features)
