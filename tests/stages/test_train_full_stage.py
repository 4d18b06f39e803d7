"""`train.adapter: full` through the CLI (CPU): the run holds a Hugging Face model of the trained
weights, its merged-bf16 export loads in transformers with the trained logits, peft export and a
4-bit base are one-line errors before any work, and a run killed with SIGKILL resumes bit-identical."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qerl_pipe.recipe import TrainSection
from qerl_pipe.stages.train import train_key
from tests.conftest import read_json
from tests.stage_cli import cli, last_line, named
from tests.stages.test_train_stage import ENGINE, TRAIN, assert_same_training, kill_and_resume

FULL = ["--set", "train.adapter=full", "--set", "engine.base_format=bf16", "--set", "train.lr=1e-3"]


def test_the_setting_names_the_run_and_lora_runs_keep_their_ids():
    lora, full = TrainSection(), TrainSection(adapter="full")
    # no memory_budget_gb (planned to the free memory) is no setting: not in the id either
    assert train_key(lora) == {k: v for k, v in lora.model_dump().items() if k not in ("adapter", "memory_budget_gb", "optimizer")}
    assert train_key(full)["adapter"] == "full" and "lora" not in train_key(full)
    assert train_key(TrainSection(adapter="full", lora={"rank": 4})) == train_key(full)  # no adapter, no rank


def test_a_full_run_exports_the_trained_model_and_refuses_peft(tiny_llama, store_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from qerl_pipe.model.full import FullTraining
    from qerl_pipe.jobs.engine_artifact import load_engine

    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  source: {tiny_llama}\n")
    result = cli("run", recipe, "--artifacts", store_dir, *ENGINE, *TRAIN, *FULL, "--set",
                 "stages=[build-engine, train, export, eval]", "--set", "export.format=merged-bf16", "--set",
                 "export.dtype=float32", "--set", "train.steps=3", "--set", "train.eval_limit=0",
                 "--set", "eval.data=arithmetic:4", "--set", "eval.greedy=true", "--set", "eval.max_new_tokens=8",
                 "--set", "eval.device=cpu")
    assert "full fine-tuning of 0.1M parameters" in result.stderr
    (run,) = [store_dir / n for n in named(store_dir, "train-")]
    (export,) = [store_dir / n for n in named(store_dir, "export-")]
    assert named(store_dir, "eval-")  # run evaluated the export: the trained model, no adapter
    manifest = read_json(run / "manifest.json")
    assert manifest["config"]["train"]["adapter"] == "full" and "lora" not in manifest["config"]["train"]
    assert manifest["summary"]["adapter"] == "full" and manifest["summary"]["trained_parameters"] > 0
    files = set(manifest["files"])
    assert {"model/model.safetensors", "model/config.json", "model/tokenizer.json",
            "checkpoints/step-000003/full_weights.safetensors"} <= files
    assert not any(f.startswith("adapter/") for f in files)
    assert "full fine-tuning (every weight)" in (run / "report.md").read_text()

    # Our model with the trained weights the trainer held (the checkpoint's masters, by our names).
    ours, _ = load_engine(store_dir / named(store_dir, "build-engine-")[0], "cpu")
    FullTraining(ours).load_state_dict(load_file(str(run / "checkpoints/step-000003/full_weights.safetensors")))
    hf = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        torch.testing.assert_close(ours.logits(ids), want, atol=1e-4, rtol=1e-4)
        assert (base(input_ids=ids).logits - want).abs().max() > 1e-3  # it is the trained model
    trained = dict(hf.named_parameters())
    assert all(not torch.equal(p, trained[n]) for n, p in base.named_parameters())  # every weight moved
    assert read_json(export / "manifest.json")["summary"]["adapter"] == "full"

    peft = cli("export", "--run", run, "--artifacts", store_dir, "--format", "peft", ok=False)
    assert peft.exit_code == 1 and len(peft.stderr.strip().splitlines()) == 1
    assert "train.adapter=full" in peft.stderr and "merged-bf16" in peft.stderr
    assert len(named(store_dir, "export-")) == 1  # nothing written

    nvfp4 = last_line(cli("export", "--run", run, "--artifacts", store_dir, "--format", "merged-nvfp4"))
    config = read_json(nvfp4 / "config.json")
    assert config["quantization_config"]["quant_algo"] == "W4A16_NVFP4"
    assert read_json(nvfp4 / "manifest.json")["summary"]["quantized_linears"] == 14  # 7 per layer, 2 layers

    evaluated = cli("eval", "--adapter", run, "--artifacts", store_dir, "--model", tiny_llama, *ENGINE[2:],
                    "--set", "engine.base_format=bf16", ok=False)
    assert evaluated.exit_code == 1 and "has no adapter" in evaluated.stderr


@pytest.mark.parametrize("base", ["nvfp4", "nf4"])
@pytest.mark.parametrize("command", ["train", "run"])
def test_full_fine_tuning_of_a_4bit_base_fails_before_any_work(tiny_llama, store_dir, tmp_path, base, command):
    opts = [*ENGINE, *TRAIN, "--set", "train.adapter=full", "--set", f"engine.base_format={base}"]
    if command == "run":
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"model:\n  source: {tiny_llama}\n")
        result = cli("run", recipe, "--artifacts", store_dir, *opts, ok=False)
    else:
        result = cli("train", "--model", tiny_llama, "--artifacts", store_dir, *opts, ok=False)
    assert result.exit_code == 1, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:")
    assert f"train.adapter=full trains every weight, which needs a bf16 base, but engine.base_format is {base}" \
        in lines[0] and "engine.base_format=bf16" in lines[0]
    assert [p for p in named(store_dir, "") if p != ".locks"] == []  # no quantize, no engine


def test_full_fine_tuning_over_a_4bit_engine_given_by_reference_fails_before_training(tiny_llama, store_dir):
    engine = last_line(cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, *ENGINE[2:],
                           "--build-missing"))
    result = cli("train", "--engine", engine, "--model", tiny_llama, "--artifacts", store_dir, *ENGINE, *TRAIN,
                 *FULL, ok=False)  # the recipe says bf16; the engine given is what counts
    assert result.exit_code == 1 and len(result.stderr.strip().splitlines()) == 1
    assert f"but the engine {engine.name} is nvfp4" in result.stderr and "pass a bf16 engine" in result.stderr
    assert named(store_dir, "train-") == [] and named(store_dir / ".runs", "train-") == []


def test_run_refuses_a_peft_export_of_a_full_run_before_training(tiny_llama, store_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  source: {tiny_llama}\n")
    result = cli("run", recipe, "--artifacts", store_dir, *ENGINE, *TRAIN, *FULL,
                 "--set", "stages=[build-engine, train, export]", ok=False)
    assert result.exit_code == 1 and "export.format=peft with train.adapter=full" in result.stderr
    assert [p for p in named(store_dir, "") if p != ".locks"] == []


def _command(model: Path, store: Path) -> list[str]:
    # A bf16 model: the checkpoints must carry the float32 masters, not their bf16 rounding, for
    # the resumed run to end where the unbroken one does.
    args = ["train", "--model", model, "--artifacts", store, *ENGINE, *TRAIN, *FULL, "--build-missing",
            "--set", "engine.dtype=bfloat16", "--set", "train.steps=10", "--set", "train.checkpoint_every=2",
            "--set", "train.eval_limit=4"]
    return [sys.executable, "-m", "qerl_pipe", *map(str, args)]


@pytest.mark.slow
def test_a_killed_full_run_resumes_bit_identical(tiny_llama, tmp_path):
    reference, run, _ = kill_and_resume(lambda store: _command(tiny_llama, store), tmp_path, 180)
    for rel in ("model/model.safetensors", "checkpoints/step-000010/full_weights.safetensors"):
        assert (run / rel).read_bytes() == (reference / rel).read_bytes(), rel
    masters = load_file(str(run / "checkpoints/step-000010/full_weights.safetensors"))
    assert all(t.dtype == torch.float32 for t in masters.values())
    # The masters hold more than their bf16 rounding: a resume from the model's weights would drift.
    assert any(not torch.equal(t, t.bfloat16().float()) for t in masters.values())
    config = json.loads((run / "model/config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "bfloat16"
    assert_same_training(run, reference)
