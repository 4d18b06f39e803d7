"""humming's stream-K schedule made run-to-run deterministic: the `humming-ordered` backend.

humming's stream-K (its default, the `humming-fast` backend) cuts each output tile's K loop into
slices run by different CTAs and sums them into the bf16 output. Its epilogue
(`epilogue/pipeline.cuh`, `gmem_writer.cuh`, humming 0.1.19) has two ways to meet:
- with the output stored by TMA, or a tile cut into more than 3 slices: slice 0 stores, the others
  add with atomics in whatever order they finish (the measured run-to-run differences);
- otherwise: a lock per tile admits the slices in slice order (0, 1, 2), each adding its fp32
  partial to what the one before stored: the same order, so the same bits, on every run.

So humming's own heuristic configs become deterministic by two changes: `use_tma_c: false`, and a
grid (`num_sms`) small enough that no tile gets more than 3 slices. `max_slices` is the scheduler's
arithmetic (`scheduler.cuh`: data-parallel whole tiles first, then the rest of the (tile, k-block)
space cut into equal runs of `total` k-blocks, one per CTA group, `total` at least (K-1)/9 blocks
and a multiple of the pipeline's stages); a run of `total` blocks can meet at most
ceil((KB - 1) / total) + 1 tiles' worth of a KB-block tile, so `total >= (KB - 1) / 2` bounds every
tile at 3 slices. Where no grid of the config's own shape meets that for an M interval, the
interval runs without stream-K (one CTA per tile: deterministic too).

Unlike the batch-invariant schedule (`humming`), a row's result may depend on the other rows (the
M interval picks the config): the deterministic column promises repeat, not batch invariance, the
same as our split-K GEMM and cuBLAS. The sums meet in bf16 (up to 3 roundings of the output).
Only SM 9.x: the scheduler's wave merging differs on other GPUs, which keep the other schedules.
"""

from __future__ import annotations

import math
from typing import Any

# Slices a tile may have before humming's epilogue switches to unordered atomic adds.
MAX_ORDERED_SLICES = 3
# Past this many rows the ordered grid is not searched (each M interval's row counts are checked
# one by one); bigger products run humming's tile config without stream-K. Decode and rollout
# prefill chunks stay below it; training's GEMMs go to dequantize + cuBLAS or the batch-invariant
# schedule in every measured table.
ORDERED_MAX_M = 1024
# The scheduler merges a last partial wave into stream-K when it fills at most 1/10 of the grid.
_MERGE_WAVE_DIVISOR = 10
_MAX_SLICES_BOUND = 10  # scheduler.cuh's kMaxSlices


def _stream_blocks(k_blocks: int, block_k: int, group_size: int) -> tuple[int, int]:
    """(kStreamKBlocks, kStreamKBlockAlignment) for a K of `k_blocks` blocks of `block_k`."""
    align = max(1, group_size // block_k)
    return math.ceil(k_blocks / align) * align, align


def max_slices(m_blocks: int, n_blocks: int, k_blocks: int, groups: int, stages: int,
               block_k: int = 128, group_size: int = 16) -> int:
    """The most K slices any output tile gets under humming's stream-K scheduler (SM 9.x) for an
    `m_blocks x n_blocks` tile grid with `k_blocks` K blocks per tile on `groups` CTA groups."""
    kb, align = _stream_blocks(k_blocks, block_k, group_size)
    mn = m_blocks * n_blocks
    streamed = mn
    if mn > groups:
        streamed = mn % groups
        if streamed and streamed * _MERGE_WAVE_DIVISOR <= groups:
            streamed += groups
    if streamed == 0:
        return 1
    total = max(math.ceil(streamed * kb / groups), math.ceil((kb - 1) / (_MAX_SLICES_BOUND - 1)))
    align_iters = align // math.gcd(align, stages) * stages
    total = align_iters * math.ceil(total / align_iters)
    return math.ceil((kb - 1) / total) + 1 if kb > 1 else 1


def _cluster(config: dict[str, Any]) -> tuple[int, int]:
    """(CTAs per group, of them along N) of a config: its multicast and UMMA pairing."""
    along_n = int(config.get("multi_cast_size_a", 1)) * int(config.get("umma_cta_group_size", 1))
    return along_n * int(config.get("multi_cast_size_b", 1)), along_n


def ordered_sms(config: dict[str, Any], n: int, k: int, lo: int, hi: int, sm_count: int) -> int | None:
    """The largest grid (`num_sms`) at most the config's own for which every M in (lo, hi] gets at
    most 3 slices per tile; None when none does."""
    block_m, block_n, block_k = config["block_shape"]
    cluster, along_n = _cluster(config)
    per_sm = int(config.get("num_ctas_per_sm", 1))
    n_blocks, k_blocks = n // block_n // along_n, k // block_k
    stages = int(config.get("num_stages", 2))
    m_blocks = range(max(1, math.ceil((lo + 1) / block_m)), math.ceil(hi / block_m) + 1)
    for sms in range(int(config.get("num_sms") or sm_count), 0, -1):
        groups = per_sm * sms // cluster
        if groups and all(max_slices(mb, n_blocks, k_blocks, groups, stages, block_k) <= MAX_ORDERED_SLICES
                          for mb in m_blocks):
            return sms
    return None


def ordered_configs(fast: list[list], n: int, k: int, sm_count: int) -> list[list]:
    """humming's heuristic interval configs `[[lo, hi, config], ...]` (M in (lo, hi]) of an `[n, k]`
    layer, made deterministic: stream-K intervals get an ordered grid and no TMA store up to
    `ORDERED_MAX_M` rows, no stream-K past it or where no grid keeps 3 slices."""
    out: list[list] = []
    for lo, hi, config in fast:
        pieces = [(lo, hi)] if hi <= ORDERED_MAX_M or lo >= ORDERED_MAX_M else [(lo, ORDERED_MAX_M), (ORDERED_MAX_M, hi)]
        for a, b in pieces:
            cfg = dict(config)
            if cfg.get("use_stream_k", True):
                sms = ordered_sms(cfg, n, k, a, b, sm_count) if b <= ORDERED_MAX_M else None
                if sms is None:
                    cfg["use_stream_k"] = False
                else:
                    cfg.update(num_sms=sms, use_tma_c=False)
            out.append([a, b, cfg])
    return out
