"""`qerl-pipe export` on tiny random models (CPU, float32): each format's logits against our in-engine
model with the adapter applied, the modelopt layout of merged-nvfp4, the dequantized-NVFP4 fallback,
bad inputs that write nothing, and reuse.

Runs are made directly in the store (a `run` artifact over a real engine, its adapter written by
`save_adapter` with random nonzero A, B and norms), so every test exercises a trained-looking
adapter without minutes of RL; `test_pipeline_trains_and_exports` goes through the real train stage.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qerl_pipe.artifacts import ArtifactStore, load_artifact
from qerl_pipe.formats.modelopt_layout import config_quantization_config
from qerl_pipe.formats.nvfp4 import global_scale_from_amax, quantize_nvfp4
from qerl_pipe.model.peft import load_adapter_weights, save_adapter
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.load import load_model
from qerl_pipe.model.lora import LoraSpec, apply_lora
from qerl_pipe.model.norm import RMSNorm
from qerl_pipe.recipe import load_recipe
from qerl_pipe.jobs.engine_artifact import load_engine
from qerl_pipe.dag import BUILD_ENGINE, CALIBRATE, QUANTIZE
from qerl_pipe.pipeline import run_stage
from qerl_pipe.formats import checkpoint
from tests.conftest import make_tiny_model, read_json
from tests.stage_cli import cli, last_line

SPEC = LoraSpec(rank=4, alpha=8.0)
SPEC_NORMS = LoraSpec(rank=4, alpha=8.0, train_norms=True)
ENGINE = ["quantize.quality.perplexity=never", "engine.max_seq_len=64", "engine.max_batch=4", "engine.device=cpu",
          "engine.dtype=float32"]
F32 = ["--set", "export.dtype=float32"]


def exports(store: Path) -> list[str]:
    if not store.exists():
        return []
    return sorted(p.name for p in store.iterdir() if p.name.startswith(("export-", ".tmp-export")))


def make_engine(model_dir: Path, store: ArtifactStore, base_format: str):
    recipe = load_recipe(None, [f"model.source={model_dir}", f"engine.base_format={base_format}", *ENGINE])
    quantized = run_stage(QUANTIZE, recipe, store) if base_format == "nvfp4" else None
    return run_stage(BUILD_ENGINE, recipe, store, quantized=quantized)


def make_run(store: ArtifactStore, engine, spec: LoraSpec, seed: int = 1):
    """A `run` artifact over `engine` whose adapter has random nonzero A, B (and norms)."""
    model, _ = load_engine(engine.path, "cpu")
    apply_lora(model, spec, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, QuantLinear):
                for b in m.lora_B.values():
                    b.copy_(0.05 * torch.randn(b.shape, generator=gen))
            elif isinstance(m, RMSNorm) and spec.train_norms:
                m.weight.mul_(1 + 0.2 * torch.randn(m.weight.shape, generator=gen))
    config = {"test": "export", "spec": repr(spec), "seed": seed}
    with store.create(stage="train", stage_version=1, kind="run", config=config, parents=[engine.id]) as (pending, _):
        save_adapter(model, spec, pending.dir / "adapter", "tiny")
    return store.find_existing("train", pending.id)


def ours(engine, run, spec: LoraSpec):
    """Our in-engine model with the run's adapter applied."""
    model, _ = load_engine(engine.path, "cpu", lora=spec)
    load_adapter_weights(model, run.path / "adapter" / "adapter_model.safetensors")
    return model


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


IDS = torch.randint(3, 300, (2, 11), generator=torch.Generator().manual_seed(0))


def logits_of(model) -> torch.Tensor:
    """[B, T, vocab] float32 logits of our Decoder or a transformers / PEFT model."""
    with torch.no_grad():
        return model.logits(IDS) if isinstance(model, Decoder) else model(input_ids=IDS).logits


@pytest.fixture(scope="module")
def llama_copy(tiny_llama, tmp_path_factory) -> Path:
    """A copy of the tiny model that a test may take away (to make the original base unavailable)."""
    return Path(shutil.copytree(tiny_llama, tmp_path_factory.mktemp("src") / "tiny-llama"))


@pytest.mark.parametrize("spec", [SPEC, SPEC_NORMS], ids=["lora", "lora+norms"])
def test_peft_reproduces_our_logits(tiny_llama, store_dir, spec):
    from peft import PeftModel

    store = ArtifactStore(store_dir)
    engine = make_engine(tiny_llama, store, "bf16")
    run = make_run(store, engine, spec)
    out = last_line(cli("export", "--run", run.path, "--format", "peft", "--artifacts", store_dir))
    manifest = read_json(out / "manifest.json")
    assert manifest["kind"] == "export-peft" and manifest["parents"] == [run.id]
    assert set(manifest["files"]) == {"adapter_model.safetensors", "adapter_config.json"}
    config = read_json(out / "adapter_config.json")
    assert (config["modules_to_save"] is not None) == spec.train_norms

    peft_model = PeftModel.from_pretrained(hf_model(tiny_llama), str(out)).eval()
    want = logits_of(ours(engine, run, spec))
    torch.testing.assert_close(logits_of(peft_model), want, atol=1e-4, rtol=1e-4)
    with peft_model.disable_adapter():
        assert (logits_of(peft_model) - want).abs().max() > 1e-3  # the adapter matters


@pytest.mark.parametrize("arch, spec", [("llama", SPEC), ("qwen2", SPEC_NORMS)], ids=["llama", "qwen2+norms"])
def test_merged_bf16_from_the_original_base(tiny_llama, tiny_qwen2, store_dir, arch, spec):
    from transformers import AutoTokenizer

    source = tiny_llama if arch == "llama" else tiny_qwen2
    store = ArtifactStore(store_dir)
    engine = make_engine(source, store, "bf16")
    run = make_run(store, engine, spec)
    out = last_line(cli("export", "--run", run.path, "--format", "merged-bf16", *F32, "--artifacts", store_dir))
    manifest = read_json(out / "manifest.json")
    assert manifest["kind"] == "export-merged-bf16" and manifest["summary"]["base_dequantized"] is False
    assert manifest["summary"]["trained_norms"] == (5 if spec.train_norms else 0)  # 2 per layer + the final one
    config = read_json(out / "config.json")
    assert "quantization_config" not in config
    tokenizers = [AutoTokenizer.from_pretrained(str(d)) for d in (out, source)]
    assert tokenizers[0].encode("12 + 30") == tokenizers[1].encode("12 + 30")
    assert (out / "generation_config.json").is_file()
    merged = logits_of(hf_model(out))
    torch.testing.assert_close(merged, logits_of(ours(engine, run, spec)), atol=1e-4, rtol=1e-4)


def test_merged_bf16_default_dtype_is_the_models(tiny_llama, store_dir):
    store = ArtifactStore(store_dir)
    engine = make_engine(tiny_llama, store, "bf16")
    out = last_line(cli("export", "--run", make_run(store, engine, SPEC).path, "--format", "merged-bf16",
                        "--artifacts", store_dir))
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert {fh.get_slice(k).get_dtype() for k in fh.keys()} == {"BF16"}
    assert read_json(out / "config.json").get("torch_dtype", read_json(out / "config.json").get("dtype")) == "bfloat16"


def test_merged_formats_over_nvfp4_and_the_dequantized_fallback(llama_copy, store_dir):
    from peft import PeftModel

    store = ArtifactStore(store_dir)
    engine = make_engine(llama_copy, store, "nvfp4")
    run = make_run(store, engine, SPEC_NORMS)

    # The original bf16 model is there: the merge starts from it (what PEFT over it computes).
    original = last_line(cli("export", "--run", run.path, "--format", "merged-bf16", *F32, "--artifacts", store_dir))
    assert read_json(original / "manifest.json")["summary"]["base_dequantized"] is False
    peft_dir = last_line(cli("export", "--run", run.path, "--artifacts", store_dir))
    peft_logits = logits_of(PeftModel.from_pretrained(hf_model(llama_copy), str(peft_dir)).eval())
    torch.testing.assert_close(logits_of(hf_model(original)), peft_logits, atol=1e-4, rtol=1e-4)

    # Without it, the NVFP4 checkpoint is dequantized: exactly our NVFP4 model with the adapter.
    moved = llama_copy.with_name("moved-away")
    llama_copy.rename(moved)
    try:
        result = cli("export", "--run", run.path, "--format", "merged-bf16", *F32, "--artifacts", store_dir)
    finally:
        moved.rename(llama_copy)
    fallback = last_line(result)
    assert fallback != original and "dequantized NVFP4 checkpoint" in result.stderr
    manifest = read_json(fallback / "manifest.json")
    assert manifest["summary"]["base_dequantized"] is True and "no longer exists" in manifest["summary"]["base"]
    (quantized,) = [p.name.removeprefix("quantize-") for p in store_dir.glob("quantize-*")]
    assert manifest["parents"] == [run.id, quantized]
    want = logits_of(ours(engine, run, SPEC_NORMS))
    torch.testing.assert_close(logits_of(hf_model(fallback)), want, atol=1e-4, rtol=1e-4)


def test_merged_nvfp4_is_the_modelopt_layout_of_the_merged_model(tiny_llama, store_dir):
    store = ArtifactStore(store_dir)
    engine = make_engine(tiny_llama, store, "bf16")
    run = make_run(store, engine, SPEC_NORMS)
    merged = last_line(cli("export", "--run", run.path, "--format", "merged-bf16", *F32, "--artifacts", store_dir))
    out = last_line(cli("export", "--run", run.path, "--format", "merged-nvfp4", *F32, "--artifacts", store_dir))
    manifest = read_json(out / "manifest.json")
    assert manifest["kind"] == "export-merged-nvfp4" and manifest["summary"]["quant_algo"] == "W4A16_NVFP4"

    hf_quant = read_json(out / "hf_quant_config.json")["quantization"]
    assert hf_quant == {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                        "exclude_modules": ["lm_head"]}
    assert read_json(out / "config.json")["quantization_config"] == config_quantization_config(
        "W4A16_NVFP4", ["lm_head"], read_json(out / "hf_quant_config.json")["producer"]["version"])
    assert (out / "tokenizer.json").is_file()

    # Every linear: U8 codes, E4M3 block scales, a 0-dim F32 global scale shared by q/k/v and
    # gate/up, no input_scale; the bytes are our (modelopt-exact) quantizer's of the merged weights.
    with safe_open(str(out / "model.safetensors"), "pt") as q, safe_open(str(merged / "model.safetensors"), "pt") as m:
        keys = set(q.keys())
        assert not any(k.endswith("input_scale") for k in keys)
        for layer in range(2):
            for group in (("self_attn", "q_proj", "k_proj", "v_proj"), ("mlp", "gate_proj", "up_proj"),
                          ("self_attn", "o_proj"), ("mlp", "down_proj")):
                names = [f"model.layers.{layer}.{group[0]}.{p}" for p in group[1:]]
                dense = [m.get_tensor(f"{n}.weight") for n in names]
                scale = global_scale_from_amax(torch.stack([w.abs().amax() for w in dense]).amax())
                for name, w in zip(names, dense):
                    assert q.get_slice(f"{name}.weight").get_dtype() == "U8"
                    assert q.get_slice(f"{name}.weight_scale").get_dtype() == "F8_E4M3"
                    assert q.get_tensor(f"{name}.weight_scale_2").shape == ()
                    ref = quantize_nvfp4(w, scale)
                    assert torch.equal(q.get_tensor(f"{name}.weight"), ref.packed)
                    assert torch.equal(q.get_tensor(f"{name}.weight_scale").view(torch.uint8),
                                       ref.block_scales.view(torch.uint8))
                    assert torch.equal(q.get_tensor(f"{name}.weight_scale_2"), scale)
        for dense_name in ("lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"):
            assert torch.equal(q.get_tensor(dense_name), m.get_tensor(dense_name))

    # Our loader reads it as the NVFP4 model of the merged weights, bit for bit ...
    nvfp4_logits = logits_of(load_model(out, "nvfp4", torch.float32))
    assert torch.equal(nvfp4_logits, logits_of(load_model(merged, "nvfp4", torch.float32)))
    # ... and close to the merged model: the only difference is NVFP4's weight rounding (~9-10%
    # relative per Gaussian weight), which moves this random 2-layer model's logits by ~15% (norm of
    # the difference over the norm of the logits; quantizing the base alone: ~14%). So the bound is
    # relative to that of the base, not a fixed small tolerance.
    reference = logits_of(hf_model(merged))
    relative = ((nvfp4_logits - reference).norm() / reference.norm()).item()
    base_relative = ((logits_of(load_model(tiny_llama, "nvfp4", torch.float32))
                      - logits_of(load_model(tiny_llama, "bf16", torch.float32))).norm()
                     / logits_of(load_model(tiny_llama, "bf16", torch.float32)).norm()).item()
    assert relative < 0.25 and relative < 2 * base_relative, (relative, base_relative)


def test_merged_nvfp4_keeps_the_calibrated_input_scales(tiny_llama, store_dir):
    store = ArtifactStore(store_dir)
    recipe = load_recipe(None, [f"model.source={tiny_llama}", *ENGINE, "calibrate.num_samples=4",
                                "calibrate.seq_len=16", "calibrate.device=cpu"])
    quantized = run_stage(QUANTIZE, recipe, store, calibration=run_stage(CALIBRATE, recipe, store))
    engine = run_stage(BUILD_ENGINE, recipe, store, quantized=quantized)
    run = make_run(store, engine, SPEC)
    out = last_line(cli("export", "--run", run.path, "--format", "merged-nvfp4", "--artifacts", store_dir))
    assert read_json(out / "hf_quant_config.json")["quantization"]["quant_algo"] == "NVFP4"
    with safe_open(str(out / "model.safetensors"), "pt") as q, \
            safe_open(str(quantized.path / "model.safetensors"), "pt") as base:
        scales = [k for k in q.keys() if k.endswith("input_scale")]
        assert len(scales) == 14 and all(torch.equal(q.get_tensor(k), base.get_tensor(k)) for k in scales)
    weight_only = last_line(cli("export", "--run", run.path, "--format", "merged-nvfp4", "--set",
                                "export.calibration=none", "--artifacts", store_dir))
    assert read_json(weight_only / "hf_quant_config.json")["quantization"]["quant_algo"] == "W4A16_NVFP4"


def test_sharded_base_streams_into_sharded_exports(store_dir, tmp_path, monkeypatch):
    """A base in many shards (fused groups split across them) and outputs cut into many shards."""
    source = make_tiny_model(tmp_path / "sharded", "llama", shard_mb=0.05)
    assert len(list(source.glob("*.safetensors"))) > 3
    monkeypatch.setattr(checkpoint, "SHARD_BYTES", 60_000)
    store = ArtifactStore(store_dir)
    engine = make_engine(source, store, "bf16")
    run = make_run(store, engine, SPEC_NORMS)
    merged = last_line(cli("export", "--run", run.path, "--format", "merged-bf16", *F32, "--artifacts", store_dir))
    quantized = last_line(cli("export", "--run", run.path, "--format", "merged-nvfp4", *F32, "--artifacts", store_dir))
    for out in (merged, quantized):
        index = read_json(out / "model.safetensors.index.json")
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and files == sorted(p.name for p in out.glob("model-*.safetensors"))
        assert not list(out.glob(".part-*"))
    torch.testing.assert_close(logits_of(hf_model(merged)), logits_of(ours(engine, run, SPEC_NORMS)),
                               atol=1e-4, rtol=1e-4)
    assert torch.equal(logits_of(load_model(quantized, "nvfp4", torch.float32)),
                       logits_of(load_model(merged, "nvfp4", torch.float32)))


def test_rerun_reuses_the_artifact(tiny_llama, store_dir):
    store = ArtifactStore(store_dir)
    run = make_run(store, make_engine(tiny_llama, store, "bf16"), SPEC)
    first = last_line(cli("export", "--run", run.path, "--format", "merged-bf16", "--artifacts", store_dir))
    again = cli("export", "--run", run.id, "--format", "merged-bf16", "--artifacts", store_dir)
    assert last_line(again) == first and "export: up to date" in again.stderr
    forced = cli("export", "--run", run.id, "--format", "merged-bf16", "--artifacts", store_dir, "--force")
    assert last_line(forced) == first and "up to date" not in forced.stderr
    cli("verify", first)
    # Keys that do not change a PEFT export do not name a new one.
    peft = last_line(cli("export", "--run", run.id, "--artifacts", store_dir))
    assert last_line(cli("export", "--run", run.id, "--artifacts", store_dir, "--set", "export.dtype=float16")) == peft


def test_bad_inputs_fail_before_writing_anything(tiny_llama, store_dir, tmp_path):
    store = ArtifactStore(store_dir)
    source = Path(shutil.copytree(tiny_llama, tmp_path / "m"))
    engine = make_engine(source, store, "bf16")
    run = make_run(store, engine, SPEC)

    def fails(*args: str, needle: str) -> None:
        result = cli("export", *args, "--artifacts", store_dir, ok=False)
        assert result.exit_code == 1, result.stdout
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], result.stderr
        assert exports(store_dir) == []

    fails("--run", str(engine.path), needle="is a 'engine' artifact, not a run")
    fails("--run", run.id, "--format", "gguf", needle="'export.format'")
    fails("--run", "no-such-run", needle="no artifact 'no-such-run'")
    fails("--run", run.id, "--set", "export.bogus=1", needle="unknown key 'export.bogus'")
    stat = (source / "config.json").stat()  # the model source changed since the engine was built from it
    os.utime(source / "config.json", (stat.st_atime, stat.st_mtime + 100))
    fails("--run", run.id, "--format", "merged-bf16", needle="cannot be found")
    shutil.rmtree(engine.path)
    fails("--run", run.id, "--format", "merged-nvfp4", needle="not in")


def test_pipeline_trains_and_exports(tiny_llama, store_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stages: [quantize, build-engine, train, export]\nmodel:\n  source: {tiny_llama}\n"
                      "export:\n  format: merged-nvfp4\n")
    args = ["--set", "quantize.quality.perplexity=never", "--set", "engine.max_seq_len=64", "--set",
            "engine.max_batch=8", "--set", "engine.device=cpu", "--set", "train.steps=1", "--set",
            "train.prompts_per_step=2", "--set", "train.group_size=2", "--set", "train.max_new_tokens=4",
            "--set", "train.eval_limit=0", "--set", "train.device=cpu"]
    out = last_line(cli("run", recipe, "--artifacts", store_dir, *args))
    artifact = load_artifact(out)
    (run,) = [p for p in store_dir.glob("train-*")]
    assert artifact.kind == "export-merged-nvfp4" and artifact.manifest["parents"][0] == run.name.removeprefix("train-")
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "W4A16_NVFP4"
    load_model(out, "nvfp4", torch.float32)  # loads
