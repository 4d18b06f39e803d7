"""`bench kernels-dispatch` on the CPU: the recipes it times and the files it writes."""

from __future__ import annotations

import json

from qerl_pipe.kernels.dispatch import DispatchTable


def test_speed_recipes_are_the_papers_setting(tmp_path) -> None:
    """recipes/speed/: one prompt x G of 256 + 2048 tokens, LoRA r32, each base with its twin."""
    from pathlib import Path

    from qerl_lab.train_step import read_recipe

    files = sorted((Path(__file__).parents[2] / "recipes" / "speed").glob("*.yaml"))
    steps = [read_recipe(p) for p in files]
    assert {(s.shape, s.settings.group_size) for s in steps} == {("qwen2.5-7b", 2), ("qwen2.5-7b", 8),
                                                                  ("qwen2.5-32b", 8)}
    for s in steps:
        assert (s.settings.prompts, s.settings.prompt_len, s.settings.response_len) == (1, 256, 2048)
        assert s.settings.lora_rank == 32 and s.settings.kernels == "deterministic"
        assert any(t.shape == s.shape and t.settings.group_size == s.settings.group_size and t.quant != s.quant
                   for t in steps)
    fast = tmp_path / "fast.yaml"
    fast.write_text(files[0].read_text().replace("  base_format:", "  deterministic: false\n  base_format:"))
    assert read_recipe(fast).settings.kernels == "fast"


def test_dispatch_bench_writes_what_it_measured_so_far(tmp_path) -> None:
    """The table and results file a kernels-dispatch run rewrites after each layer: a run cut off by
    a time limit leaves a table the dispatch reads, rows that say they are partial, nothing else."""
    from qerl_lab.kernels_dispatch import PARTIAL, write_outputs
    from qerl_lab.results import results_file

    table = DispatchTable("NVIDIA H200", 132, deterministic={"m64:n4608:k3584": "qerl"},
                          fast={"m64:n4608:k3584": "humming-fast"})
    rows = [{"model": "qwen2.5-7b", "layer": "qkv", "M": 64, "qerl_us": 10.0, "bf16_us": 12.0}]
    out, table_out = tmp_path / "res" / "kd.json", tmp_path / "cuda" / "dispatch-h200.json"
    write_outputs(table, "qerl-pipe bench kernels-dispatch (qwen2.5-7b)",
                  results_file(rows, [], partial=PARTIAL, table=table.to_json()), out, table_out)
    written = json.loads(table_out.read_text())
    assert written["source"] == "qerl-pipe bench kernels-dispatch (qwen2.5-7b)"
    assert DispatchTable.from_json(written) == table
    result = json.loads(out.read_text())
    assert result["results"] == rows and result["partial"] == PARTIAL and result["targets"] == []
    write_outputs(table, "s", {"results": []}, None, None)  # neither file asked for: nothing written
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["dispatch-h200.json", "kd.json"]
