"""humming's stream-K schedule made run-to-run deterministic: the `humming-ordered` backend. No TMA store, and
a grid small enough that no tile gets more than 3 K slices (summed in slice order): the same bits every run, not
batch invariant; SM 9.x only. docs/kernels.md, "The dispatch" ("The 3-slice bound of `humming-ordered`")."""

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
        pieces = [(lo, ORDERED_MAX_M), (ORDERED_MAX_M, hi)] if lo < ORDERED_MAX_M < hi else [(lo, hi)]
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
