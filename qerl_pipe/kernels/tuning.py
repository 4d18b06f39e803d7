"""Kernel tuning: the fastest correct launch config per (layer shape, M bucket, op) on this GPU.

Every candidate is checked against fp32 before it is timed (L2-cold CUDA graphs); used by
build-engine (`tune_kernels`) and `bench kernels`; needs only torch. See docs/kernels.md, section
"Benchmark (Triton, `qerl-pipe bench kernels`)"."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict

import torch
from torch import Tensor

from qerl_pipe.errors import QerlError
from qerl_pipe.kernels.base_formats import FORMATS, base_format
from qerl_pipe.kernels.configs import ConfigTable, KernelConfig, _dq, _gv, _sk, _t, m_bucket, table_key
from qerl_pipe.kernels.packing import PackedNF4, PackedNVFP4

L2_BYTES = 60 * 2**20
REPS = 25
MAX_REL_ERR = 1e-2
MAX_COPIES = 32
# The base formats with Triton kernels to tune (nvfp4, nf4).
TUNED = tuple(name for name, f in FORMATS.items() if f.kernels is not None and f.kernels.triton_layout is not None)

# run(config, copy index) -> output; a timer turns a list of calls into seconds per call.
Run = Callable[[KernelConfig, int], Tensor]
Timer = Callable[[list[Callable[[], object]]], float]
TuneResult = tuple[KernelConfig | None, float, float, list[dict]]


# Candidates per M range (forward): the v2 H200 sweep's winners and runners-up, each also with
# the inline-PTX NVFP4 decode (`ptx=True`). `_dq` = decode once to scratch, then cuBLAS.
FWD_CANDIDATES: dict[int, list[KernelConfig]] = {
    1: [_sk(1, 8, 512), _sk(1, 8, 512, ptx=True), _gv(1, 8, 1024), _gv(1, 8, 1024, ptx=True),
        _gv(1, 8, 1024, split=4), _gv(1, 8, 1024, split=4, ptx=True), _sk(1, 16, 256, split=4),
        _t(16, 64, 128, 4, 4), _t(16, 64, 128, 4, 4, ptx=True),
        _t(16, 64, 128, 4, 4, split=2, ptx=True), _t(16, 32, 256, 4, 3, ptx=True)],
    8: [_t(16, 64, 128, 4, 4), _t(16, 64, 128, 4, 4, ptx=True), _t(16, 32, 128, 4, 4),
        _t(16, 32, 128, 4, 4, ptx=True), _t(16, 64, 128, 4, 4, split=4),
        _t(16, 64, 128, 4, 4, split=4, ptx=True), _t(16, 64, 256, 4, 3, ptx=True),
        _t(16, 128, 128, 4, 4, ptx=True)],
    64: [_t(64, 128, 64, 4, 4), _t(64, 128, 64, 4, 4, ptx=True), _t(64, 64, 128, 4, 4, ptx=True),
         _t(32, 128, 128, 4, 4, ptx=True), _t(64, 128, 128, 4, 3, ptx=True), _dq(),
         _dq(ptx=True), _dq(16, 512, ptx=True)],
    256: [_t(128, 128, 64, 8, 4, ptx=True), _dq(), _dq(16, 512), _dq(ptx=True),
          _dq(16, 512, ptx=True), _dq(64, 128, 8, ptx=True)],
    # v1 sweep: the tl.dot GEMM's best at M >= 1024 was 0.20-0.36x of cuBLAS; v2: 0.78-0.90x
    # with `_dq`, where the decode pass already streams at 3.3-3.7 TB/s.
    1024: [_dq(), _dq(16, 512), _dq(ptx=True), _dq(16, 512, ptx=True)],
}
# dX at training sizes: block_n is the contracted tile, block_k the output tile.
DX_CANDIDATES: list[KernelConfig] = [_dq(), _dq(ptx=True), _dq(16, 512), _dq(16, 512, ptx=True)]


def fwd_candidates(m: int) -> list[KernelConfig]:
    """Forward (x @ W^T) configs worth timing at M = m."""
    for bound, cands in ((1, FWD_CANDIDATES[1]), (16, FWD_CANDIDATES[8]), (64, FWD_CANDIDATES[64]),
                         (256, FWD_CANDIDATES[256])):
        if m <= bound:
            return cands
    return FWD_CANDIDATES[1024]


def dx_candidates(m: int) -> list[KernelConfig]:
    """dX (dy @ W) configs worth timing at M = m: training's large M gets several, a smaller M one
    sensible tile, with and without the PTX decode."""
    if m >= 1024:
        return DX_CANDIDATES
    if m >= 128:
        return DX_CANDIDATES[:2]
    bm = max(16, min(64, 1 << (m - 1).bit_length()))
    return [_t(bm, 64, 128, 4, 3), _t(bm, 64, 128, 4, 3, ptx=True)] + ([_dq(ptx=True)] if m >= 64 else [])


def time_graph(calls: list[Callable[[], object]], reps: int = REPS) -> float:
    """Seconds per call: median over CUDA-graph replays of all `calls` in sequence."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as graph capture requires
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(reps)]
    for a, b in pairs:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    del graph
    return statistics.median(a.elapsed_time(b) for a, b in pairs) * 1e-3 / len(calls)


def weight_copies(nbytes: int) -> int:
    """How many copies of an `nbytes` weight to cycle through so that L2 never holds it warm."""
    return max(1, min(MAX_COPIES, math.ceil(4 * L2_BYTES / nbytes)))


def rel_err(out: Tensor, ref: Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp32; inf when `out` has a NaN or inf."""
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return float((out.float() - ref).norm() / ref.norm())


def tune_one(run: Run, ref: Tensor, cands: list[KernelConfig], copies: int,
             timer: Timer = time_graph) -> TuneResult:
    """Best (config, seconds, rel err) of `cands` and a log of every try: each is checked before it
    is timed, one that fails to compile or is wrong logged and skipped (None when none survived)."""
    best: tuple[KernelConfig | None, float, float] = (None, math.inf, math.inf)
    log = []
    for cfg in cands:
        try:
            err = rel_err(run(cfg, 0), ref)
            if err >= MAX_REL_ERR:
                log.append({"config": asdict(cfg), "rel_err": err, "error": "wrong result"})
                continue
            t = timer([lambda i=i, cfg=cfg: run(cfg, i) for i in range(copies)])
        except Exception as e:  # noqa: BLE001 - a config that fails to compile is recorded
            log.append({"config": asdict(cfg), "error": repr(e)[:300]})
            continue
        log.append({"config": asdict(cfg), "rel_err": err, "us": t * 1e6})
        if t < best[1]:
            best = (cfg, t, err)
    return best[0], best[1], best[2], log


def _random_weight(n: int, k: int, fmt: str, device: torch.device,
                   gen: torch.Generator) -> tuple[list[PackedNVFP4 | PackedNF4], Tensor]:
    """Kernel-layout copies of one random [n, k] weight and its dequantized fp32 form: timing needs
    only the shape, so tuning runs before or without the model's weights."""
    spec = base_format(fmt)
    w = torch.randn(n, k, device=device, generator=gen) * 0.02
    q = spec.quantize(w, f"tune {n}x{k}", torch.float32)
    del w
    dense = spec.dequantize(q, torch.float32)
    copies = weight_copies(int(n * k * spec.bytes_per_weight))  # codes and scales
    return [spec.kernels.triton_layout(q) for _ in range(copies)], dense


def _representative_ms(ms: Iterable[int]) -> dict[int, int]:
    """M bucket -> the largest requested M in it: one table entry per bucket, timed at that M."""
    out: dict[int, int] = {}
    for m in ms:
        if m < 1:
            raise ValueError(f"M must be at least 1, got {m}")
        b = m_bucket(m)
        out[b] = max(out.get(b, 0), m)
    return dict(sorted(out.items()))


Launch = Callable[[Tensor, object, KernelConfig], Tensor]


def _tune_shape(n: int, k: int, ms: list[int], dx_ms: list[int], fmt: str, device: torch.device,
                launch_fwd: Launch, launch_dx: Launch, timer: Timer) -> ConfigTable:
    """Table entries of one (N, K): the forward and dX winners at each M (a function of its own,
    so the weight copies and references are freed when it returns)."""
    gen = torch.Generator(device=device).manual_seed(n * 31 + k)
    weights, dense = _random_weight(n, k, fmt, device, gen)
    table: ConfigTable = {}
    for m in sorted(set(ms) | set(dx_ms)):
        x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        dy = torch.randn(m, n, device=device, generator=gen).to(torch.bfloat16)
        jobs = [("fwd", lambda c, i: launch_fwd(x, weights[i], c), x.float() @ dense.T, fwd_candidates(m))] if m in ms else []
        if m in dx_ms:
            jobs.append(("dx", lambda c, i: launch_dx(dy, weights[i], c), dy.float() @ dense, dx_candidates(m)))
        for op, run, ref, cands in jobs:
            cfg, _, _, log = tune_one(run, ref, cands, len(weights), timer)
            if cfg is None:
                first = log[0].get("error") if log else "no candidates"
                raise QerlError(
                    f"no {fmt} {op} kernel config gave a correct result for N={n} K={k} M={m} "
                    f"(first failure: {first}); build the engine with tune_kernels: off"
                )
            table[table_key(op, fmt, m, n, k)] = cfg
    return table


def _tune_table(shapes: list[tuple[int, int]], ms: list[int], fmt: str, device: torch.device,
                launch_fwd: Launch, launch_dx: Launch, timer: Timer, dx_ms: list[int] | None = None) -> ConfigTable:
    """The loop of `tune_kernels` with the launches and the timer passed in (CPU tests fake them)."""
    if fmt not in TUNED:
        raise ValueError(f"fmt must be one of {TUNED}, got {fmt!r}")
    buckets = list(_representative_ms(ms).values())
    dx_buckets = buckets if dx_ms is None else list(_representative_ms(dx_ms).values())
    table: ConfigTable = {}
    for n, k in dict.fromkeys(shapes):  # distinct shapes, in order
        table.update(_tune_shape(n, k, buckets, dx_buckets, fmt, device, launch_fwd, launch_dx, timer))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return table


def tune_kernels(shapes: list[tuple[int, int]], ms: list[int], fmt: str,
                 device: torch.device | str, dx_ms: list[int] | None = None) -> ConfigTable:
    """Per-layer configs for `fmt` ('nvfp4' or 'nf4') on this CUDA GPU: for each fused-linear (N, K)
    in `shapes` and M bucket of `ms` (timed at its largest M), the fastest correct forward candidate,
    and dX's at `dx_ms` (default `ms`); keys `{op}:{fmt}:m{bucket}:n{N}:k{K}` (`set_table`)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise QerlError(f"kernel tuning times Triton kernels on a CUDA GPU; device {device} is not one")
    from qerl_pipe.kernels.triton_matmul import launch_dx, launch_forward

    return _tune_table(list(shapes), list(ms), fmt, device,
                       lambda x, w, c: launch_forward(x, w, c),
                       lambda dy, w, c: launch_dx(dy, w, c), time_graph, dx_ms)
