"""`bench kernels-cuda`'s targets on the CPU."""

from __future__ import annotations


def test_kernels_cuda_targets_of_unmeasured_m_are_left_out():
    from qerl_lab.kernels_cuda import _targets

    rows = [{"model": m, "layer": layer, "M": 8, "bf16_us": 10.0, "speedup_best": 2.5, "gemm_tbps": 3.0}
            for m in ("qwen2.5-7b", "qwen2.5-32b") for layer in ("qkv", "gate_up", "down")]
    names = [t["name"] for t in _targets(rows, ceiling=4.0)]
    assert any("M 1-16" in n for n in names) and any("gate_up and down" in n for n in names)
    assert not any("M 64" in n or "M 1024" in n or "M 4096" in n or "M 256" in n for n in names)
