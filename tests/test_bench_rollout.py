"""The rollout benchmark's code path on CPU with a tiny config (its figures come from the GPU)."""

from __future__ import annotations

from bench.rollout import bench_engine, bench_hf, targets

TINY = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
            rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=512)


def test_rows_and_targets_on_cpu():
    rows: list[dict] = []
    bench_engine(TINY, "nvfp4", [1, 3], 8, 5, 2, 4.2, device="cpu", emit=rows.append)
    bench_engine(TINY, "bf16", [8], 8, 5, 2, 4.2, device="cpu", emit=rows.append)
    bench_hf(TINY, [8], 8, 4, rows.append, device="cpu")
    assert [(r["impl"], r["format"], r["batch"]) for r in rows] == [
        ("qerl-engine", "nvfp4", 1), ("qerl-engine", "nvfp4", 3), ("qerl-engine", "bf16", 8), ("hf-generate", "bf16", 8)]
    for r in rows[:3]:
        assert r["all_ran_to_length"] and r["generated_tokens"] == r["batch"] * 5
        assert r["decode_steps"] == 4 and r["step_over_hbm_bound"] > 0
    names = [t["name"] for t in targets([{"shape": "qwen2.5-7b", **r} for r in rows])]
    assert any("NVFP4 tokens/s over our bf16" in n for n in names) is False  # no nvfp4 row at batch 8
    assert any("HBM lower bound" in n for n in names)


def test_nvfp4_over_nf4_target_at_batch_8():
    """QeRL's claim against QLoRA: NVFP4 tokens/s over NF4's at batch 8, only where both ran."""
    row = dict(shape="qwen2.5-7b", impl="qerl-engine", batch=8)
    rows = [{**row, "format": "nvfp4", "tokens_per_s": 300.0}, {**row, "format": "nf4", "tokens_per_s": 150.0}]
    got = [(t["name"], t["measured"], t["met"]) for t in targets(rows)]
    assert got == [("qwen2.5-7b batch 8: NVFP4 tokens/s over NF4 (QLoRA's base)", 2.0, True)]
    rows[1]["tokens_per_s"] = 250.0
    assert [t["met"] for t in targets(rows)] == [False]
    assert targets(rows[:1]) == []
