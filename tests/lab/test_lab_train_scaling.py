"""`bench train-scaling` on the CPU (gloo): it measures a step and sets its target."""

from __future__ import annotations

import pytest


def test_scaling_bench_measures_a_step_and_sets_the_target():
    from qerl_lab.train_scaling import measure, scaling_targets

    row = measure("tiny", "cpu", prompts_per_step=2, group_size=2, prompt_len=8, new_tokens=4, steps=1, warmup=1,
                  lora_rank=4, micro_batch_size=4)
    assert row["processes"] == 1 and row["steps_per_s"] > 0 and row["sequences_per_rank"] == 4
    rows = [row, {**row, "processes": 2, "steps_per_s": 1.9 * row["steps_per_s"]}]
    (t,) = scaling_targets(rows)
    assert t["target"] == ">= 1.8x" and t["measured"] == pytest.approx(1.9, abs=1e-3) and t["met"]
    assert not scaling_targets([row, {**row, "processes": 2, "steps_per_s": 1.5 * row["steps_per_s"]}])[0]["met"]
    assert scaling_targets([row]) == []
