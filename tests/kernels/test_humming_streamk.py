"""The ordered stream-K schedule's arithmetic (`kernels.humming_streamk`), on the CPU: the slice
bound against a tile-by-tile walk of humming's scheduler, and the configs it derives."""

from __future__ import annotations

import math

import pytest

from qerl_pipe.kernels.humming_streamk import (MAX_ORDERED_SLICES, ORDERED_MAX_M, max_slices, ordered_configs,
                                               ordered_sms)


def _walk(m_blocks: int, n_blocks: int, kb: int, groups: int, stages: int) -> int:
    """Slices per tile by walking each CTA group's work as humming's `Scheduler` hands it out
    (data-parallel tiles first, then `total`-block runs of the (tile, k-block) space)."""
    mn = m_blocks * n_blocks
    streamed = mn
    if mn > groups:
        streamed = mn % groups
        if streamed and streamed * 10 <= groups:
            streamed += groups
    dp = (mn - streamed) // groups
    if streamed == 0:
        return 1
    total = max(math.ceil(streamed * kb / groups), math.ceil((kb - 1) / 9))
    total = stages * math.ceil(total / stages)
    slices: dict[int, int] = {}
    for g in range(groups):
        start = groups * dp * kb + total * g
        end = min(start + total, mn * kb)
        while start < end:  # one slice per tile this CTA group's run touches
            tile = start // kb
            slices[tile] = slices.get(tile, 0) + 1
            start = (tile + 1) * kb
    return max(slices.values())


@pytest.mark.parametrize("m_blocks", (1, 2, 3, 8, 17))
@pytest.mark.parametrize("n_blocks,kb", ((28, 28), (56, 148), (72, 28), (296, 28), (40, 160)))
@pytest.mark.parametrize("groups,stages", ((132, 4), (112, 4), (66, 3), (128, 2)))
def test_max_slices_bounds_the_scheduler_walk(m_blocks: int, n_blocks: int, kb: int, groups: int, stages: int) -> None:
    walked = _walk(m_blocks, n_blocks, kb, groups, stages)
    bound = max_slices(m_blocks, n_blocks, kb, groups, stages, block_k=128)
    assert walked <= bound
    # The bound is the walk's answer or one above it (a run need not start mid-tile).
    assert bound - walked <= 1


def _config(block=(64, 64, 128), stages=4, **extra) -> dict:
    return {"block_shape": block, "warp_shape": (64, 32, 128), "use_stream_k": True, "num_stages": stages,
            "num_ctas_per_sm": 1, "num_sms": 132, **extra}


def test_ordered_grid_keeps_every_tile_at_three_slices() -> None:
    n, k = 3584, 18944  # Qwen2.5-7B down: 56 tiles of 64 rows, 148 K blocks
    sms = ordered_sms(_config(), n, k, 32, 64, 132)
    assert sms is not None and sms < 132  # the full grid cuts a tile into more than 3 slices
    assert max_slices(1, n // 64, k // 128, 132, 4) > MAX_ORDERED_SLICES
    assert max_slices(1, n // 64, k // 128, sms, 4) <= MAX_ORDERED_SLICES
    assert max_slices(1, n // 64, k // 128, sms + 1, 4) > MAX_ORDERED_SLICES  # the largest such grid


def test_ordered_configs_turn_off_the_tma_store_and_split_at_the_ordered_limit() -> None:
    fast = [[0, 64, _config()], [64, 1 << 30, _config(block=(128, 128, 64), stages=3)],
            [0, 8, _config(use_stream_k=False)]]
    out = ordered_configs(fast, 4608, 3584, 132)
    assert [(lo, hi) for lo, hi, _ in out] == [(0, 64), (64, ORDERED_MAX_M), (ORDERED_MAX_M, 1 << 30), (0, 8)]
    first, below, above, plain = (c for _, _, c in out)
    assert first["use_tma_c"] is False and first["use_stream_k"] and first["num_sms"] <= 132
    assert below["use_tma_c"] is False and below["use_stream_k"]
    assert above["use_stream_k"] is False  # past the searched range: one CTA per tile
    assert plain == fast[2][2]  # not stream-K: unchanged
    assert fast[0][2].get("use_tma_c") is None  # the input configs are not modified
    for lo, hi, c in out[:2]:
        bm, bn, bk = c["block_shape"]
        for mb in range(math.ceil((lo + 1) / bm), math.ceil(hi / bm) + 1):
            assert max_slices(mb, 4608 // bn, 3584 // bk, c["num_sms"], c["num_stages"], bk) <= MAX_ORDERED_SLICES
