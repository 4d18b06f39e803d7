"""`bench decode-profile`'s host side on the CPU: the Python functions ranked by own time per step."""

from __future__ import annotations

import cProfile
import pstats

from qerl_lab.decode_profile import PYTHON_TOP, _python_top


def _busy(n: int) -> int:
    return sum(i * i for i in range(n))


def _step() -> None:
    for _ in range(3):
        _busy(20000)
    _busy(10)


def test_python_top_ranks_own_time_per_step() -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(4):
        _step()
    profiler.disable()
    rows = _python_top(pstats.Stats(profiler), steps=4)
    assert 0 < len(rows) <= PYTHON_TOP
    own = [r["own_ms_per_step"] for r in rows]
    assert own == sorted(own, reverse=True)
    busy = next(r for r in rows if "(_busy)" in r["function"])
    assert busy["calls_per_step"] == 4.0  # 3 long calls and 1 short one per step
    assert busy["function"].startswith("test_lab_decode_profile.py:")
    assert busy["cumulative_ms_per_step"] >= busy["own_ms_per_step"] > 0
