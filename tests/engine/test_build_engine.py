"""`qerl-pipe build-engine` and the engine weights on tiny models (CPU): parity with `load_model`,
reuse, limits from the budget, nf4/bf16 bases from the source, errors, and `run` with three stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qerl_pipe.model.random_init import init_random_model
from qerl_pipe.engine.limits import EngineLimits, kv_bytes_per_token
from qerl_pipe.errors import ArtifactError
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.load import load_model
from qerl_pipe.model.lora import LoraSpec, lora_parameters
from qerl_pipe.jobs.engine_artifact import load_engine
from tests.conftest import read_json
from tests.stage_cli import cli, last_line, named

# Weight-only quantize (no calibration pass), no perplexity report, a small CPU engine.
FAST = ["--set", "stages=[quantize, build-engine]", "--set", "quantize.quality.perplexity=never",
        "--set", "engine.max_seq_len=256", "--set", "engine.max_batch=8", "--set", "engine.device=cpu"]
IDS = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(IDS)


def test_build_from_the_quantize_artifact_and_reuse(tiny_llama, store_dir):
    ckpt = last_line(cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *FAST))
    first = cli("build-engine", "--quantized", ckpt, "--artifacts", store_dir, *FAST)
    engine = last_line(first)
    assert engine.parent == store_dir and engine.name.startswith("build-engine-")
    names = {p.name for p in engine.iterdir()}
    assert {"engine.json", "config.json", "engine.safetensors.index.json", "engine-00001-of-00001.safetensors",
            "tokenizer.json", "tokenizer_config.json", "generation_config.json", "manifest.json"} <= names
    spec = read_json(engine / "engine.json")
    assert spec["format_version"] == 1 and spec["base_format"] == "nvfp4" and spec["dtype"] == "float32"
    assert spec["limits"] == {"max_batch": 8, "max_seq_len": 256, "graph_batch_sizes": [],
                              "kv_cache_bytes": spec["limits"]["kv_cache_bytes"], "kv_cache": "bf16"}
    assert spec["dispatch_table"] is None and spec["device"] == {"type": "cpu", "name": "cpu"}
    assert "kernel_table" not in spec  # the Triton configs went with the Triton kernels (issue 51)
    assert "quantization_config" not in read_json(engine / "config.json")  # not the modelopt layout
    manifest = read_json(engine / "manifest.json")
    assert manifest["kind"] == "engine" and manifest["parents"] == [read_json(ckpt / "manifest.json")["id"]]
    assert manifest["config"]["device"] == "cpu" and manifest["config"]["engine"]["max_batch"] == 8
    index = read_json(engine / "engine.safetensors.index.json")
    assert index["weight_map"]["layers.0.self_attn.qkv_proj.qweight"] == "engine-00001-of-00001.safetensors"

    built = (engine / "engine.json").stat().st_mtime_ns
    again = cli("build-engine", "--quantized", ckpt.name, "--artifacts", store_dir, *FAST)
    assert last_line(again) == engine and "up to date" in again.stderr
    # Without --quantized the recipe's quantize artifact is found (not re-made): the same engine.
    found = cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, *FAST)
    assert last_line(found) == engine and found.stderr.count("up to date") == 2
    assert (engine / "engine.json").stat().st_mtime_ns == built
    assert len(named(store_dir, "quantize-")) == 1 and len(named(store_dir, "build-engine-")) == 1

    # --force rebuilds this stage only.
    forced = cli("build-engine", "--quantized", ckpt, "--artifacts", store_dir, "--force", *FAST)
    assert last_line(forced) == engine and "up to date" not in forced.stderr
    cli("verify", engine)


def test_load_engine_matches_load_model_bit_for_bit(tiny_llama, store_dir):
    engine = last_line(cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, "--build-missing", *FAST))
    (ckpt,) = named(store_dir, "quantize-")
    model, limits = load_engine(engine)
    assert model.base_format == "nvfp4" and model.dtype == torch.float32
    assert model.embed_tokens.weight.device.type == "cpu"
    reference = load_model(store_dir / ckpt, "nvfp4", dtype=torch.float32)
    assert torch.equal(logits(model), logits(reference))
    config = DecoderConfig.from_hf(read_json(tiny_llama / "config.json"))
    per_sequence = kv_bytes_per_token(config, torch.float32) * 256
    assert limits == EngineLimits(max_batch=8, max_seq_len=256, kv_cache_bytes=8 * per_sequence)

    with_lora, _ = load_engine(engine, device="cpu", lora=LoraSpec(rank=4, alpha=8))
    assert len(lora_parameters(with_lora)) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    assert torch.equal(logits(with_lora), logits(reference))  # B = 0

    # An engine built before issue 51 also holds the Triton configs it was tuned with: nothing reads
    # them now, and it loads as it is.
    spec = read_json(engine / "engine.json")
    old = {"fwd:nvfp4:m1": {"kernel": "skinny", "block_m": 1, "block_n": 16, "block_k": 64}}
    (engine / "engine.json").write_text(json.dumps({**spec, "kernel_table": old}))
    assert torch.equal(logits(load_engine(engine)[0]), logits(reference))


def test_loading_neither_repacks_nor_quantizes(tiny_llama, store_dir, monkeypatch):
    engine = last_line(cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, "--build-missing", *FAST))
    expected = logits(load_engine(engine)[0])

    def forbidden(*_args, **_kwargs):
        raise AssertionError("the engine loader repacked or quantized a weight")

    for target in ("qerl_pipe.kernels.base_formats.tile_nvfp4", "qerl_pipe.kernels.base_formats.prepare_nf4",
                   "qerl_pipe.kernels.tiled.tile_nvfp4", "qerl_pipe.formats.nvfp4.quantize_nvfp4",
                   "qerl_pipe.formats.nf4.quantize_nf4"):
        monkeypatch.setattr(target, forbidden)
    assert torch.equal(logits(load_engine(engine)[0]), expected)


def test_kv_budget_plans_the_batch(tiny_llama, store_dir):
    config = DecoderConfig.from_hf(read_json(tiny_llama / "config.json"))
    per_sequence = kv_bytes_per_token(config, torch.float32) * 256
    gib = 5.5 * per_sequence / 2**30  # room for 5 sequences, not 6
    engine = last_line(cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, "--build-missing", *FAST,
                           "--set", f"engine.kv_budget_gib={gib!r}"))
    _, limits = load_engine(engine)
    assert limits.max_batch == 5 and limits.kv_cache_bytes == 5 * per_sequence
    assert read_json(engine / "manifest.json")["summary"]["max_batch"] == 5


@pytest.mark.parametrize("fmt", ["nf4", "bf16"])
def test_nf4_and_bf16_engines_read_the_original_model(tiny_qwen2, store_dir, fmt):
    engine = last_line(cli("build-engine", "--model", tiny_qwen2, "--artifacts", store_dir, "--build-missing", *FAST,
                           "--set", f"engine.base_format={fmt}"))
    assert named(store_dir, "quantize-") == []  # no quantization ran
    manifest = read_json(engine / "manifest.json")
    assert manifest["parents"] == [] and "model" in manifest["config"]["base"]
    model, _ = load_engine(engine)
    assert model.base_format == fmt
    reference = load_model(tiny_qwen2, fmt, dtype=torch.float32)  # Qwen2: q/k/v biases travel too
    assert torch.equal(logits(model), logits(reference))


def test_a_chain_may_hand_an_nf4_or_bf16_build_the_quantize_artifact_of_its_own_model(tiny_llama, tiny_qwen2,
                                                                                     store_dir):
    # The Makefile and the DAG pass --quantized whatever the base: the same engine as without it.
    def build(model: Path, *extra: str, ok: bool = True):
        return cli("build-engine", "--model", model, "--artifacts", store_dir, "--build-missing", *FAST,
                   "--set", "engine.base_format=bf16", *extra, ok=ok)

    ckpt = last_line(cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *FAST))
    # A quantize artifact of another model contradicts model.source: refused, nothing written.
    _assert_clean_failure(build(tiny_qwen2, "--quantized", ckpt, ok=False), "quantized from another model",
                          store_dir)
    alone = last_line(build(tiny_llama))
    chained = build(tiny_llama, "--quantized", ckpt)
    assert last_line(chained) == alone and "is not used" in chained.stderr
    assert read_json(alone / "manifest.json")["parents"] == []


# A model built without a config.json (random init) round-trips too: the config is rebuilt from
# DecoderConfig. Small shards force several files.
ROUND_TRIP = {
    "llama3_bias": dict(model_type="llama", architectures=["LlamaForCausalLM"], attention_bias=True, mlp_bias=True,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=32)),
    "qwen2_tied": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32),
}


@pytest.mark.parametrize(("arch", "fmt"), [("llama3_bias", "nvfp4"), ("qwen2_tied", "nf4"), ("qwen3", "bf16")])
def test_engine_weights_round_trip_in_shards(tmp_path, monkeypatch, arch, fmt):
    from qerl_pipe.jobs import engine_weights as weights

    dims = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512)
    config = {**dims, **ROUND_TRIP[arch]}
    model = init_random_model(config, fmt, dtype=torch.bfloat16, seed=3)
    monkeypatch.setattr(weights, "SHARD_BYTES", 40_000)
    weights.save_engine_model(model, tmp_path, hf_config=config)
    shards = sorted(tmp_path.glob("engine-*.safetensors"))
    assert len(shards) > 2 and shards[-1].name.endswith(f"-of-{len(shards):05d}.safetensors")
    loaded = weights.load_engine_model(tmp_path, "cpu")
    assert loaded.config == model.config and loaded.dtype == torch.bfloat16
    assert torch.equal(logits(loaded), logits(model))
    stored = set(read_json(tmp_path / weights.INDEX_NAME)["weight_map"])
    assert ("lm_head.weight" in stored) != model.config.tie_word_embeddings


def test_a_mismatched_engine_is_refused(tmp_path):
    from qerl_pipe.jobs import engine_weights as weights

    dims = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=320, hidden_size=64,
                intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    weights.save_engine_model(init_random_model(dims, "nvfp4"), tmp_path, hf_config=dims)
    config = read_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ArtifactError, match="do not match the model"):
        weights.load_engine_model(tmp_path, "cpu")


def test_an_nf4_engine_of_the_old_byte_layout_is_refused(tmp_path):
    """NF4 engines before layout 2 held our own nibble order: read as bitsandbytes' bytes they would
    decode to other weights, so their index (without `base_layout_version`) is refused with the fix."""
    from qerl_pipe.jobs import engine_weights as weights

    dims = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=320, hidden_size=64,
                intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    weights.save_engine_model(init_random_model(dims, "nf4"), tmp_path, hf_config=dims)
    index = read_json(tmp_path / weights.INDEX_NAME)
    assert index["metadata"]["base_layout_version"] == 2
    del index["metadata"]["base_layout_version"]
    (tmp_path / weights.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ArtifactError, match=r"nf4 weights are in layout 1, this version reads layout 2.*--force"):
        weights.load_engine_model(tmp_path, "cpu")


def _assert_clean_failure(result, needle: str, store_dir: Path) -> None:
    assert result.exit_code == 1, result.stdout
    assert needle in result.stderr, result.stderr
    assert result.stderr.strip().startswith("error:") and len(result.stderr.strip().splitlines()) == 1
    assert named(store_dir, "build-engine") == [] and named(store_dir, ".tmp-") == []


def test_bad_inputs_fail_cleanly(tiny_llama, store_dir):
    def build(*extra: str):
        return cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, "--build-missing", *FAST, *extra,
                   ok=False)

    _assert_clean_failure(build("--set", "engine.kv_budget_gib=1e-7"), "KV cache", store_dir)
    assert named(store_dir, "quantize-") == []  # refused before quantizing anything
    _assert_clean_failure(build("--set", "engine.max_seq_len=4096"), "max_position_embeddings", store_dir)
    _assert_clean_failure(build("--set", "engine.cuda_graphs=on"), "needs a CUDA device", store_dir)
    _assert_clean_failure(build("--set", "engine.tune_kernels=on"), "needs a CUDA device", store_dir)
    _assert_clean_failure(build("--set", "engine.max_batch=0"), "'engine.max_batch'", store_dir)
    _assert_clean_failure(build("--set", "engine.base_format=int4"), "'engine.base_format'", store_dir)
    _assert_clean_failure(build("--quantized", "nope"), "no artifact 'nope'", store_dir)

    ckpt = last_line(cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *FAST))
    from_ckpt = cli("build-engine", "--model", ckpt, "--artifacts", store_dir, *FAST,
                    "--set", "engine.base_format=nf4", ok=False)
    _assert_clean_failure(from_ckpt, "NVFP4 checkpoint", store_dir)
    with pytest.raises(ArtifactError, match="not an engine"):
        load_engine(ckpt)


def test_run_chains_three_stages_and_reuses_them(tiny_llama, store_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stages: [calibrate, quantize, build-engine]\nmodel:\n  source: {tiny_llama}\n"
                      "calibrate:\n  num_samples: 2\n  seq_len: 16\n"
                      "quantize:\n  quality:\n    perplexity: never\n"
                      "engine:\n  max_seq_len: 128\n  max_batch: 4\n  device: cpu\n")
    first = cli("run", recipe, "--artifacts", store_dir)
    engine = last_line(first)
    assert engine.name.startswith("build-engine-")
    for stage in ("calibrate", "quantize", "build-engine"):
        assert f"{stage}: {store_dir}" in first.stderr
    # stdout: each artifact's path in stage order, the last stage's last (as the README says).
    assert [Path(p).name.split("-")[0] for p in first.stdout.split()] == ["calibrate", "quantize", "build"]
    (quantized,) = named(store_dir, "quantize-")
    assert read_json(engine / "manifest.json")["parents"] == [quantized.removeprefix("quantize-")]
    assert read_json(store_dir / quantized / "manifest.json")["summary"]["quant_algo"] == "NVFP4"  # calibrated
    assert read_json(engine / "engine.json")["limits"]["max_batch"] == 4
    second = cli("run", recipe, "--artifacts", store_dir)
    assert last_line(second) == engine and second.stderr.count("up to date") == 3


def test_a_report_setting_makes_a_new_quantize_whose_children_are_reused(tiny_llama, store_dir, tmp_path):
    """quantize.quality.* changes the quantize artifact (its report) but no byte build-engine reads:
    the engine of the first is the engine of the second (children take the parent's content)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stages: [quantize, build-engine]\nmodel:\n  source: {tiny_llama}\n"
                      "quantize:\n  quality:\n    perplexity: always\n    num_samples: 2\n    seq_len: 16\n"
                      "engine:\n  max_seq_len: 128\n  max_batch: 4\n  device: cpu\n")
    first = cli("run", recipe, "--artifacts", store_dir)
    for setting in ("quantize.quality.num_samples=3", "quantize.quality.perplexity=never"):
        again = cli("run", recipe, "--artifacts", store_dir, "--set", setting)
        assert last_line(again) == last_line(first), setting  # the same engine
        assert "build-engine: up to date" in again.stderr and "quantize: up to date" not in again.stderr
    assert len(named(store_dir, "quantize-")) == 3 and len(named(store_dir, "build-engine-")) == 1
    engine = read_json(last_line(first) / "manifest.json")
    (quantized,) = engine["parents"]
    assert engine["parent_identities"] == [read_json(store_dir / f"quantize-{quantized}" / "manifest.json")["content"]]
    # A setting that changes the weights is a new engine.
    other = cli("run", recipe, "--artifacts", store_dir, "--set", "quantize.method=mse")
    assert last_line(other) != last_line(first)


def test_nan_weights_are_refused_before_any_artifact(tiny_llama, store_dir, tmp_path):
    """A damaged model (one NaN weight) gets a one-line error from calibrate and from a bf16
    build-engine, and no artifact."""
    import shutil

    from safetensors.torch import load_file, save_file

    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_llama, damaged)
    tensors = load_file(str(damaged / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    for args in (["calibrate", "--set", "calibrate.num_samples=2", "--set", "calibrate.seq_len=16"],
                 ["build-engine", *FAST, "--set", "engine.base_format=bf16"]):
        result = cli(args[0], "--model", damaged, "--artifacts", store_dir, *args[1:], ok=False)
        last = result.stderr.strip().splitlines()[-1]
        assert result.exit_code == 1 and last.startswith("error:") and "non-finite" in last, result.stderr
        assert not named(store_dir, args[0] + "-")


def test_run_and_build_missing_check_the_engine_against_the_model_before_any_stage(tiny_llama, store_dir, tmp_path):
    """engine.max_seq_len past the model's positions is refused before calibrate or quantize run
    (by `run`, and by a train that would build its engine), with nothing in the store."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  source: {tiny_llama}\nengine:\n  max_seq_len: 1024\n  device: cpu\n")
    for command in (["run", recipe], ["train", "--recipe", recipe, "--build-missing"]):
        result = cli(*command, "--artifacts", store_dir, ok=False)
        assert result.exit_code == 1 and "exceeds the model's max_position_embeddings (512)" in result.stderr
        assert result.stderr.strip().startswith("error:") and len(result.stderr.strip().splitlines()) == 1
        assert [p for p in named(store_dir, "") if p != ".locks"] == []  # no calibration, no quantize


def test_a_gguf_source_is_checked_from_its_metadata_before_it_is_imported(tiny_llama, store_dir):
    """The packaged SmolLM2 GGUF (8192 positions): a longer engine, and a calibration of another
    model, are refused before the minute-long import."""
    result = cli("run", Path(__file__).parents[2] / "recipes" / "quickstart.yaml", "--artifacts", store_dir, "--set", "engine.max_seq_len=9000",
                 ok=False)
    assert result.exit_code == 1 and "max_position_embeddings (8192)" in result.stderr, result.stderr
    calibration = last_line(cli("calibrate", "--model", tiny_llama, "--artifacts", store_dir, "--set",
                                "calibrate.num_samples=2", "--set", "calibrate.seq_len=16"))
    result = cli("quantize", "--model", "smollm2-135m-instruct", "--calibration", calibration, "--artifacts",
                 store_dir, ok=False)
    assert result.exit_code == 1 and "was made for another model" in result.stderr, result.stderr
    assert named(store_dir, "import-") == [] and named(store_dir, "quantize-") == []
