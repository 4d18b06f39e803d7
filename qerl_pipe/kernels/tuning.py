"""Timing and checking a kernel on the GPU as the dispatch measurement and the benchmarks do:
L2-cold weight copies (`weight_copies`), one CUDA graph of the calls (`time_graph`), the error
to an fp32 product (`rel_err`). See docs/kernels.md, section "The dispatch" ("How a row is measured")."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch
from torch import Tensor

L2_BYTES = 60 * 2**20
REPS = 25
MAX_COPIES = 32


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
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
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
