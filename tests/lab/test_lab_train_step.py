"""The train-step benchmark's whole path on CPU with a tiny config (its figures come from the GPU)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from qerl_lab import train_step
from qerl_pipe.model.random_init import init_random_model
from qerl_pipe.model.shapes import QWEN25_SHAPES, SHAPES, shape_for_source
from qerl_pipe.memory.plan import plan_step
from qerl_pipe.memory.step import StepSize, estimate_step_bytes
from qerl_lab.train_step import StepSettings, run_train_step_bench, speedups, targets
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.load import model_memory_bytes
from qerl_pipe.errors import QerlError
from qerl_pipe.recipe import load_recipe

TINY = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
            rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=512)
# Qwen3-30B-A3B's layout in miniature: every layer sparse, renormalised top-k.
TINY_MOE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64, intermediate_size=128,
                moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=512)
SMALL = StepSettings(prompts=2, group_size=2, prompt_len=8, response_len=6, lora_rank=2, micro_batch=2,
                     warmup_prompts=1, warmup_group_size=2, warmup_tokens=3, logprob_chunk=4)
ROW_FIELDS = {"shape", "quant", "fits", "status", "micro_batch", "kv_slots", "estimate_bytes", "build_s",
              "warmup", "rollout_s", "train_s", "step_s", "rollout_tokens_per_s", "train_tokens_per_s",
              "peak_allocated_bytes", "peak_reserved_bytes", "model_resident_bytes", "kv_cache_bytes"}


def _run(tmp_path, quants, **kwargs):
    lines: list[str] = []
    out = tmp_path / "train-step.json"
    result = run_train_step_bench(["tiny"], quants, SMALL, device="cpu", out=out,
                                  shape_configs={"tiny": TINY}, emit=lines.append, **kwargs)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [json.loads(line) for line in lines] == result["results"]
    return result


def test_full_step_rows_on_cpu(tmp_path):
    result = _run(tmp_path, ["bf16", "nvfp4"])
    assert {"command", "commit", "gpu", "date", "settings", "results", "targets"} <= set(result)
    rows = result["results"]
    assert [(r["shape"], r["quant"], r["status"], r["fits"]) for r in rows] == [
        ("tiny", "bf16", "ok", True), ("tiny", "nvfp4", "ok", True)]
    for r in rows:
        assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
        assert r["all_responses_full_length"] and r["rollout_tokens"] == 4 * 6
        assert r["train_tokens"] == 4 * (8 + 6)  # prompt + response of every sequence, one pass
        assert r["grad_norm"] > 0 and r["reward_std"] > 0  # the backward really ran
        assert r["step_s"] >= r["rollout_s"] > 0 and r["train_s"] > 0
        assert r["peak_allocated_bytes"] is None and not r["cuda_graphs"]  # CPU: no CUDA stats
        assert r["kv_cache_bytes"] == r["estimate_bytes"]["kv_cache"]
        # AdamW's two moments (and a step counter per parameter).
        assert 0 <= r["optimizer_state_bytes"] - 2 * r["lora_param_bytes"] < 1000
        assert "1 prompt x 2 samples x 3 new tokens" in r["warmup"]["what"]
    assert result["nvfp4_over_bf16"][0]["shape"] == "tiny"
    assert result["targets"] == []  # no Qwen2.5 shape ran


def test_row_times_are_the_median_of_the_steps_after_the_first(tmp_path):
    out = tmp_path / "steps.json"
    result = run_train_step_bench(["tiny"], ["bf16"], replace(SMALL, timed_steps=4), device="cpu", out=out,
                                  shape_configs={"tiny": TINY}, emit=lambda line: None)
    r = result["results"][0]
    steps = r["timed_steps"]
    assert len(steps) == 4 and r["first_step"] == steps[0]
    for key in ("step_s", "rollout_s", "train_s"):
        later = sorted(s[key] for s in steps[1:])
        assert r[key] == later[1]  # the median of three
    assert r["rollout_tokens_per_s"] == r["rollout_tokens"] / r["rollout_s"]


def test_does_not_fit_and_out_of_memory_are_rows_not_crashes(tmp_path, monkeypatch):
    result = _run(tmp_path, ["bf16"], memory_limit_bytes=1000)
    (row,) = result["results"]
    assert (row["fits"], row["status"]) == (False, "does-not-fit")
    assert row["asked_bytes"] == row["estimate_bytes"]["total"] > 1000

    real = train_step.init_random_model
    calls = []

    def first_one_ooms(*args, **kwargs):
        calls.append(kwargs["base_format"])
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(train_step, "init_random_model", first_one_ooms)
    rows = _run(tmp_path, ["nvfp4", "bf16"])["results"]
    assert [(r["quant"], r["status"]) for r in rows] == [("nvfp4", "oom"), ("bf16", "ok")]
    assert "out of memory" in rows[0]["error"] and rows[0]["fits"] is False


def test_rollout_labels_run_fp8_rollouts_and_keep_their_label(tmp_path):
    rows = _run(tmp_path, ["nvfp4+fp8"])["results"]
    assert [(r["quant"], r["status"]) for r in rows] == [("nvfp4+fp8", "ok")]
    with pytest.raises(QerlError, match=r"'nvfp4\+fp16': unknown or repeated options; write BASE\[\+fp8\]"):
        _run(tmp_path, ["nvfp4+fp16"])
    with pytest.raises(QerlError, match=r"quants \['bf16', 'nf4', 'nvfp4'\], each with \+fp8"):
        _run(tmp_path, ["int4+fp8"])
    ok = dict(status="ok", peak_reserved_gib=30.0, estimate_gib=50.0)
    fp8 = [{"shape": "qwen2.5-7b", "quant": q, "step_s": t, "train_s": 9.0, **ok} for q, t in (("bf16", 30.0),
                                                                                                ("nvfp4+fp8", 24.0))]
    assert [(t["measured"], t["met"]) for t in targets(fp8) if "FP8" in t["name"]] == [(1.25, True)]


def test_targets_block():
    ok = dict(status="ok", peak_reserved_gib=30.0, estimate_gib=50.0)
    rows = [{"shape": "qwen2.5-7b", "quant": "bf16", "step_s": 30.0, "train_s": 9.0, **ok},
            {"shape": "qwen2.5-7b", "quant": "nvfp4", "step_s": 15.0, "train_s": 10.0, **ok},
            {"shape": "qwen2.5-32b", "quant": "nvfp4", **ok, "peak_reserved_gib": 45.0},
            {"shape": "qwen2.5-72b", "quant": "nvfp4", **ok, "status": "oom"}]
    got = {t["name"].split(":")[0] + " " + t["unit"]: (t["measured"], t["met"]) for t in targets(rows)}
    # GiB in the rows, GB (10^9 bytes) in the targets: 45 GiB = 48.32 GB, 50 GiB = 53.69 GB.
    assert got == {"qwen2.5-32b NVFP4 RL step peak GPU memory (peak reserved) GB": (48.32, False),
                   "qwen2.5-72b NVFP4 RL step fits on one H200 (did not run GB": (53.69, False),
                   "qwen2.5-7b RL step 8 x 8 x": (2.0, True), "qwen2.5-7b RL step 8 x 8, training phase x": (0.9, False)}
    rows[2]["peak_reserved_gib"] = 37.0  # 39.73 GB: under 40 GB
    assert [t["met"] for t in targets(rows) if t["name"].startswith("qwen2.5-32b")] == [True]
    for t in targets(rows):
        assert set(t) == {"name", "target", "measured", "unit", "met"}


def test_paper_setting_targets_pair_recipes_by_name():
    """The speed recipes pair by file name with the base format left out; a budgeted run of the same
    recipe is not the paper's setting, and each target names the NVFP4 row's kernel column."""
    ok = dict(status="ok", memory_budget_gb=None)
    rows = [{"shape": "qwen2.5-7b", "quant": "bf16", "recipe": "qwen2.5-7b-bf16-1x8.yaml", "step_s": 16.0,
             "rollout_s": 12.0, "train_s": 4.0, **ok},
            {"shape": "qwen2.5-7b", "quant": "nvfp4", "recipe": "qwen2.5-7b-nvfp4-1x8.yaml", "step_s": 8.0,
             "rollout_s": 5.0, "train_s": 3.0, "kernels": "fast", **ok},
            {"shape": "qwen2.5-7b", "quant": "nvfp4", "recipe": "qwen2.5-7b-nvfp4-1x2.yaml", "step_s": 1.0,
             "rollout_s": 0.5, "train_s": 0.5, **ok, "memory_budget_gb": 16}]
    got = [(t["name"], t["target"], t["measured"], t["met"]) for t in targets(rows) if "ladder" not in t["name"]]
    assert got == [("qwen2.5-7b-1x8 (the paper's speed setting): NVFP4 (fast kernels) over bf16 LoRA",
                    ">= 1.6x", 2.0, True)]
    assert speedups(rows) == [{"shape": "qwen2.5-7b-1x8.yaml", "rollout": 2.4, "train": 1.333, "step": 2.0}]
    assert speedups(rows, "nf4") == []


def test_memory_estimate():
    # Exact for the weights (what the model really holds, LoRA aside).
    model = init_random_model(TINY, "nvfp4")
    size = StepSize(4, 14, 8, 2, 4, 2, 2, 4)
    assert estimate_step_bytes(DecoderConfig.from_hf(TINY), "nvfp4", size)["weights"] == model_memory_bytes(model) \
        - sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n == "inv_freq")
    # The real step: 72B does not fit on a 141 GB GPU in bf16, does in NVFP4; 32B NVFP4 ~50 GiB.
    step = StepSettings()  # planned without a budget: the settings as given, as bench_config runs them
    gib = {(shape, q): plan_step(DecoderConfig.from_hf(QWEN25_SHAPES[shape]), q, step.shape(shape),
                                 None).estimate_bytes / 2**30
           for shape in ("qwen2.5-32b", "qwen2.5-72b") for q in ("bf16", "nvfp4")}
    assert gib["qwen2.5-72b", "bf16"] > 141 and gib["qwen2.5-72b", "nvfp4"] < 100
    assert 40 < gib["qwen2.5-32b", "nvfp4"] < 60


@pytest.mark.parametrize("argv", [["--shape", "tiny"], ["--shape", "qwen2.5-7b", "--quant", "fp8"]])
def test_bad_input_is_one_error_line_without_a_traceback(argv):
    from typer.testing import CliRunner

    from qerl_pipe.cli import app

    result = CliRunner().invoke(app, ["bench", "train-step", *argv])
    assert result.exit_code == 1 and result.output.startswith("error:"), result.output


def test_the_step_trains_the_recipe_train_section():
    """The trainer gets a validated `TrainSection`, as `train` does: the recipe's defaults with the
    step's sizes, the synthetic reward alone."""
    from qerl_pipe.recipe import TrainSection

    cfg = train_step.train_config(StepSettings(), 4, 8, 8, 1024)
    assert isinstance(cfg, TrainSection)
    assert (cfg.prompts_per_step, cfg.group_size, cfg.max_new_tokens, cfg.micro_batch_size) == (8, 8, 1024, 4)
    assert cfg.rewards.custom == [train_step.SYNTHETIC_REWARD] and cfg.rewards.accuracy == 0.0
    assert cfg.lora.rank == 32 and cfg.lora.alpha == 64.0 and cfg.loss == "dapo" and cfg.eval_limit == 0


def test_cli_subcommand():
    from typer.testing import CliRunner

    from qerl_pipe.cli import app

    runner = CliRunner()
    assert "--micro-batch" in runner.invoke(app, ["bench", "train-step", "--help"]).output
    bad = runner.invoke(app, ["bench", "train-step", "--shape", "qwen2.5-7b,tiny", "--quant", "nvfp4"])
    assert bad.exit_code == 1 and "unknown ['tiny']" in bad.output


def test_repeated_values_run_once():
    # every shape runs with every base format: a repeated value would rerun whole configurations
    from qerl_lab.cli import values

    assert values(["qwen2.5-72b", "bf16,nvfp4", "nvfp4", "bf16 "]) == ["qwen2.5-72b", "bf16", "nvfp4"]
    assert values(["1, 8", "8 64"], int) == [1, 8, 64]


def test_full_fine_tuning_is_estimated_and_measured_like_the_lora_arms(tmp_path):
    from qerl_pipe.memory.step import full_bytes, weight_elements
    from qerl_pipe.errors import QerlError
    from qerl_pipe.model.full import make_fully_trainable

    # The estimate counts exactly the weights full fine-tuning trains (Qwen2: q/k/v biases too).
    model = init_random_model(TINY, "bf16")
    make_fully_trainable(model)
    c, numel = DecoderConfig.from_hf(TINY), sum(p.numel() for p in model.parameters())
    assert weight_elements(c) == numel
    size = StepSize(4, 14, 8, 2, 4, 2, 2, 4)
    estimate = estimate_step_bytes(c, "bf16", size, "full")
    assert "lora_and_optimizer" not in estimate and estimate["full_and_optimizer"] == full_bytes(c) > 16 * numel
    with pytest.raises(ValueError, match="needs a bf16 base"):
        estimate_step_bytes(c, "nvfp4", size, "full")
    # Qwen2.5-7B: 7.6B weights x 16 bytes of training state: the step does not fit one H200.
    seven = DecoderConfig.from_hf(QWEN25_SHAPES["qwen2.5-7b"])
    full_step = replace(StepSettings(), adapter="full").shape("qwen2.5-7b")
    gib = plan_step(seven, "bf16", full_step, None).estimate_bytes / 2**30
    assert 7.5e9 < weight_elements(seven) < 7.7e9 and gib > 139

    full = replace(SMALL, adapter="full")
    with pytest.raises(QerlError, match="full fine-tuning trains a bf16 base only"):
        run_train_step_bench(["tiny"], ["nvfp4"], full, device="cpu", shape_configs={"tiny": TINY})
    (row,) = run_train_step_bench(["tiny"], ["bf16"], full, device="cpu", shape_configs={"tiny": TINY},
                                  emit=lambda line: None)["results"]
    assert row["status"] == "ok" and row["adapter"] == "full" and row["lora_param_bytes"] == 0
    # bf16 weights: AdamW's two float32 moments and the float32 masters, 12 bytes per weight.
    assert row["optimizer_state_bytes"] >= 12 * numel and row["grad_norm"] > 0
    assert train_step.train_config(full, 2, 2, 2, 6).adapter == "full"


def _tiny_recipe(tmp_path, budget_gb, quant="nvfp4"):
    path = tmp_path / f"tiny-{quant}-{budget_gb}.yaml"
    path.write_text(f"model:\n  source: Qwen/Qwen2.5-7B-Instruct\nengine:\n  base_format: {quant}\n  max_seq_len: 14\n"
                    f"  max_batch: 4\ntrain:\n  prompts_per_step: 2\n  group_size: 2\n  max_new_tokens: 6\n"
                    f"  micro_batch_size: 2\n  memory_budget_gb: {budget_gb}\n  adapter: lora\n  lora:\n    rank: 2\n")
    return path


def test_recipes_run_under_their_budget_or_are_refused(tmp_path):
    """--recipe on CPU with the 7B shape swapped for a tiny one: the plan, the refusal, --unconstrained
    and --append; the rows carry what the ladder's targets and summary read."""
    out = tmp_path / "ladder.json"
    run = dict(device="cpu", out=out, shape_configs={"qwen2.5-7b": TINY}, emit=lambda line: None)
    fits, refused = _tiny_recipe(tmp_path, 2), _tiny_recipe(tmp_path, 0.5, "bf16")
    rows = run_train_step_bench([], [], recipes=[fits, refused], **run)["results"]
    assert [(r["recipe"], r["status"]) for r in rows] == [(fits.name, "ok"), (refused.name, "refused")]
    ok, no = rows
    assert ok["memory_budget_gb"] == 2 and ok["memory_plan"]["budget_gb"] == 2 and ok["kv_slots"] == 4
    assert ok["estimate_bytes"]["total"] <= 2e9 and ok["grad_norm"] > 0 and ok["train_tokens"] == 4 * 14
    assert no["needed_gb"] > 1 and "The smallest budget that fits is" in no["error"] and "build_s" not in no
    again = run_train_step_bench([], [], recipes=[fits], unconstrained=True, append=True, **run)
    assert [r["memory_budget_gb"] for r in again["results"]] == [2, 0.5, None]
    (entry, refused_entry) = again["ladder"]
    assert entry["recipe"] == fits.name and entry["unconstrained_step_s"] == again["results"][2]["step_s"]
    assert refused_entry["status"] == "refused" and refused_entry["needed_gb"] == no["needed_gb"]


def test_one_wave_and_stop_at_run_less_within_the_full_plan(tmp_path):
    """Issue 49's proof runs: the plan and the engine are the recipe's full step; one wave of the
    planned KV slots runs, its responses stopped early, and the row says so."""
    path = _tiny_recipe(tmp_path, 2)  # 2 prompts x G 2, 6 new tokens, max_batch 2 below
    path.write_text(path.read_text().replace("  max_batch: 4\n", "  max_batch: 2\n"))
    settings = replace(SMALL, one_wave=True, stop_at=3, timed_steps=1)
    (row,) = run_train_step_bench([], [], settings, device="cpu", shape_configs={"qwen2.5-7b": TINY},
                                  emit=lambda line: None, recipes=[path])["results"]
    assert row["status"] == "ok" and row["kv_slots"] == 2 and row["memory_plan"]["step"]["sequences"] == 4
    assert row["lowered"] == {"prompts_per_step": [2, 1], "response_len": [6, 3]}
    assert row["rollout_tokens"] == 1 * 2 * 3 and len(row["timed_steps"]) == 1
    (full,) = run_train_step_bench([], [], replace(SMALL, timed_steps=1), device="cpu",
                                   shape_configs={"qwen2.5-7b": TINY}, emit=lambda line: None,
                                   recipes=[path])["results"]
    assert "lowered" not in full and full["estimate_bytes"] == row["estimate_bytes"]


def test_append_keeps_the_settings_of_the_earlier_rows(tmp_path):
    """--append adds rows under the file's top-level fields: the earlier rows' shape settings stay when
    the new run has no shapes, and the recipe settings of both runs are kept (the ladder's docs append
    one recipe per command)."""
    out = tmp_path / "ladder.json"
    run = dict(device="cpu", out=out, shape_configs={"tiny": TINY, "qwen2.5-7b": TINY}, emit=lambda line: None,
               memory_limit_bytes=1000)  # rows refused or not fitting: nothing is built
    first, second = _tiny_recipe(tmp_path, 0.5, "bf16"), _tiny_recipe(tmp_path, 0.6, "bf16")
    before = run_train_step_bench(["tiny"], ["bf16"], SMALL, recipes=[first], **run)
    after = run_train_step_bench([], [], recipes=[second], append=True, **run)
    assert [r["status"] for r in after["results"]] == ["refused", "does-not-fit", "refused"]
    assert after["settings"] == before["settings"] and after["settings"]["prompts"] == SMALL.prompts
    assert set(after["recipe_settings"]) == {first.name, second.name}


def test_ladder_targets():
    def row(shape, quant, gb, **kw):
        return {"recipe": f"{shape}.yaml", "shape": shape, "quant": quant, "memory_budget_gb": gb, **kw}

    rows = [row("qwen2.5-7b", "nvfp4", 16, status="ok", peak_reserved_gb=15.1, peak_under_budget=True,
                estimate_over_peak=0.03),
            row("qwen2.5-32b", "nvfp4", 40, status="ok", peak_reserved_gb=36.0, peak_under_budget=True,
                estimate_over_peak=0.09),
            row("qwen2.5-72b", "nvfp4", 80, status="oom"),
            row("qwen2.5-72b", "bf16", 80, status="refused", needed_gb=157.8),
            row("qwen3-30b-a3b", "nvfp4", 40, status="ok", peak_reserved_gb=33.5, peak_under_budget=True,
                estimate_over_peak=-0.041)]
    got = {t["name"]: (t["measured"], t["met"]) for t in targets(rows)}
    assert got == {
        "ladder: qwen2.5-7b NVFP4 at 16 GB: one RL step completes, peak reserved under the budget (ok)": (15.1, True),
        "ladder: qwen2.5-7b NVFP4 at 16 GB: planner's estimate vs measured peak reserved": (3.0, True),
        "ladder: qwen2.5-32b NVFP4 at 40 GB: one RL step completes, peak reserved under the budget (ok)": (36.0, True),
        "ladder: qwen2.5-32b NVFP4 at 40 GB: planner's estimate vs measured peak reserved": (9.0, False),
        "ladder: qwen2.5-72b NVFP4 at 80 GB: one RL step completes, peak reserved under the budget (oom)": (None, False),
        "ladder: qwen2.5-72b NVFP4 at 80 GB: planner's estimate vs measured peak reserved": (None, False),
        "ladder: qwen2.5-72b bf16 at 80 GB: refused before any work (measured: GB it says it needs)": (157.8, True),
        "ladder: qwen3-30b-a3b NVFP4 at 40 GB: one RL step completes, peak reserved under the budget (ok)": (33.5, True),
        "ladder: qwen3-30b-a3b NVFP4 at 40 GB: planner's estimate vs measured peak reserved": (-4.1, True),
    }


def test_recipe_errors_name_the_file_and_key(tmp_path):
    from qerl_pipe.errors import QerlError

    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  source: Qwen/Qwen2.5-7B\ntrain:\n  memory_budget_gb: -1\n")
    with pytest.raises(QerlError, match="'train.memory_budget_gb'"):  # validated as `run` validates it
        train_step.read_recipe(bad)
    # What a recipe leaves out is the recipe's default, as for `run`.
    bad.write_text("model:\n  source: Qwen/Qwen2.5-7B\nengine:\n  max_seq_len: 1280\ntrain:\n  max_new_tokens: 1024\n")
    step = train_step.read_recipe(bad)
    defaults = load_recipe(None)
    assert (step.quant, step.budget_gb, step.settings.prompt_len) == (defaults.engine.base_format, None, 256)
    assert (step.settings.kv_slots, step.settings.lora_rank) == (defaults.engine.max_batch, defaults.train.lora.rank)
    other = _tiny_recipe(tmp_path, 2)
    other.write_text(other.read_text().replace("Qwen/Qwen2.5-7B-Instruct", "meta-llama/Llama-3.1-8B"))
    with pytest.raises(QerlError, match="not a shape the bench can build"):
        train_step.read_recipe(other)
    from typer.testing import CliRunner

    from qerl_pipe.cli import app

    help_text = CliRunner().invoke(app, ["bench", "train-step", "--help"]).output
    assert "--recipe" in help_text and "--memory-budget-gb" in help_text and "--unconstrained" in help_text


def test_qwen3_30b_a3b_shape_is_the_published_model():
    """The shape `--shape qwen3-30b-a3b` and the ladder rung build: Qwen3-30B-A3B's config.json as our
    parser and transformers read it (30.5 B parameters, 18.1 GB as NVFP4), named by its hub ids."""
    from transformers import AutoConfig

    from qerl_pipe.memory.step import weight_bytes, weight_elements

    config = SHAPES["qwen3-30b-a3b"]
    c = DecoderConfig.from_hf(config)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2048, 48, 32, 4, 128)
    assert (c.num_experts, c.experts_per_token, c.moe_intermediate_size, c.norm_topk_prob) == (128, 8, 768, True)
    assert c.num_sparse_layers == 48 and c.qk_norm and not c.tie_word_embeddings and c.vocab_size == 151936
    assert 30.5e9 < weight_elements(c) < 30.6e9 and 18.0e9 < weight_bytes(c, "nvfp4") < 18.2e9
    hf = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})  # as bench_hf builds it
    assert (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.head_dim) == (128, 8, 768, 128)
    assert set(QWEN25_SHAPES) < set(SHAPES)
    for source in ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B-Instruct-2507", "/models/Qwen3-30B-A3B/"):
        assert shape_for_source(source) == "qwen3-30b-a3b"
    assert shape_for_source("Qwen/Qwen2.5-32B-Instruct") == "qwen2.5-32b"
    assert shape_for_source("Qwen/Qwen3-235B-A22B") is None
    assert train_step.DEFAULT_MICRO_BATCH["qwen3-30b-a3b"] == 8
    assert ("qwen3-30b-a3b", "nvfp4", 40) in train_step.LADDER


@pytest.mark.slow
def test_moe_step_on_cpu_routers_random_and_expert_lora_from_the_recipe(tmp_path):
    """A tiny Qwen3-MoE step, by --shape and by a recipe standing in for the 30B-A3B rung: the routers
    get random weights, LoRA stays on attention unless the recipe's train.lora.experts asks for more."""
    from qerl_pipe.model.moe import Router

    model = init_random_model(TINY_MOE, "nvfp4")
    routers = [m.weight for m in model.modules() if isinstance(m, Router)]
    assert len(routers) == 2 and all(0.01 < w.float().std() < 0.03 for w in routers)
    assert not torch.equal(routers[0], routers[1])

    (row,) = run_train_step_bench(["moe"], ["nvfp4"], SMALL, device="cpu", shape_configs={"moe": TINY_MOE},
                                  emit=lambda line: None)["results"]
    assert row["status"] == "ok" and row["grad_norm"] > 0 and row["all_responses_full_length"]
    assert not row["cuda_graphs"]
    rows = []
    for experts in (False, True):
        path = _tiny_recipe(tmp_path, 2)
        text = path.read_text().replace("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-30B-A3B-Instruct-2507")
        path.write_text(text + f"    experts: {str(experts).lower()}\n")
        assert train_step.read_recipe(path).settings.lora_experts is experts
        (r,) = run_train_step_bench([], [], recipes=[path], device="cpu", shape_configs={"qwen3-30b-a3b": TINY_MOE},
                                    emit=lambda line: None)["results"]
        assert r["status"] == "ok" and r["shape"] == "qwen3-30b-a3b" and r["grad_norm"] > 0
        rows.append(r)
    attention, every_expert = rows
    c = DecoderConfig.from_hf(TINY_MOE)
    from qerl_pipe.memory.step import lora_params

    assert attention["lora_param_bytes"] == 4 * lora_params(c, 2)  # fp32 adapters
    assert every_expert["lora_param_bytes"] == 4 * lora_params(c, 2, experts=True) > attention["lora_param_bytes"]
    assert every_expert["estimate_bytes"]["lora_and_optimizer"] > attention["estimate_bytes"]["lora_and_optimizer"]
