"""The rollout benchmark's code path on CPU with a tiny config (its figures come from the GPU)."""

from __future__ import annotations

from qerl_lab.rollout import bench_engine, bench_hf, targets

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


TINY_MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64, intermediate_size=128,
                moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=512)


def test_moe_rows_on_cpu_bound_the_step_by_the_experts_it_reaches():
    """A tiny Qwen3-MoE through our engine and HF generate; the HBM bound of a step counts the
    experts `batch` tokens reach on average (1 - (1 - k/E)^batch of them), the rest in full."""
    from qerl_lab.rollout import experts_read_share
    from qerl_pipe.model.config import DecoderConfig

    rows: list[dict] = []
    bench_engine(TINY_MOE, "nvfp4", [1, 4], 8, 5, 2, 4.2, device="cpu", emit=rows.append)
    bench_hf(TINY_MOE, [2], 8, 4, rows.append, device="cpu")
    one, four, hf = rows
    assert one["all_ran_to_length"] and four["generated_tokens"] == 4 * 5 and hf["impl"] == "hf-generate"
    c = DecoderConfig.from_hf(TINY_MOE)
    assert experts_read_share(c, 1) == 2 / 8 and experts_read_share(c, 4) == 1 - (6 / 8) ** 4
    assert one["experts_read_share"] == 0.25 and 0 < one["expert_bytes"] < one["model_bytes"]
    unread = one["expert_bytes"] * (four["experts_read_share"] - one["experts_read_share"])
    assert abs(four["step_bytes_weights"] - one["step_bytes_weights"] - unread) <= 1
    plain: list[dict] = []  # --no-kernel-copies: the engine is told to make none, and the row says so
    bench_engine(TINY_MOE, "nvfp4", [1], 8, 3, 2, 4.2, device="cpu", emit=plain.append, kernel_copies=False)
    assert one["kernel_copies"] and not plain[0]["kernel_copies"] and plain[0]["all_ran_to_length"]
    dense: list[dict] = []  # a dense model: every weight read, as before
    bench_engine(TINY, "bf16", [2], 8, 3, 2, 4.2, device="cpu", emit=dense.append)
    assert dense[0]["expert_bytes"] == 0 and dense[0]["experts_read_share"] == 1.0
    assert dense[0]["step_bytes_weights"] == dense[0]["model_bytes"] - 300 * 64 * 2  # the embedding table aside


def test_qwen3_moe_speedup_targets_at_batch_1_8_64():
    """Issue 35: Qwen3-30B-A3B NVFP4 over bf16 tokens/s >= 1.5x / 1.4x / 1.1x at batch 1 / 8 / 64."""
    row = dict(shape="qwen3-30b-a3b", impl="qerl-engine")
    rows = [{**row, "batch": b, "format": f, "tokens_per_s": t}
            for b, bf16, fp4 in ((1, 100.0, 160.0), (8, 500.0, 650.0), (64, 2000.0, 2300.0))
            for f, t in (("bf16", bf16), ("nvfp4", fp4))]
    got = [(t["name"], t["target"], t["measured"], t["met"]) for t in targets(rows)]
    assert got == [("qwen3-30b-a3b batch 1: NVFP4 tokens/s over our bf16", ">= 1.5x", 1.6, True),
                   ("qwen3-30b-a3b batch 8: NVFP4 tokens/s over our bf16", ">= 1.4x", 1.3, False),
                   ("qwen3-30b-a3b batch 64: NVFP4 tokens/s over our bf16", ">= 1.1x", 1.15, True)]


def test_rollout_cli_knows_the_moe_shape():
    from typer.testing import CliRunner

    from qerl_pipe.cli import app

    runner = CliRunner()
    assert "qwen3-30b-a3b" in runner.invoke(app, ["bench", "rollout", "--help"]).output
    bad = runner.invoke(app, ["bench", "rollout", "--shapes", "qwen3-30b-a3b,qwen3-235b-a22b"])
    assert bad.exit_code == 1 and "unknown shapes ['qwen3-235b-a22b']" in bad.output


def test_fp8_kv_plan_slot_target_pairs_the_two_batches():
    """Issue 50: 32B tokens/s with FP8 KV at the plan's 32 slots over bf16 KV at its 16, only where both ran."""
    row = dict(shape="qwen2.5-32b", impl="qerl-engine")
    rows = [{**row, "format": "nvfp4", "batch": 16, "tokens_per_s": 100.0},
            {**row, "format": "nvfp4", "batch": 32, "tokens_per_s": 150.0},
            {**row, "format": "nvfp4+fp8kv", "batch": 32, "tokens_per_s": 180.0}]
    got = [(t["name"], t["measured"], t["met"]) for t in targets(rows)]
    assert got == [("qwen2.5-32b: nvfp4+fp8kv at its plan's 32 slots over nvfp4 at 16 (tokens/s)", 1.8, True)]
    rows[2]["tokens_per_s"] = 160.0
    assert [t["met"] for t in targets(rows)] == [False]
    assert targets(rows[1:]) == []
