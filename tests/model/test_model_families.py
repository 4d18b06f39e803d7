"""Gemma2, Gemma3 (text), Phi3 and sliding-window Mistral, each on a tiny random model saved by
transformers: our forward against transformers' logits (fp32, sequences past the window, Gemma2's
caps active, Phi3's long RoPE factors), the cache decode and the engine's greedy decode against
the training forward, the NVFP4 checkpoint against modelopt's own export of the same model, and
the PEFT adapter loaded by `peft` over the transformers model."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.conftest import randomize_lora_b, randomize_weights
from qerl_pipe.engine import Engine, SamplingParams, plan_limits
from qerl_pipe.engine.decode_step import decode_step
from qerl_pipe.engine.fused_lora import FusedLora
from qerl_pipe.errors import ModelSourceError
from qerl_pipe.formats.checkpoint import list_shards
from qerl_pipe.formats.modelopt_writer import input_scales, plan_checkpoint, write_configs, write_shards
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.load import load_model
from qerl_pipe.model.lora import LoraSpec, apply_lora, check_lora_targets, lora_state_dict
from qerl_pipe.model.merge import write_merged
from qerl_pipe.model.peft import check_adapter_fits, lora_tensors, read_adapter, save_adapter
from qerl_pipe.rl.algo.aqn import noisy_norms
from qerl_pipe.rl.algo.logprobs import sequence_logprobs

WINDOW = 8
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=320, max_position_embeddings=512)
FAMILIES = {
    # Small caps so that both bend the numbers of a tiny model (the checkpoints' are 50 and 30).
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=1.0, final_logit_softcapping=4.0)),
    # Local / global every other layer, a linear-scaled global RoPE beside the local one.
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2,
                                        query_pre_attn_scalar=24, rope_scaling=dict(rope_type="linear", factor=4.0))),
    # LongRoPE switching at position 64, half the head rotating (Phi-4-mini's partial rotary).
    "phi3": ("Phi3Config", dict(sliding_window=WINDOW, original_max_position_embeddings=64, partial_rotary_factor=0.5,
                                rope_scaling=dict(type="longrope", short_factor=[1.0, 1.1, 1.5, 2.0],
                                                  long_factor=[2.0, 3.0, 4.0, 6.0]),
                                bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "mistral_window": ("MistralConfig", dict(sliding_window=WINDOW)),
}
# Prompts shorter and longer than the window (ids below the vocabulary of 320).
PROMPTS = [[1, 45, 67, 89, 10], [1, 200, 13], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
           [1, 99, 98, 97, 250, 3, 4, 30, 31, 32, 33]]


def _hf_config(family: str, **overrides):
    import transformers

    name, kwargs = FAMILIES[family]
    return getattr(transformers, name)(**DIMS, **{**kwargs, **overrides})


def save_family_model(out: Path, family: str):
    """A tiny random `family` model (fp32, norms off their init) saved by transformers in `out`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(family), dtype=torch.float32).eval()
    gemma = family.startswith("gemma")
    # Gemma's norms scale by 1 + w (centred at 0), and its embeddings are multiplied by sqrt(64) = 8.
    randomize_weights(model, norm_center=0.0 if gemma else 1.0, embed_std=0.2 if gemma else 1.0)
    model.save_pretrained(out)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("families")
    return {f: (root / f, save_family_model(root / f, f)) for f in FAMILIES}


def _ids(batch: int = 2, length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, DIMS["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def _hf_logits(path: Path, ids: torch.Tensor, **overrides) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **overrides).eval()
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_fp32(saved, family):
    path, hf = saved[family]
    model = load_model(path, "bf16", dtype=torch.float32)
    ids = _ids()  # 40 tokens: five windows
    with torch.no_grad():
        ref, ours = hf(ids).logits, model.logits(ids)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    # The window is what these sequences see: without it transformers computes other logits.
    assert (_hf_logits(path, ids, sliding_window=4 * len(ids[0])) - ref).abs().max() > 1e-2


def test_gemma2_caps_are_active(saved):
    path, hf = saved["gemma2"]
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
    # The final cap bends the logits (some beyond half the cap) without pinning them all at it.
    cap = hf.config.final_logit_softcapping
    assert (ref.abs() > cap / 2).float().mean() > 0.05 and ref.abs().max() < 0.999 * cap
    assert (_hf_logits(path, ids, final_logit_softcapping=None) - ref).abs().max() > 0.5
    assert (_hf_logits(path, ids, attn_logit_softcapping=None) - ref).abs().max() > 1e-2


def test_phi3_long_factors_past_the_original_context(saved):
    path, hf = saved["phi3"]
    model = load_model(path, "bf16", dtype=torch.float32)
    ids = _ids(length=24)
    positions = torch.arange(64, 88).expand(2, 24)  # every position past original_max_position_embeddings
    with torch.no_grad():
        ref = hf(ids, position_ids=positions).logits
        torch.testing.assert_close(model.logits(ids, positions=positions), ref, atol=1e-5, rtol=1e-5)
        assert (model.logits(ids, positions=positions - 64) - ref).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["gemma3", "mistral_window"])
def test_left_padding_keeps_the_window_in_positions(saved, family):
    model = load_model(saved[family][0], "bf16", dtype=torch.float32)
    ids = _ids(1, 20, seed=7)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 5), torch.ones(1, 20)], dim=1).long()
    with torch.no_grad():
        torch.testing.assert_close(model.logits(padded, attention_mask=mask)[:, 5:], model.logits(ids),
                                   atol=1e-5, rtol=1e-5)


def assert_cache_decode_matches_full_forward(model, seqs: torch.Tensor, lengths: list[int], steps: int) -> None:
    """Prefill of the first `lengths` tokens of `seqs` into scattered cache slots, then `steps`
    decode steps of the engine, each row equal to the full forward's logits at its position."""
    with torch.no_grad():
        full = model.logits(seqs)
    cache = model.make_cache(batch_size=4, max_len=32)
    slots = torch.tensor([2, 0, 3])
    prompts = seqs[:, :12].clone()
    for i, n in enumerate(lengths):
        prompts[i, n:] = 0
    first = model.prefill(prompts, cache, slots, torch.tensor(lengths))
    for i, n in enumerate(lengths):
        torch.testing.assert_close(first[i], full[i, n - 1], atol=1e-4, rtol=1e-4)
    positions, tokens = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    lora = FusedLora(model, model.dtype)
    for step in range(steps):
        for i, n in enumerate(lengths):
            positions[slots[i]], tokens[slots[i]] = n + step, seqs[i, n + step]
        logits = decode_step(model, lora, tokens, positions, cache)
        for i, n in enumerate(lengths):
            torch.testing.assert_close(logits[slots[i]], full[i, n + step], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, base_format", [("gemma2", "bf16"), ("gemma2", "nvfp4"), ("gemma3", "bf16"),
                                                 ("phi3", "bf16"), ("phi3", "nf4"), ("mistral_window", "nvfp4")])
def test_cache_decode_matches_full_forward(saved, family, base_format):
    model = load_model(saved[family][0], base_format, dtype=torch.float32)
    lengths, steps = [5, 12, 9], 10  # prompts around the window, decoding well past it
    assert_cache_decode_matches_full_forward(model, _ids(3, 12 + steps, seed=3), lengths, steps)


def argmax_continuation(model: Decoder, prompt: list[int], new: int) -> list[int]:
    """`new` tokens of greedy decoding by the training forward over the whole sequence each time."""
    seq, device = list(prompt), model.embed_tokens.weight.device
    with torch.no_grad():
        for _ in range(new):
            seq.append(int(model.logits(torch.tensor([seq], device=device))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_greedy_equals_training_forward(saved, family):
    model = load_model(saved[family][0], "bf16", dtype=torch.float32, lora=LoraSpec(rank=4, alpha=8))
    randomize_lora_b(model, 0.2)
    engine = Engine(model, plan_limits(model.config, max_seq_len=64, max_batch=4))
    out = engine.generate(PROMPTS, n=2, sampling=SamplingParams(temperature=0, max_new_tokens=14))
    for i, prompt in enumerate(PROMPTS):
        want = argmax_continuation(model, prompt, 14)
        assert out.tokens[2 * i] == want and out.tokens[2 * i + 1] == want


def test_gemma_aqn_noise_goes_to_the_norms_that_feed_linears(saved):
    model = load_model(saved["gemma2"][0], "bf16", dtype=torch.float32)
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(m)] for m in noisy_norms(model)][:2] == ["layers.0.input_layernorm",
                                                              "layers.0.pre_feedforward_layernorm"]


def test_gemma2_logprobs_through_the_cap_match_autograd(saved):
    model = load_model(saved["gemma2"][0], "bf16", dtype=torch.float32, lora=LoraSpec(rank=4, alpha=8))
    randomize_lora_b(model, 0.2)
    ids = _ids(2, 16, seed=5)
    mask, response = torch.ones_like(ids), torch.zeros_like(ids)
    response[:, 8:] = 1
    params = [p for p in model.parameters() if p.requires_grad]
    logp, _ = sequence_logprobs(model, ids, mask, response, temperature=0.7, chunk=7)
    grads = torch.autograd.grad(logp.sum(), params)
    ref = torch.log_softmax(model.logits(ids).float() / 0.7, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    ref = ref * response[:, 1:]
    ref_grads = torch.autograd.grad(ref.sum(), params)
    torch.testing.assert_close(logp[:, 1:], ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


# --- NVFP4 checkpoint: our writer against modelopt's export of the same model ----------------

_MODELOPT_EXPORT = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch, transformers
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from safetensors import safe_open
from pathlib import Path
layouts = {}
for src, out in zip(sys.argv[1::2], sys.argv[2::2]):
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(torch.randint(0, 320, (2, 16))))
    export_hf_checkpoint(model, export_dir=out)
    layout = {}
    for shard in sorted(Path(out).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as fh:
            layout.update({k: [str(fh.get_slice(k).get_dtype()), list(fh.get_slice(k).get_shape())] for k in fh.keys()})
    layouts[src] = layout
print(json.dumps(layouts))
"""


@pytest.fixture(scope="module")
def modelopt_layouts(saved, tmp_path_factory) -> dict[str, dict[str, list]]:
    """Tensor name -> [dtype, shape] of modelopt's NVFP4 export (W4A4: with input scales) of each
    family's model, from one subprocess (modelopt's import takes seconds)."""
    pytest.importorskip("modelopt")
    root = tmp_path_factory.mktemp("modelopt")
    args = [a for f in FAMILIES for a in (str(saved[f][0]), str(root / f))]
    proc = subprocess.run([sys.executable, "-c", _MODELOPT_EXPORT, *args], capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise AssertionError(f"modelopt export failed:\n{proc.stderr[-3000:]}")
    layouts = json.loads(proc.stdout.strip().splitlines()[-1])
    return {f: layouts[str(saved[f][0])] for f in FAMILIES}


def _our_checkpoint(src: Path, out: Path) -> dict[str, list]:
    """Our NVFP4 checkpoint of `src` (W4A4: every module's input amax set to 1) as name -> [dtype, shape]."""
    out.mkdir()
    shards = list_shards(src)
    plan = plan_checkpoint(shards, ["lm_head"])
    scales = input_scales(plan, {module: 1.0 for module in plan.quantized.values()})
    write_shards(shards, out, plan, scales, torch.bfloat16, "rtn")
    write_configs(src, out, "NVFP4", ["lm_head"], torch.bfloat16)
    layout = {}
    for shard in list_shards(out):
        with safe_open(str(shard), "pt") as fh:
            layout.update({k: [str(fh.get_slice(k).get_dtype()), list(fh.get_slice(k).get_shape())] for k in fh.keys()})
    return layout


@pytest.mark.parametrize("family", list(FAMILIES))
def test_nvfp4_checkpoint_has_modelopts_layout(saved, modelopt_layouts, tmp_path, family):
    path, _ = saved[family]
    ours = _our_checkpoint(path, tmp_path / "ckpt")
    assert ours == modelopt_layouts[family]  # names, dtypes, shapes
    if family == "phi3":  # fused in the checkpoint, fused in the export: no q_proj / gate_proj
        assert "model.layers.0.self_attn.qkv_proj.weight_scale_2" in ours
        assert not any(".q_proj." in name or ".gate_proj." in name for name in ours)
    # And it loads back: the same bases as quantizing the bf16 model on the fly.
    from_ckpt = load_model(tmp_path / "ckpt", "nvfp4", dtype=torch.float32)
    on_the_fly = load_model(path, "nvfp4", dtype=torch.bfloat16)
    for name, t in on_the_fly.state_dict().items():
        if name.endswith(("qweight", "scales", "global_scale")):
            assert torch.equal(from_ckpt.state_dict()[name], t), name


# --- PEFT ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_adapter_loads_over_transformers(saved, tmp_path, family):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, _ = saved[family]
    spec = LoraSpec(rank=4, alpha=8, train_norms=True)
    model = load_model(path, "bf16", dtype=torch.float32, lora=spec)
    randomize_lora_b(model, 0.2)
    with torch.no_grad():  # trained norms too (PEFT's modules_to_save)
        model.layers[1].input_layernorm.weight.add_(0.1)
    save_adapter(model, spec, tmp_path / "adapter", str(path))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    if family == "phi3":
        assert config["target_modules"] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
        assert "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight" in lora_state_dict(model)
    else:
        assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ids = _ids(2, 20, seed=11)
    with torch.no_grad():
        want = model.logits(ids)
        torch.testing.assert_close(peft_model(ids).logits, want, atol=1e-4, rtol=1e-4)
    # Read back: the checks eval and export run, and the merge into the checkpoint's own modules.
    adapter = read_adapter(tmp_path / "adapter")
    assert adapter.spec == spec
    check_adapter_fits(adapter, json.loads((path / "config.json").read_text()), family)
    (tmp_path / "merged").mkdir()
    write_merged(path, lora_tensors(adapter), tmp_path / "merged", torch.float32)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        torch.testing.assert_close(merged(ids).logits, want, atol=1e-4, rtol=1e-4)


def test_phi3_fused_modules_take_all_their_targets_or_none(saved):
    model = load_model(saved["phi3"][0], "bf16", dtype=torch.float32)
    with pytest.raises(ModelSourceError, match=r"q/k/v as one module \(qkv_proj\)"):
        apply_lora(model, LoraSpec(rank=4, alpha=8, targets=("q", "v")))
    # The same check before any work (train's and `run`'s preflight), from config.json alone.
    with pytest.raises(ModelSourceError, match=r"gate/up as one module \(gate_up_proj\)"):
        check_lora_targets(model.config, ("q", "k", "v", "up"))
    apply_lora(model, LoraSpec(rank=4, alpha=8, targets=("o", "down")))
    assert sorted(lora_state_dict(model))[0].endswith("mlp.down_proj.lora_A.weight")


def test_local_and_global_layers_rotate_with_their_own_rope(saved):
    model = load_model(saved["gemma3"][0], "bf16", dtype=torch.float32)
    tables = model.rope_cos_sin(torch.arange(10)[None])
    assert model.config.windows == (WINDOW, 0, WINDOW, 0)
    assert tables[0] is tables[2] and tables[1] is tables[3] and not torch.equal(tables[0][0], tables[1][0])
    plain = dataclasses.replace(model.config, local_rope=None)
    assert plain.rope_of(0) == plain.rope
