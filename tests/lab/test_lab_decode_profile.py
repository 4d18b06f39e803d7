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


def test_kv_targets_compare_graph_steps_at_one_batch_and_tokens_per_second_at_the_plans_slots():
    from qerl_lab.decode_profile import kv_targets

    def row(shape, label, batch, ms):
        return {"shape": shape, "format": label, "batch": batch, "context": 4096, "graph_step_ms": ms}

    seven = kv_targets([row("qwen2.5-7b", "nvfp4", 256, 30.0), row("qwen2.5-7b", "nvfp4+fp8kv", 256, 27.0),
                        row("qwen2.5-7b", "nvfp4+fp8kv", 64, 1.0)])
    assert [(t["measured"], t["met"]) for t in seven] == [(0.9, False)]
    big = kv_targets([row("qwen2.5-32b", "nvfp4", 16, 60.0), row("qwen2.5-32b", "nvfp4+fp8kv", 32, 66.0)])
    assert [(t["measured"], t["met"]) for t in big] == [(round(32 / 66 / (16 / 60), 3), True)]
    assert kv_targets([row("qwen2.5-32b", "nvfp4", 16, 60.0)]) == []


def test_a_run_rewrites_its_partial_file_after_every_row(tmp_path, monkeypatch):
    import json

    import qerl_lab.decode_profile as profile

    def fake(shape, label, batch, context, steps):
        return {"shape": shape, "format": label, "batch": batch, "context": context, "graph_step_ms": 2.0,
                "kernels_per_step": 40, "kernels_per_layer": 9, "gpu_busy_ms_per_step": 1.0, "eager_step_ms": 3.0,
                "kinds": [], "python_top": []}

    seen = []
    monkeypatch.setattr(profile, "profile_format", lambda *a: seen.append(
        len(json.loads((tmp_path / "p.json").read_text())["results"]) if (tmp_path / "p.json").exists() else 0) or fake(*a))
    monkeypatch.setattr(profile.torch.cuda, "empty_cache", lambda: None)
    out = profile.run("qwen2.5-7b", ["nvfp4", "nvfp4+int8kv@64"], [8, 16], 512, 2, partial=tmp_path / "p.json")
    assert seen == [0, 1, 2]  # nvfp4 at 8, nvfp4+int8kv at 64 (once), nvfp4 at 16; each saw the rows before it
    assert [(r["format"], r["batch"]) for r in out["results"]] == [("nvfp4", 8), ("nvfp4+int8kv", 64), ("nvfp4", 16)]
    assert len(json.loads((tmp_path / "p.json").read_text())["results"]) == 3
