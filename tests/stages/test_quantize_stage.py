"""`qerl-pipe calibrate` / `quantize` / `verify` end to end on tiny random models (CPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.conftest import make_tiny_model, read_json
from tests.stage_cli import cli, last_line

FAST = ["--set", "quantize.quality.perplexity=never"]
CAL = ["--set", "calibrate.num_samples=4", "--set", "calibrate.seq_len=32", "--set", "calibrate.batch_size=2"]


def on_disk(ckpt: Path) -> dict[str, tuple[str, tuple]]:
    """name -> (safetensors dtype string, shape) as written in the files."""
    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        header_len = int.from_bytes(shard.read_bytes()[:8], "little")
        header = json.loads(shard.read_bytes()[8:8 + header_len])
        out.update({k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"})
    return out


def load_all(ckpt: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in ckpt.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as fh:
            tensors.update({k: fh.get_tensor(k) for k in fh.keys()})
    return tensors


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sharded"), "llama", shard_mb=0.1)


def test_quantize_writes_the_modelopt_layout_and_reuses_it(sharded_llama, store_dir):
    first = cli("quantize", "--model", sharded_llama, "--artifacts", store_dir, *FAST)
    ckpt = last_line(first)
    assert ckpt.parent == store_dir and ckpt.name.startswith("quantize-")
    names = {p.name for p in ckpt.iterdir()}
    assert {"config.json", "hf_quant_config.json", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "generation_config.json", "manifest.json", "quality.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) == 3  # one output shard per input shard

    header = on_disk(ckpt)
    q = "model.layers.0.self_attn.q_proj"
    assert header[f"{q}.weight"] == ("U8", (64, 32))
    assert header[f"{q}.weight_scale"] == ("F8_E4M3", (64, 4))
    assert header[f"{q}.weight_scale_2"] == ("F32", ())
    assert f"{q}.input_scale" not in header  # no calibration: weight-only
    assert header["model.embed_tokens.weight"][0] == "BF16"
    assert header["lm_head.weight"][0] == "BF16"
    assert header["model.layers.0.input_layernorm.weight"][0] == "BF16"

    tensors = load_all(ckpt)
    for layer in range(2):
        qkv = [tensors[f"model.layers.{layer}.self_attn.{p}_proj.weight_scale_2"] for p in "qkv"]
        assert qkv[0] == qkv[1] == qkv[2]
        gate_up = [tensors[f"model.layers.{layer}.mlp.{p}_proj.weight_scale_2"] for p in ("gate", "up")]
        assert gate_up[0] == gate_up[1]

    config = read_json(ckpt / "config.json")
    assert config["quantization_config"]["quant_algo"] == "W4A16_NVFP4"
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    hf_quant = read_json(ckpt / "hf_quant_config.json")["quantization"]
    assert hf_quant == {"quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                        "exclude_modules": ["lm_head"]}
    index = read_json(ckpt / "model.safetensors.index.json")
    assert set(index["weight_map"]) == set(header)

    from transformers import AutoConfig, AutoTokenizer
    assert AutoTokenizer.from_pretrained(str(ckpt)).eos_token == "</s>"
    assert AutoConfig.from_pretrained(str(ckpt)).hidden_size == 64

    manifest = read_json(ckpt / "manifest.json")
    assert manifest["kind"] == "nvfp4-checkpoint" and manifest["stage"]["name"] == "quantize"
    assert manifest["summary"]["quantized_linears"] == 14
    assert 0 < manifest["summary"]["mean_relative_error"] < 0.15

    second = cli("quantize", "--model", sharded_llama, "--artifacts", store_dir, *FAST)
    assert last_line(second) == ckpt
    assert "up to date" in second.stderr


def test_whole_model_is_byte_exact_with_modelopt(sharded_llama, store_dir):
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    ckpt = last_line(cli("quantize", "--model", sharded_llama, "--artifacts", store_dir, *FAST))
    ours = load_all(ckpt)
    original = load_all(sharded_llama)
    groups = {"self_attn": ("q", "k", "v"), "mlp": ("gate", "up")}
    checked = 0
    for layer in range(2):
        for block, members in list(groups.items()) + [("self_attn", ("o",)), ("mlp", ("down",))]:
            names = [f"model.layers.{layer}.{block}.{m}_proj" for m in members]
            amax = torch.stack([original[f"{n}.weight"].float().abs().amax() for n in names]).amax()
            scale_2 = amax.float() / (6.0 * 448.0)
            for name in names:
                qt, scale, s2 = NVFP4QTensor.quantize(original[f"{name}.weight"], 16, None, scale_2, try_tensorrt=False)
                assert torch.equal(ours[f"{name}.weight"], qt._quantized_data), name
                assert torch.equal(ours[f"{name}.weight_scale"].view(torch.uint8), scale.view(torch.uint8)), name
                assert torch.equal(ours[f"{name}.weight_scale_2"].view(torch.int32), s2.float().reshape(()).view(torch.int32))
                checked += 1
    assert checked == 14


def test_calibrated_quantize_is_nvfp4_with_shared_input_scales(tiny_qwen2, store_dir):
    cal = last_line(cli("calibrate", "--model", tiny_qwen2, "--artifacts", store_dir, *CAL))
    stats = read_json(cal / "calibration.json")
    assert stats["tokens"] == 4 * 32
    assert stats["linears"]["model.layers.0.self_attn.q_proj"]["input_amax"] > 0
    ckpt = last_line(cli("quantize", "--model", tiny_qwen2, "--calibration", cal, "--artifacts", store_dir, *FAST))
    config = read_json(ckpt / "config.json")["quantization_config"]
    assert config["quant_algo"] == "NVFP4" and "input_activations" in config["config_groups"]["group_0"]
    tensors = load_all(ckpt)
    prefix = "model.layers.1.self_attn"
    scales = [tensors[f"{prefix}.{p}_proj.input_scale"] for p in "qkv"]
    assert scales[0].shape == () and scales[0] == scales[1] == scales[2]
    expected = max(stats["linears"][f"{prefix}.{p}_proj"]["input_amax"] for p in "qkv") / 2688
    assert float(scales[0]) == pytest.approx(expected, rel=1e-6)
    assert f"{prefix}.q_proj.bias" in tensors  # Qwen2's q/k/v biases stay 16-bit
    assert read_json(ckpt / "manifest.json")["parents"] == [read_json(cal / "manifest.json")["id"]]


def test_run_chains_calibrate_and_quantize_and_skips_when_up_to_date(tiny_llama, store_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stages: [calibrate, quantize]\nmodel:\n  source: {tiny_llama}\n"
                      "calibrate:\n  num_samples: 2\n  seq_len: 16\n"
                      "quantize:\n  quality:\n    perplexity: always\n    num_samples: 2\n    seq_len: 16\n")
    first = cli("run", recipe, "--artifacts", store_dir)
    ckpt = last_line(first)
    summary = read_json(ckpt / "manifest.json")["summary"]
    assert summary["quant_algo"] == "NVFP4"
    assert summary["perplexity"]["bf16"] > 1 and summary["perplexity"]["nvfp4_w4a16"] > 1
    second = cli("run", recipe, "--artifacts", store_dir)
    assert last_line(second) == ckpt and second.stderr.count("up to date") == 2


def test_verify_catches_a_flipped_byte_and_the_damaged_artifact_is_not_reused(tiny_llama, store_dir):
    ckpt = last_line(cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *FAST))
    assert last_line(cli("verify", ckpt.name, "--artifacts", store_dir)) == ckpt
    shard = ckpt / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    bad = cli("verify", ckpt, ok=False)
    assert bad.exit_code == 1 and "sha256" in bad.stderr
    again = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *FAST, ok=False)
    assert again.exit_code == 1 and "damaged" in again.stderr and "--force" in again.stderr
    fixed = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, "--force", *FAST)
    assert last_line(fixed) == ckpt
    cli("verify", ckpt)


def test_ls_and_show(tiny_llama, store_dir):
    ckpt = last_line(cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *FAST))
    listing = cli("ls", "--artifacts", store_dir).stdout
    assert ckpt.name in listing and "nvfp4-checkpoint" in listing
    shown = json.loads(cli("show", ckpt.name.split("-")[1][:8], "--artifacts", store_dir).stdout)
    assert shown["kind"] == "nvfp4-checkpoint"


def test_output_copy_and_refusal_to_overwrite(tiny_llama, store_dir, tmp_path):
    out = tmp_path / "exported"
    cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, "--output", out, *FAST)
    assert (out / "hf_quant_config.json").is_file() and (out / "model.safetensors").is_file()
    again = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, "--output", out, *FAST)
    assert "already holds this checkpoint" in again.stderr  # the same command twice is not an error
    other = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, "--output", out, *FAST,
                "--set", "quantize.method=mse", ok=False)
    assert other.exit_code == 1 and "not empty" in other.stderr  # another checkpoint never replaces it
    (out / "config.json").write_text("{}")
    edited = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, "--output", out, *FAST, ok=False)
    assert edited.exit_code == 1 and "not empty" in edited.stderr and (out / "config.json").read_text() == "{}"
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep me")
    result = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, "--output", taken, *FAST, ok=False)
    assert result.exit_code == 1 and "not empty" in result.stderr
    assert [p.name for p in taken.iterdir()] == ["mine.txt"]


def _assert_clean_failure(result, needle: str, store_dir: Path) -> None:
    assert result.exit_code == 1, result.stdout
    assert needle in result.stderr, result.stderr
    assert result.stderr.strip().startswith("error:") and len(result.stderr.strip().splitlines()) == 1
    leftovers = [p.name for p in store_dir.iterdir() if p.name.startswith("quantize")] if store_dir.exists() else []
    assert leftovers == [] and not [p for p in store_dir.glob(".tmp-*")] if store_dir.exists() else True


def test_bad_inputs_fail_cleanly(tmp_path, store_dir, tiny_llama):
    missing = cli("quantize", "--model", tmp_path / "nope", "--artifacts", store_dir, ok=False)
    _assert_clean_failure(missing, "not a model directory", store_dir)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_llama / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"\x80")
    _assert_clean_failure(cli("quantize", "--model", pickled, "--artifacts", store_dir, ok=False), "pickle", store_dir)

    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, gpt2)
    config = read_json(gpt2 / "config.json")
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (gpt2 / "config.json").write_text(json.dumps(config))
    _assert_clean_failure(cli("quantize", "--model", gpt2, "--artifacts", store_dir, ok=False), "GPT2", store_dir)

    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_llama, truncated)
    shard = truncated / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _assert_clean_failure(cli("quantize", "--model", truncated, "--artifacts", store_dir, *FAST, ok=False),
                          "model.safetensors", store_dir)


def test_in_features_not_a_multiple_of_16_is_an_error(tmp_path, store_dir):
    odd = make_tiny_model(tmp_path / "odd", "llama", intermediate_size=72)  # down_proj has in_features 72
    result = cli("quantize", "--model", odd, "--artifacts", store_dir, *FAST, ok=False)
    _assert_clean_failure(result, "multiple of 16", store_dir)
    assert "down_proj" in result.stderr


def test_checkpoint_loads_into_our_decoder_like_quantizing_on_the_fly(sharded_llama, store_dir):
    from qerl_pipe.model.load import load_model

    ckpt = last_line(cli("quantize", "--model", sharded_llama, "--artifacts", store_dir, *FAST))
    from_artifact = load_model(ckpt, "nvfp4", dtype=torch.float32)
    on_the_fly = load_model(sharded_llama, "nvfp4", dtype=torch.float32)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(from_artifact.logits(ids), on_the_fly.logits(ids))


def test_row_chunked_quantization_gives_the_same_bytes(monkeypatch):
    from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, global_scale_from_amax, quantize_nvfp4
    from qerl_pipe.formats import modelopt_writer as stage

    weight = torch.randn(37, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    scale = global_scale_from_amax(weight.abs().amax().float() * 1.5)  # as if shared with a larger member
    whole = quantize_nvfp4(weight, scale)
    monkeypatch.setattr(stage, "_CHUNK_ELEMENTS", 5 * 64)  # 5 rows a chunk, the last one short
    chunked, err = stage.quantize_in_row_chunks(weight, scale, "w")
    assert err.output is None  # no calibration statistics given
    assert torch.equal(chunked.packed, whole.packed)
    assert torch.equal(chunked.block_scales.view(torch.uint8), whole.block_scales.view(torch.uint8))
    expected = (dequantize_nvfp4(whole) - weight.float()).norm() / weight.float().norm()
    assert err.weight == pytest.approx(float(expected), rel=1e-5)


def test_calibrate_data_file_edited_is_new_data(tiny_llama, store_dir, tmp_path):
    data = tmp_path / "calib.txt"
    data.write_text("\n".join(f"The number {i} is followed by {i + 1}." for i in range(40)) + "\n")
    opts = ["calibrate", "--model", tiny_llama, "--artifacts", store_dir, *CAL, "--set", f"calibrate.data={data}"]
    first = last_line(cli(*opts))
    assert last_line(cli(*opts)) == first  # same bytes: reused
    assert read_json(first / "manifest.json")["config"]["data_sha256"]
    data.write_text(data.read_text().replace("followed", "preceded"))
    assert last_line(cli(*opts)) != first  # the path alone must not name the artifact


def test_a_quality_report_short_of_text_shrinks_and_never_fails_the_stage(tiny_llama, store_dir, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("one two three four five six seven eight nine ten\n\neleven twelve thirteen\n")
    report = ["--set", "quantize.quality.perplexity=always", "--set", f"quantize.quality.data={short}",
              "--set", "quantize.quality.num_samples=64", "--set", "quantize.quality.seq_len=256"]
    made = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *report)
    ckpt = last_line(made)
    ppl = read_json(ckpt / "manifest.json")["summary"]["perplexity"]
    assert 2 <= ppl["tokens"] < 64 * 256 and ppl["bf16"] > 1, ppl
    assert "fewer than quality.num_samples x seq_len" in made.stderr

    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n')
    failing = ["--set", "quantize.quality.perplexity=always", "--set", f"quantize.quality.data={empty}"]
    skipped = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *failing)
    assert last_line(skipped) != ckpt and "warning: no perplexity report" in skipped.stderr
    assert read_json(last_line(skipped) / "manifest.json")["summary"]["perplexity"] == {
        "skipped": "the text data gives 1 tokens; a perplexity needs at least 2"}
    cli("verify", last_line(skipped))


def test_quality_settings_that_change_the_report_change_the_quantize_id(tiny_llama, store_dir):
    """The report is in the manifest: another data size, or no report, is another artifact, never
    the old report reused; perplexity auto and always measure a small model alike, so they agree."""
    measured = ["--set", "quantize.quality.num_samples=2", "--set", "quantize.quality.seq_len=16"]
    first = last_line(cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *measured, "--set",
                          "quantize.quality.perplexity=always"))
    assert read_json(first / "manifest.json")["summary"]["perplexity"]["tokens"] == 32
    longer = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *measured, "--set",
                 "quantize.quality.seq_len=32")
    assert last_line(longer) != first and "up to date" not in longer.stderr
    assert read_json(last_line(longer) / "manifest.json")["summary"]["perplexity"]["tokens"] == 64
    off = last_line(cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *FAST))
    assert off not in (first, last_line(longer)) and read_json(off / "manifest.json")["summary"]["perplexity"] is None
    auto = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *measured)  # perplexity: auto
    assert last_line(auto) == first and "up to date" in auto.stderr


def test_default_quality_settings_keep_the_ids_made_before_they_were_keyed():
    from qerl_pipe.quality import quality_key
    from qerl_pipe.recipe import QualitySection

    small, large = 10**8, 10**10  # the report's auto limit is 1B parameters
    assert quality_key(QualitySection(), small) is None and quality_key(QualitySection(), large) is None
    assert quality_key(QualitySection(perplexity="always"), small) is None
    assert quality_key(QualitySection(perplexity="never"), large) is None  # no report either way
    assert quality_key(QualitySection(perplexity="never"), small) == "off"
    assert quality_key(QualitySection(perplexity="always"), large)["num_samples"] == 16


def test_a_damaged_parent_names_the_stage_that_re_creates_it(tiny_llama, store_dir):
    cal = last_line(cli("calibrate", "--model", tiny_llama, "--artifacts", store_dir, *CAL))
    stats = cal / "calibration.json"
    stats.write_text(stats.read_text().replace("input_amax", "input_amaX", 1))
    result = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, "--calibration", cal, "--force",
                 *FAST, ok=False)
    assert result.exit_code == 1 and "`qerl-pipe calibrate --force`" in result.stderr, result.stderr
    assert "qerl-pipe quantize" not in result.stderr


def test_verify_and_ls_with_a_broken_manifest(tiny_llama, store_dir):
    ckpt = last_line(cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *FAST))
    (ckpt / "manifest.json").write_text("")
    listing = cli("ls", "--artifacts", store_dir).stdout
    assert ckpt.name in listing and "damaged" in listing
    bad = cli("verify", ckpt, ok=False)
    assert bad.exit_code == 1 and len(bad.stderr.strip().splitlines()) == 1
    assert "`qerl-pipe quantize --force`" in bad.stderr and "run `qerl-pipe verify" not in bad.stderr
    summary = ckpt / "manifest.json"
    cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, "--force", *FAST)
    manifest = read_json(summary)
    manifest["summary"]["mean_relative_error"] = 0.0001  # a hand-made better figure
    summary.write_text(json.dumps(manifest))
    edited = cli("verify", ckpt, ok=False)
    assert edited.exit_code == 1 and "manifest.json: edited after the artifact was made" in edited.stderr


def test_a_model_and_data_typed_three_ways_are_one_artifact_each(tiny_llama, tmp_path, monkeypatch):
    """`models/llama`, its absolute path and `models/llama/` are one input: one quantize artifact,
    one calibration (its data file typed relative and absolute), never a recomputation."""
    shutil.copytree(tiny_llama, tmp_path / "models" / "llama")
    (tmp_path / "calib.txt").write_text("\n\n".join(f"{n} apples and {n + 1} pears" for n in range(200)))
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "store"
    spellings = ["models/llama", str(tmp_path / "models" / "llama"), "./models/llama/"]
    made = {last_line(cli("quantize", "--model", model, "--artifacts", store, *FAST)) for model in spellings}
    assert len(made) == 1 and [p.name for p in store.glob("quantize-*")] == [made.pop().name]
    data = ["calib.txt", "./calib.txt", str(tmp_path / "calib.txt")]
    calibrations = {last_line(cli("calibrate", "--model", spellings[i], "--artifacts", store, *CAL, "--set",
                                  f"calibrate.data={data[i]}")) for i in range(3)}
    assert len(calibrations) == 1 and len(list(store.glob("calibrate-*"))) == 1


def test_a_packaged_gguf_is_named_by_its_alias_and_a_path_by_its_resolved_form(tmp_path, monkeypatch):
    from qerl_pipe.recipe import ModelSection
    from qerl_pipe.sources import ALIASES, _classify

    alias, spec = next(iter(ALIASES.items()))
    assert _classify(ModelSection(source=spec)).canonical == _classify(ModelSection(source=alias)).canonical == alias
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert _classify(ModelSection(source="m.gguf")).canonical == str((tmp_path / "m.gguf").resolve())
    assert _classify(ModelSection(source="./m.gguf")).canonical == str((tmp_path / "m.gguf").resolve())
