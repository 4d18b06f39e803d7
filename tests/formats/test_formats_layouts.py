"""Checkpoint layouts on disk: modelopt unified HF, compressed-tensors, multi-shard reading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qerl_pipe.errors import ModelSourceError, QuantizationError
from qerl_pipe.formats.checkpoint import detect_quant_format, iter_quantized_checkpoint, list_shards
from tests.compressed_tensors_writer import compressed_nvfp4_tensors, compressed_tensors_config
from qerl_pipe.formats.modelopt_layout import config_quantization_config, hf_quant_config, nvfp4_tensors
from qerl_pipe.formats.names import FUSED_GROUPS, fused_group_key
from qerl_pipe.formats.nvfp4 import NVFP4Weight, dequantize_nvfp4, global_scale_from_amax, quantize_nvfp4

GEN = torch.Generator().manual_seed(0)


def rand(*shape: int) -> torch.Tensor:
    return (torch.randn(shape, generator=GEN) * 0.05).bfloat16()


def on_disk(path: Path) -> dict[str, tuple[str, list[int]]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}


def test_modelopt_tensors_on_disk(tmp_path):
    w = quantize_nvfp4(rand(48, 96))
    input_scale = global_scale_from_amax(torch.tensor(3.5))
    path = tmp_path / "m.safetensors"
    save_file(nvfp4_tensors("model.layers.0.self_attn.q_proj", w, input_scale), str(path))
    assert on_disk(path) == {
        "model.layers.0.self_attn.q_proj.weight": ("U8", [48, 48]),
        "model.layers.0.self_attn.q_proj.weight_scale": ("F8_E4M3", [48, 6]),
        "model.layers.0.self_attn.q_proj.weight_scale_2": ("F32", []),
        "model.layers.0.self_attn.q_proj.input_scale": ("F32", []),
    }
    assert "x.input_scale" not in nvfp4_tensors("x", w, None)


def test_hf_quant_config_exact():
    assert hf_quant_config("W4A16_NVFP4", ["lm_head", "model.embed_tokens"], "0.1.0") == {
        "producer": {"name": "qerl-pipe", "version": "0.1.0"},
        "quantization": {
            "quant_algo": "W4A16_NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": ["lm_head", "model.embed_tokens"],
        },
    }
    with pytest.raises(QuantizationError, match="quant_algo"):
        hf_quant_config("FP8", [], "0.1.0")


@pytest.mark.parametrize("algo", ["NVFP4", "W4A16_NVFP4"])
def test_config_block_matches_modelopt_conversion(algo):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    ours = config_quantization_config(algo, ["lm_head"], "0.1.0")
    assert ours == convert_hf_quant_config_format(hf_quant_config(algo, ["lm_head"], "0.1.0"))
    group = ours["config_groups"]["group_0"]
    assert ("input_activations" in group) == (algo == "NVFP4")
    assert group["weights"] == {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    assert ours["quant_method"] == "modelopt" and ours["ignore"] == ["lm_head"]
    assert ours["producer"] == {"name": "qerl-pipe", "version": "0.1.0"}


def test_fused_group_key():
    assert fused_group_key("model.layers.3.self_attn.k_proj.weight") == "model.layers.3.self_attn.qkv"
    assert fused_group_key("model.layers.3.self_attn.q_proj") == "model.layers.3.self_attn.qkv"
    assert fused_group_key("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up"
    assert fused_group_key("model.layers.0.mlp.down_proj.weight") is None
    assert fused_group_key("model.layers.0.self_attn.o_proj.weight") is None
    assert fused_group_key("lm_head.weight") is None
    assert FUSED_GROUPS["qkv"] == ("q_proj", "k_proj", "v_proj")


def test_detect_quant_format():
    assert detect_quant_format({"model_type": "llama"}) is None
    assert detect_quant_format({"quantization_config": config_quantization_config("NVFP4", [], "x")}) == "modelopt"
    ct = {"quantization_config": compressed_tensors_config(["lm_head"], weight_only=True)}
    assert detect_quant_format(ct) == "compressed-tensors"
    for bad in ({"quant_method": "gptq", "bits": 4}, {"quant_method": "modelopt", "quant_algo": "FP8"},
                {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}):
        with pytest.raises(ModelSourceError, match="not supported"):
            detect_quant_format({"quantization_config": bad})


def write_checkpoint(root: Path, shards: list[dict[str, torch.Tensor]], quantization_config: dict | None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama"}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (root / "config.json").write_text(json.dumps(config))
    if len(shards) == 1:
        save_file(shards[0], str(root / "model.safetensors"))
        return
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(root / name))
        weight_map.update({k: name for k in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_compressed_tensors_round_trip_matches_modelopt_path(tmp_path):
    weights = {f"model.layers.0.self_attn.{p}": rand(64, 64) for p in ("q_proj", "k_proj", "v_proj")}
    quantized = {m: quantize_nvfp4(w) for m, w in weights.items()}
    input_scale = global_scale_from_amax(torch.tensor(7.25))
    tensors: dict[str, torch.Tensor] = {"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    for module, q in quantized.items():
        tensors.update(compressed_nvfp4_tensors(module, q, input_scale))
    write_checkpoint(tmp_path, [tensors], compressed_tensors_config(["lm_head"], weight_only=False))
    layout = on_disk(tmp_path / "model.safetensors")
    assert layout["model.layers.0.self_attn.q_proj.weight_packed"] == ("U8", [64, 32])
    assert layout["model.layers.0.self_attn.q_proj.weight_scale"] == ("F8_E4M3", [64, 4])
    assert layout["model.layers.0.self_attn.q_proj.weight_global_scale"] == ("F32", [1])
    assert layout["model.layers.0.self_attn.q_proj.input_global_scale"] == ("F32", [1])

    read = {name: (w, s) for name, w, s in iter_quantized_checkpoint(tmp_path)}
    assert set(read) == {*quantized, "model.norm.weight"}
    for module, q in quantized.items():
        w, s = read[module]
        assert isinstance(w, NVFP4Weight)
        assert torch.equal(w.packed, q.packed)
        assert torch.equal(w.block_scales.view(torch.uint8), q.block_scales.view(torch.uint8))
        assert w.global_scale.shape == () and s.shape == ()
        # The reciprocal convention can move the fp32 global scale by one ulp, no more.
        torch.testing.assert_close(w.global_scale, q.global_scale, rtol=2**-23, atol=0)
        torch.testing.assert_close(s, input_scale, rtol=2**-23, atol=0)
        torch.testing.assert_close(dequantize_nvfp4(w), dequantize_nvfp4(q), rtol=2**-22, atol=0)


def test_two_shards_with_split_module(tmp_path):
    q = quantize_nvfp4(rand(32, 64))
    down = quantize_nvfp4(rand(64, 32))
    embed = rand(100, 64)
    parts_q = nvfp4_tensors("model.layers.0.self_attn.q_proj", q, None)
    shard1 = {"model.embed_tokens.weight": embed, "model.layers.0.self_attn.q_proj.weight": parts_q.pop(
        "model.layers.0.self_attn.q_proj.weight")}
    shard2 = {**parts_q, **nvfp4_tensors("model.layers.0.mlp.down_proj", down, None),
              "model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    write_checkpoint(tmp_path, [shard1, shard2], config_quantization_config("W4A16_NVFP4", ["lm_head"], "x"))
    assert [p.name for p in list_shards(tmp_path)] == ["model-00001-of-00002.safetensors",
                                                       "model-00002-of-00002.safetensors"]
    items = list(iter_quantized_checkpoint(tmp_path))
    names = [name for name, _, _ in items]
    assert sorted(names) == ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj",
                             "model.layers.0.self_attn.q_proj", "model.norm.weight"]
    read = {name: w for name, w, _ in items}
    assert all(s is None for _, _, s in items)
    for module, ref in (("model.layers.0.self_attn.q_proj", q), ("model.layers.0.mlp.down_proj", down)):
        w = read[module]
        assert isinstance(w, NVFP4Weight) and torch.equal(dequantize_nvfp4(w), dequantize_nvfp4(ref))
        assert torch.equal(w.global_scale, ref.global_scale)
    assert torch.equal(read["model.embed_tokens.weight"], embed)


def test_truncated_shard_raises_model_source_error(tmp_path):
    write_checkpoint(tmp_path, [{"a.weight": rand(64, 64)}, {"b.weight": rand(64, 64)}], None)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ModelSourceError, match="model-00002-of-00002.safetensors"):
        list(iter_quantized_checkpoint(tmp_path))


def test_missing_shard_and_incomplete_module(tmp_path):
    write_checkpoint(tmp_path / "a", [{"a.weight": rand(4, 16)}, {"b.weight": rand(4, 16)}], None)
    (tmp_path / "a" / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(ModelSourceError, match="model-00001-of-00002"):
        list_shards(tmp_path / "a")
    parts = nvfp4_tensors("m", quantize_nvfp4(rand(4, 16)), None)
    del parts["m.weight_scale"]
    write_checkpoint(tmp_path / "b", [parts], None)
    with pytest.raises(ModelSourceError, match="m lacks weight_scale"):
        list(iter_quantized_checkpoint(tmp_path / "b"))


def test_written_safetensors_are_readable_by_others(tmp_path):
    """safetensors creates files 0600; ours get 0666 minus the umask, as ordinary files do."""
    import os
    import stat

    from qerl_pipe.formats.checkpoint import save_safetensors

    old = os.umask(0o022)
    try:
        save_safetensors({"w": torch.zeros(2)}, tmp_path / "a.safetensors", metadata={"format": "pt"})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.safetensors").stat().st_mode) == 0o644
