"""Our decoder against transformers, against itself (quantized vs dequantized, cache vs full
forward), and loaded from NVFP4 checkpoints written with the formats module."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qerl_pipe.model.random_init import init_random_model
from qerl_pipe.errors import ModelSourceError
from tests.conftest import randomize_weights
from tests.compressed_tensors_writer import compressed_nvfp4_tensors, compressed_tensors_config
from qerl_pipe.formats.modelopt_layout import config_quantization_config, nvfp4_tensors
from qerl_pipe.formats.nf4 import dequantize_nf4
from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4, shared_global_scale
from qerl_pipe.engine.decode_step import decode_step
from qerl_pipe.engine.fused_lora import FusedLora
from qerl_pipe.model.decoder import KVCache
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.load import load_model, model_memory_bytes

DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=512)
ARCHS = {
    # Llama 3.x rope scaling with a short original context so every frequency band is exercised.
    "llama3": ("LlamaConfig", dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                     high_freq_factor=4.0, original_max_position_embeddings=32))),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
}


def _save_hf_model(out: Path, arch: str):
    import transformers

    config_name, overrides = ARCHS[arch]
    config = getattr(transformers, config_name)(**DIMS, **overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_weights(model)
    model.save_pretrained(out, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("hf")
    return {arch: (root / arch, _save_hf_model(root / arch, arch)) for arch in ARCHS}


def _ids(batch: int = 2, length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, DIMS["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers_fp32(hf_models, arch):
    path, hf = hf_models[arch]
    model = load_model(path, "bf16", dtype=torch.float32)
    assert model.config.rope.type == ("llama3" if arch == "llama3" else "default")
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
        ours = model.logits(ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_logits_match_transformers_bf16(hf_models):
    path, hf = hf_models["qwen3"]
    hf16 = type(hf)(hf.config).to(torch.bfloat16).eval()
    hf16.load_state_dict(hf.state_dict())
    model = load_model(path, "bf16", dtype=torch.bfloat16)
    ids = _ids()
    with torch.no_grad():
        ours, ref16, ref32 = model.logits(ids), hf16(ids).logits, hf(ids).logits
    # Both bf16 models sit within bf16 rounding of the fp32 truth, and of each other.
    assert _rel(ours, ref32) < 0.03 and _rel(ref16, ref32) < 0.03
    assert _rel(ours, ref16) < 0.03


def _with_bases_dequantized(quantized, path: Path) -> torch.nn.Module:
    """A bf16-base model whose weights are exactly the quantized model's dequantized values."""
    ref = load_model(path, "bf16", dtype=torch.float32)
    linears = dict(ref.named_modules())
    for name, m in quantized.named_modules():
        if isinstance(m, QuantLinear):
            base = m.base_weight()
            w = dequantize_nvfp4(base) if m.base_format == "nvfp4" else dequantize_nf4(base)
            linears[name].set_base(w)
    return ref


@pytest.mark.parametrize("base_format", ["nvfp4", "nf4"])
def test_quantized_model_equals_its_dequantized_weights(hf_models, base_format):
    path, _ = hf_models["llama3"]
    model = load_model(path, base_format, dtype=torch.float32)
    if base_format == "nvfp4":
        # The fused q/k/v share the global scale of their max amax.
        qkv = model.layers[0].self_attn.qkv_proj.base_weight()
        with safe_open(path / "model.safetensors", "pt") as f:
            parts = [f.get_tensor(f"model.layers.0.self_attn.{p}.weight") for p in ("q_proj", "k_proj", "v_proj")]
        assert qkv.global_scale == shared_global_scale(parts)
        assert torch.equal(qkv.packed[: parts[0].shape[0]], quantize_nvfp4(parts[0], qkv.global_scale).packed)
    ref = _with_bases_dequantized(model, path)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model.logits(ids), ref.logits(ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch, base_format", [("qwen2_tied", "bf16"), ("qwen3", "nvfp4"), ("llama3", "nf4")])
def test_kv_cache_decode_matches_full_forward(hf_models, arch, base_format):
    path, _ = hf_models[arch]
    model = load_model(path, base_format, dtype=torch.float32)
    lengths, steps = [5, 9, 7], 6
    seqs = _ids(3, 9 + steps, seed=3)
    with torch.no_grad():
        full = model.logits(seqs)
    # Batch of 4 slots, prompts of different lengths right-padded into slots 2, 0, 3 (slot 1 idle).
    cache = model.make_cache(batch_size=4, max_len=32)
    slots = torch.tensor([2, 0, 3])
    prompts = seqs[:, :9].clone()
    for i, n in enumerate(lengths):
        prompts[i, n:] = 0
    first = model.prefill(prompts, cache, slots, torch.tensor(lengths))
    for i, n in enumerate(lengths):
        torch.testing.assert_close(first[i], full[i, n - 1], atol=1e-4, rtol=1e-4)
    positions = torch.zeros(4, dtype=torch.long)
    tokens = torch.zeros(4, dtype=torch.long)
    lora = FusedLora(model, model.dtype)  # the model has no adapter: the bases alone
    for step in range(steps):
        for i, n in enumerate(lengths):
            positions[slots[i]] = n + step
            tokens[slots[i]] = seqs[i, n + step]
        logits = decode_step(model, lora, tokens, positions, cache)
        for i, n in enumerate(lengths):
            torch.testing.assert_close(logits[slots[i]], full[i, n + step], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="one per cache slot"):
        decode_step(model, lora, tokens[:2], positions[:2], cache)


def test_copy_slots_shares_one_prefill(hf_models):
    path, _ = hf_models["llama3"]
    model = load_model(path, "bf16", dtype=torch.float32)
    prompt = _ids(1, 6, seed=5)
    cache = KVCache(model.config, batch_size=3, max_len=16, dtype=torch.float32)
    model.prefill(prompt, cache, torch.tensor([0]))
    cache.copy_slots(torch.tensor([0, 0]), torch.tensor([1, 2]))
    nxt = torch.tensor([7, 8, 9])
    logits = decode_step(model, FusedLora(model, model.dtype), nxt, torch.full((3,), 6), cache)
    with torch.no_grad():
        for i in range(3):
            full = model.logits(torch.cat([prompt[0], nxt[i : i + 1]])[None])
            torch.testing.assert_close(logits[i], full[0, -1], atol=1e-4, rtol=1e-4)


def test_left_padding_gives_the_unpadded_logits(hf_models):
    path, _ = hf_models["qwen2_tied"]
    model = load_model(path, "bf16", dtype=torch.float32)
    ids = _ids(1, 10, seed=7)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 10)], dim=1).long()
    with torch.no_grad():
        out = model.logits(padded, attention_mask=mask)
        ref = model.logits(ids)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 4:], ref, atol=1e-4, rtol=1e-4)


def _write_nvfp4_checkpoint(src: Path, out: Path, layout: str, shared_scales: bool = True,
                            keep_dense: tuple[str, ...] = ()) -> None:
    """Quantize the projections of `src` into `out`, in the modelopt or compressed-tensors layout.

    `shared_scales=False` writes what TensorRT-LLM refuses (a scale per projection); `keep_dense`
    names tensors left unquantized (a checkpoint's exclusions)."""
    out.mkdir()
    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    groups = {}
    for name in tensors:
        for group, projs in (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj"))):
            if name.endswith(".weight") and name.split(".")[-2] in projs:
                groups.setdefault(name.rsplit(".", 2)[0] + group, []).append(name)
    scales = {n: shared_global_scale([tensors[m] for m in members]) for members in groups.values() for n in members}
    if not shared_scales:
        scales = {}
    written = {}
    for name, t in tensors.items():
        if name.endswith("proj.weight") and name not in keep_dense:
            w = quantize_nvfp4(t, scales.get(name))
            write = nvfp4_tensors if layout == "modelopt" else compressed_nvfp4_tensors
            written.update(write(name.removesuffix(".weight"), w, None))
        else:
            written[name] = t
    save_file(written, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = (
        config_quantization_config("W4A16_NVFP4", ["lm_head"], "test")
        if layout == "modelopt"
        else compressed_tensors_config(["lm_head"], weight_only=True)
    )
    (out / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_load_nvfp4_checkpoint_equals_quantizing_on_the_fly(hf_models, tmp_path, layout):
    path, _ = hf_models["qwen2_tied"]
    ckpt = tmp_path / layout
    _write_nvfp4_checkpoint(path, ckpt, layout)
    from_ckpt = load_model(ckpt, "nvfp4", dtype=torch.float32)
    on_the_fly = load_model(path, "nvfp4", dtype=torch.float32)
    ours, theirs = from_ckpt.state_dict(), on_the_fly.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        if key.endswith("global_scale") and layout == "compressed-tensors":
            # Stored as a reciprocal: the round trip may move the last bit.
            torch.testing.assert_close(ours[key], theirs[key], atol=0, rtol=2e-7)
        else:
            assert torch.equal(ours[key], theirs[key]), key
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(from_ckpt.logits(ids), on_the_fly.logits(ids), atol=1e-5, rtol=1e-5)
        # A bf16 request dequantizes the checkpoint.
        as_bf16 = load_model(ckpt, "bf16", dtype=torch.float32)
        torch.testing.assert_close(as_bf16.logits(ids), on_the_fly.logits(ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(ModelSourceError, match="NF4 needs the original bf16 model"):
        load_model(ckpt, "nf4")


@pytest.mark.parametrize("variant", ["own_scales", "partly_dense"])
def test_unusual_nvfp4_groups_are_requantized_under_one_scale(hf_models, tmp_path, caplog, variant):
    path, _ = hf_models["llama3"]
    ckpt = tmp_path / variant
    if variant == "own_scales":
        _write_nvfp4_checkpoint(path, ckpt, "modelopt", shared_scales=False)
    else:
        _write_nvfp4_checkpoint(path, ckpt, "modelopt", keep_dense=("model.layers.0.mlp.up_proj.weight",))
    with caplog.at_level("WARNING"):
        model = load_model(ckpt, "nvfp4", dtype=torch.float32)
    assert ("different NVFP4 global scales" in caplog.text) == (variant == "own_scales")
    ids = _ids()
    with torch.no_grad():
        # Re-rounded once more than the on-the-fly model: close, not equal.
        assert _rel(model.logits(ids), load_model(path, "nvfp4", dtype=torch.float32).logits(ids)) < 0.06


def test_incomplete_checkpoint_is_refused(hf_models, tmp_path):
    path, _ = hf_models["llama3"]
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(path / "config.json", broken / "config.json")
    with safe_open(path / "model.safetensors", "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if "layers.1.self_attn.v_proj" not in k}
    save_file(kept, broken / "model.safetensors")
    with pytest.raises(ModelSourceError, match=r"lacks layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(broken)


def _capture_qkv_inputs(model, ids):
    seen = []
    hook = model.layers[0].self_attn.qkv_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        logits = model.logits(ids)
    hook.remove()
    return seen[0], logits


def test_aqn_noise_acts_as_norm_weight_plus_noise(hf_models):
    path, _ = hf_models["llama3"]
    noisy = load_model(path, "nvfp4", dtype=torch.float32)
    shifted = load_model(path, "nvfp4", dtype=torch.float32)
    ids = _ids()
    clean_x, clean_logits = _capture_qkv_inputs(noisy, ids)
    norm = noisy.layers[0].input_layernorm
    assert "layers.0.input_layernorm.noise" not in noisy.state_dict()  # never saved
    assert torch.equal(norm.noise, torch.zeros_like(norm.weight))
    z = 0.05 * torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(0))
    norm.noise.copy_(z)
    with torch.no_grad():
        shifted.layers[0].input_layernorm.weight.add_(z)
    noisy_x, noisy_logits = _capture_qkv_inputs(noisy, ids)
    shifted_x, shifted_logits = _capture_qkv_inputs(shifted, ids)
    torch.testing.assert_close(noisy_x, shifted_x, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(noisy_logits, shifted_logits, atol=1e-5, rtol=1e-5)
    # Row-wise multiplicative noise (1 + z/w) on the q/k/v input.
    w = shifted.layers[0].input_layernorm.weight - z
    torch.testing.assert_close(noisy_x, clean_x * (1 + z / w), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(noisy_logits, clean_logits, atol=1e-3)
    norm.noise.zero_()
    assert torch.equal(_capture_qkv_inputs(noisy, ids)[1], clean_logits)


def test_random_init_builds_quantized_model_directly():
    config = dict(DIMS, model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False)
    sizes = {}
    for fmt in ("bf16", "nvfp4", "nf4"):
        model = init_random_model(config, fmt, device="cpu", seed=0)
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        sizes[fmt] = model_memory_bytes(model)
        with torch.no_grad():
            assert torch.isfinite(model.logits(_ids(1, 8))).all()
    linear_params = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128)
    assert sizes["bf16"] - sizes["nvfp4"] == pytest.approx(linear_params * (2 - 0.5625), abs=64)
    assert sizes["nf4"] < sizes["bf16"]
    one, two = init_random_model(config, "nvfp4", seed=3), init_random_model(config, "nvfp4", seed=3)
    assert torch.equal(one.layers[1].mlp.down_proj.qweight, two.layers[1].mlp.down_proj.qweight)
