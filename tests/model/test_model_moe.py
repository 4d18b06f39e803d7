"""Qwen3-MoE on tiny random models saved by transformers: our forward against transformers' logits
(fp32; top-k renormalised or not, a dense `mlp_only_layers` layer, a `decoder_sparse_step` of 2),
the cache decode and the engine's greedy decode against the training forward, LoRA on the experts
(its gradients against the dense reference, merged into the checkpoint and loaded by
transformers), the NVFP4 checkpoint against modelopt's own MoE export, the PEFT adapter loaded by
`peft` over the transformers model, the memory planner's expert counts, and the CLI pipeline end to
end (quantize -> build-engine -> 2 train steps -> export peft)."""

from __future__ import annotations

import json
import subprocess
import warnings
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qerl_pipe.model.random_init import init_random_model
from qerl_pipe.engine import Engine, SamplingParams, plan_limits
from qerl_pipe.engine.decode_step import decode_step
from qerl_pipe.engine.fused_lora import FusedLora
from qerl_pipe.errors import ModelSourceError, QerlError
from qerl_pipe.formats.checkpoint import list_shards
from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, global_scale_from_amax
from qerl_pipe.formats.modelopt_writer import input_scales, plan_checkpoint, write_configs, write_shards
from qerl_pipe.memory.step import lora_params, weight_bytes, weight_elements
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.load import load_model, model_memory_bytes
from qerl_pipe.model.lora import LoraSpec, lora_parameters, lora_state_dict
from qerl_pipe.model.merge import write_merged
from qerl_pipe.model.moe import SparseMoE
from qerl_pipe.model.peft import check_adapter_fits, lora_tensors, read_adapter, save_adapter
from tests.conftest import make_tiny_model, randomize_lora_b, randomize_weights
from tests.stage_cli import cli, last_line
from tests.model.test_model_families import argmax_continuation, assert_cache_decode_matches_full_forward

VOCAB = 320
DIMS = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
            max_position_embeddings=512, num_experts=8, num_experts_per_tok=2)
VARIANTS = {
    # Qwen3-30B-A3B's layout: renormalised top-k, every layer sparse.
    "all_sparse": dict(norm_topk_prob=True),
    # The same routing, layer 1 dense (`mlp_only_layers`).
    "renorm": dict(norm_topk_prob=True, mlp_only_layers=[1]),
    # transformers' default (no renormalisation), every second layer sparse.
    "sparse_step": dict(norm_topk_prob=False, decoder_sparse_step=2),
}
PROMPTS = [[1, 45, 67, 89, 10], [1, 200, 13], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]


def save_moe_model(out: Path, variant: str):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**DIMS, **VARIANTS[variant])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_weights(model)  # routers too: N(0, 0.08) spreads the tokens over the experts
    model.save_pretrained(out)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("moe")
    return {v: (root / v, save_moe_model(root / v, v)) for v in VARIANTS}


def _ids(batch: int = 2, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- the model ------------------------------------------------------------------------------

def test_config_reads_the_sparse_layers_and_routing(saved):
    config = json.loads((saved["renorm"][0] / "config.json").read_text())
    assert "num_local_experts" in config  # transformers 5's spelling of num_experts
    c = DecoderConfig.from_hf(config)
    assert (c.num_experts, c.experts_per_token, c.moe_intermediate_size, c.norm_topk_prob) == (8, 2, 64, True)
    assert c.sparse_layers == (True, False, True, True)
    c = DecoderConfig.from_hf(json.loads((saved["sparse_step"][0] / "config.json").read_text()))
    assert c.sparse_layers == (False, True, False, True) and not c.norm_topk_prob


@pytest.mark.parametrize("change, needle", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(shared_expert_intermediate_size=64), "shared experts"),
    (dict(mlp_only_layers=[7]), "mlp_only_layers"),
    (dict(model_type="mixtral", architectures=["MixtralForCausalLM"]), "unsupported architecture"),
    (dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"]), r"Qwen3-MoE \(Qwen3MoeForCausalLM\) only"),
])
def test_bad_moe_configs_are_refused_in_one_line(saved, change, needle):
    config = {**json.loads((saved["renorm"][0] / "config.json").read_text()), **change}
    with pytest.raises(ModelSourceError, match=needle) as err:
        DecoderConfig.from_hf(config)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_fp32(saved, variant):
    path, hf = saved[variant]
    model = load_model(path, "bf16", dtype=torch.float32)
    assert isinstance(model.layers[0].mlp, SparseMoE) == (variant != "sparse_step")
    ids = _ids()
    with torch.no_grad():
        ref, ours = hf(ids).logits, model.logits(ids)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    # The routing matters: a model with the other renormalisation computes other logits.
    other = json.loads((path / "config.json").read_text())
    other["norm_topk_prob"] = not other["norm_topk_prob"]
    flipped = init_random_model(other, "bf16", dtype=torch.float32)
    flipped.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (flipped.logits(ids) - ref).abs().max() > 1e-3


def test_tokens_reach_many_experts_and_left_padding_changes_nothing(saved):
    model = load_model(saved["renorm"][0], "bf16", dtype=torch.float32)
    moe = model.layers[0].mlp
    x = model.embed(_ids(4, 24)).reshape(-1, DIMS["hidden_size"])
    _, ids = moe.gate(model.layers[0].post_attention_layernorm(x))
    assert len(ids.unique()) == DIMS["num_experts"]  # the test exercises every expert
    ids = _ids(1, 16, seed=7)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 16)], dim=1).long()
    with torch.no_grad():
        torch.testing.assert_close(model.logits(padded, attention_mask=mask)[:, 4:], model.logits(ids),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("base_format", ["bf16", "nvfp4", "nf4"])
def test_cache_decode_matches_full_forward(saved, base_format):
    model = load_model(saved["renorm"][0], base_format, dtype=torch.float32)
    lengths, steps = [5, 12, 9], 8
    assert_cache_decode_matches_full_forward(model, _ids(3, 12 + steps, seed=3), lengths, steps)


@pytest.mark.parametrize("base_format, experts", [("bf16", True), ("nvfp4", False), ("nvfp4", True)])
def test_engine_greedy_equals_training_forward(saved, base_format, experts):
    model = load_model(saved["renorm"][0], base_format, dtype=torch.float32,
                       lora=LoraSpec(rank=4, alpha=8, experts=experts))
    randomize_lora_b(model, 0.2)
    engine = Engine(model, plan_limits(model.config, max_seq_len=64, max_batch=4))
    out = engine.generate(PROMPTS, n=2, sampling=SamplingParams(temperature=0, max_new_tokens=12))
    for i, prompt in enumerate(PROMPTS):
        want = argmax_continuation(model, prompt, 12)
        assert out.tokens[2 * i] == want and out.tokens[2 * i + 1] == want


# --- LoRA on the experts ----------------------------------------------------------------------

def test_expert_lora_is_a_switch_and_has_one_adapter_per_expert(saved):
    path = saved["renorm"][0]
    plain = load_model(path, "bf16", dtype=torch.float32, lora=LoraSpec(rank=4, alpha=8))
    names = lora_state_dict(plain)
    assert not any(".experts." in n for n in names)  # attention, and the dense layer's MLP
    assert "base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight" in names
    assert not plain.layers[0].mlp.gate.weight.requires_grad  # the router stays frozen
    model = load_model(path, "bf16", dtype=torch.float32, lora=LoraSpec(rank=4, alpha=8, experts=True))
    names = lora_state_dict(model)
    for e in range(DIMS["num_experts"]):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"base_model.model.model.layers.3.mlp.experts.{e}.{proj}.lora_B.weight" in names


@pytest.mark.parametrize("base_format", ["bf16", "nvfp4"])
def test_expert_lora_gradients_equal_the_dense_reference(saved, base_format):
    """Gradients through the grouped forward, the frozen (4-bit) experts' dX and gradient
    checkpointing equal plain autograd over each expert's dequantized weight plus B @ A."""
    model = load_model(saved["renorm"][0], base_format, dtype=torch.float32,
                       lora=LoraSpec(rank=4, alpha=8, experts=True))
    randomize_lora_b(model, 0.2)
    ids = _ids(2, 12, seed=5)
    params = lora_parameters(model)
    # An expert no token chose gets a zero gradient.
    grads = torch.autograd.grad(model.logits(ids).square().mean(), params, materialize_grads=True)
    model.gradient_checkpointing = True
    for g, r in zip(torch.autograd.grad(model.logits(ids).square().mean(), params, materialize_grads=True), grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
    # The reference: one layer's MoE recomputed by hand, dense weights with LoRA merged.
    moe = model.layers[0].mlp
    x = torch.randn(10, DIMS["hidden_size"], generator=torch.Generator().manual_seed(2), requires_grad=True)
    ours = moe(x)
    weights, chosen = moe.gate(x)
    ref = torch.zeros_like(x)
    for t in range(10):
        for j in range(DIMS["num_experts_per_tok"]):
            e = moe.experts[int(chosen[t, j])]
            gate_up = x[t] @ _dense(e.gate_up_proj).t()
            gate, up = gate_up.chunk(2)
            ref[t] = ref[t] + weights[t, j] * (torch.nn.functional.silu(gate) * up) @ _dense(e.down_proj).t()
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    expert_params = [p for e in moe.experts for p in e.parameters() if p.requires_grad] + [x]
    for g, r in zip(torch.autograd.grad(ours.square().sum(), expert_params, materialize_grads=True),
                    torch.autograd.grad(ref.square().sum(), expert_params, materialize_grads=True)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def _dense(linear) -> torch.Tensor:
    """The linear's base (dequantized) plus scaling * B @ A per projection, with autograd to A, B."""
    base = linear.base_weight()
    w = base if isinstance(base, torch.Tensor) else dequantize_nvfp4(base, torch.float32)
    rows = []
    for name, part in zip(linear.names, w.split(linear.out_sizes)):
        if name in linear.lora_A:
            part = part + linear.lora_scaling * linear.lora_B[name] @ linear.lora_A[name]
        rows.append(part)
    return torch.cat(rows)


def test_expert_lora_merges_into_the_checkpoint_transformers_loads(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    path = saved["renorm"][0]
    spec = LoraSpec(rank=4, alpha=8, experts=True)
    model = load_model(path, "bf16", dtype=torch.float32, lora=spec)
    randomize_lora_b(model, 0.2)
    save_adapter(model, spec, tmp_path / "adapter", str(path))
    adapter = read_adapter(tmp_path / "adapter")
    assert adapter.spec == spec  # the expert tensors say `experts`
    check_adapter_fits(adapter, json.loads((path / "config.json").read_text()), "tiny")
    (tmp_path / "merged").mkdir()
    summary = write_merged(path, lora_tensors(adapter), tmp_path / "merged", torch.float32)
    assert summary["merged_linears"] > 3 * 3 * DIMS["num_experts"]
    ids = _ids(2, 16, seed=11)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        torch.testing.assert_close(merged(ids).logits, model.logits(ids), atol=1e-4, rtol=1e-4)
    # An attention-only adapter does not fit a model asked for expert LoRA, and says so.
    plain = LoraSpec(rank=4, alpha=8)
    save_adapter(load_model(path, "bf16", dtype=torch.float32, lora=plain), plain, tmp_path / "plain", str(path))
    assert not read_adapter(tmp_path / "plain").spec.experts


@pytest.mark.parametrize("experts", [False, True])
def test_peft_adapter_loads_over_transformers(saved, tmp_path, experts):
    """PEFT (0.21) over transformers 5, whose experts are stacked parameters, converts our
    per-expert names (`mlp.experts.E.gate_proj.lora_A`, transformers 4's modules) into its fused
    expert LoRA on load: the same logits, with and without LoRA on the experts."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = saved["all_sparse"][0]
    spec = LoraSpec(rank=4, alpha=8, train_norms=True, experts=experts)
    model = load_model(path, "bf16", dtype=torch.float32, lora=spec)
    randomize_lora_b(model, 0.2)
    save_adapter(model, spec, tmp_path / "adapter", str(path))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] + experts * ["gate_proj", "up_proj", "down_proj"]
    assert config["target_modules"] == targets
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ids = _ids(2, 20, seed=11)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, model.logits(ids), atol=1e-4, rtol=1e-4)


# --- NVFP4 checkpoint -------------------------------------------------------------------------

_MODELOPT_EXPORT = """
import json, sys, warnings
warnings.simplefilter("ignore")
import torch, transformers
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from safetensors import safe_open
from pathlib import Path
src, out = sys.argv[1], sys.argv[2]
model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, lambda m: m(torch.randint(0, 320, (4, 32))))
export_hf_checkpoint(model, export_dir=out)
layout = {}
for shard in sorted(Path(out).glob("*.safetensors")):
    with safe_open(str(shard), "pt") as fh:
        layout.update({k: [str(fh.get_slice(k).get_dtype()), list(fh.get_slice(k).get_shape())] for k in fh.keys()})
quant = json.loads((Path(out) / "hf_quant_config.json").read_text())["quantization"]
print(json.dumps({"layout": layout, "exclude": quant["exclude_modules"]}))
"""


def _layout(directory: Path) -> dict[str, list]:
    layout = {}
    for shard in list_shards(directory):
        with safe_open(str(shard), "pt") as fh:
            layout.update({k: [str(fh.get_slice(k).get_dtype()), list(fh.get_slice(k).get_shape())] for k in fh.keys()})
    return layout


def test_nvfp4_checkpoint_has_modelopts_moe_layout(saved, tmp_path):
    pytest.importorskip("modelopt")
    path = saved["renorm"][0]
    proc = subprocess.run([sys.executable, "-c", _MODELOPT_EXPORT, str(path), str(tmp_path / "modelopt")],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise AssertionError(f"modelopt export failed:\n{proc.stderr[-3000:]}")
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    out = tmp_path / "ours"
    out.mkdir()
    shards = list_shards(path)
    plan = plan_checkpoint(shards, ["lm_head"])
    amax = {module: 1.0 + (".experts.3." in module) for module in plan.quantized.values()}
    scales = input_scales(plan, amax)
    write_shards(shards, out, plan, scales, torch.bfloat16, "rtn")
    exclude = sorted({"lm_head", *plan.excluded})
    write_configs(path, out, "NVFP4", exclude, torch.bfloat16)
    ours = _layout(out)
    assert ours == theirs["layout"]  # per-expert names, dtypes, shapes; routers 16-bit
    assert "model.layers.0.mlp.experts.7.down_proj.weight_scale_2" in ours
    assert ours["model.layers.0.mlp.gate.weight"] == ["BF16", [8, 64]]
    # The routers are listed as excluded, as modelopt lists them (it also names the embedding).
    routers = [f"model.layers.{i}.mlp.gate" for i in (0, 2, 3)]
    assert set(routers) <= set(theirs["exclude"]) and exclude == ["lm_head", *routers]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == exclude
    with safe_open(str(list_shards(out)[0]), "pt") as fh:
        # One expert's gate/up share a global scale; every expert of a layer shares the input scale.
        e0 = "model.layers.0.mlp.experts.0"
        assert torch.equal(fh.get_tensor(f"{e0}.gate_proj.weight_scale_2"), fh.get_tensor(f"{e0}.up_proj.weight_scale_2"))
        up_scales = {float(fh.get_tensor(f"model.layers.0.mlp.experts.{e}.up_proj.input_scale")) for e in range(8)}
        assert up_scales == {float(global_scale_from_amax(torch.tensor(2.0)))}  # expert 3's amax is the layer's
    # A calibration without expert statistics (what calibrate collects today) is refused, saying why.
    with pytest.raises(QerlError, match="no statistics for the MoE experts"):
        input_scales(plan, {m: 1.0 for m in plan.quantized.values() if ".experts." not in m})
    # It loads back: the same bases as quantizing the bf16 model on the fly.
    from_ckpt = load_model(out, "nvfp4", dtype=torch.float32)
    on_the_fly = load_model(path, "nvfp4", dtype=torch.bfloat16)
    for name, t in on_the_fly.state_dict().items():
        if name.endswith(("qweight", "scales", "global_scale")):
            assert torch.equal(from_ckpt.state_dict()[name], t), name


# --- memory planner ---------------------------------------------------------------------------

def test_memory_planner_counts_every_expert(saved):
    config = json.loads((saved["renorm"][0] / "config.json").read_text())
    c = DecoderConfig.from_hf(config)
    model = init_random_model(config, "bf16", dtype=torch.float32)
    assert weight_elements(c) == sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith(".weight"))
    # Norm noise buffers and q/k norms aside, the bytes are the weights'.
    assert abs(weight_bytes(c, "bf16", torch.float32) - model_memory_bytes(model)) < 0.01 * model_memory_bytes(model)
    for experts in (False, True):
        lora = init_random_model(config, "bf16", dtype=torch.float32, lora=LoraSpec(4, 8, experts=experts))
        assert lora_params(c, 4, experts) == sum(p.numel() for p in lora_parameters(lora))


class _ReferenceGrouped:
    """A grouped GEMM by the book: expert e's weight on rows offsets[e]:offsets[e + 1] (what
    humming's grouped GEMM computes on a GPU), over the experts' own linears."""

    def __init__(self, linears):
        self.linears, self.calls = linears, 0

    def matmul(self, rows, offsets, deterministic=True, active=None, max_rows=None):
        self.calls += 1
        bounds = offsets.tolist()
        return torch.cat([self.linears[e](rows[bounds[e]:bounds[e + 1]]) for e in range(len(self.linears))])


def test_grouped_experts_compute_what_the_per_expert_loop_does(saved):
    from qerl_pipe.model.moe import GroupedExperts

    model = load_model(saved["all_sparse"][0], "bf16", dtype=torch.float32)
    ids = _ids(batch=3, length=11)
    with torch.no_grad():
        loop = model.logits(ids)
    layers = [m.mlp for m in model.layers]
    for moe in layers:
        moe.grouped = GroupedExperts(_ReferenceGrouped([e.gate_up_proj for e in moe.experts]),
                                     _ReferenceGrouped([e.down_proj for e in moe.experts]), len(moe.experts))
    with torch.no_grad():
        grouped = model.logits(ids)
    torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=1e-5)
    # One grouped call per projection and layer in a forward without autograd ...
    assert all(m.grouped.gate_up.calls == m.grouped.down.calls == 1 for m in layers)
    # ... and none with it: training goes through the experts' own linears (their LoRA, dX).
    with torch.enable_grad():
        model.logits(ids)
    assert all(m.grouped.gate_up.calls == 1 for m in layers)


def test_grouped_expert_copies_need_a_gpu_and_count_in_the_plan(saved):
    from qerl_pipe.jobs.step_plan import copy_bytes_asked
    from qerl_pipe.memory.step import expert_copy_bytes
    from qerl_pipe.model.kernel_copies import attach_grouped_experts

    config = json.loads((saved["all_sparse"][0] / "config.json").read_text())
    c = DecoderConfig.from_hf(config)
    model = init_random_model(config, "nvfp4", dtype=torch.bfloat16)
    assert attach_grouped_experts(model) == 0 and all(m.mlp.grouped is None for m in model.layers)  # CPU
    experts = [lin for m in model.layers for e in m.mlp.experts for lin in (e.gate_up_proj, e.down_proj)]
    stored = sum(lin.qweight.numel() * 4 + lin.scales.numel() + 4 for lin in experts)
    assert expert_copy_bytes(c) == stored  # the experts' NVFP4 bytes again
    dense = {k: v for k, v in config.items() if "expert" not in k}
    assert expert_copy_bytes(DecoderConfig.from_hf({**dense, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})) == 0
    assert copy_bytes_asked(c, "nvfp4", torch.device("cpu"), None, True, lora_experts=False) == 0


@pytest.mark.parametrize("base_format", ["bf16", "nvfp4"])
def test_stacked_experts_run_torch_grouped_gemm_in_training_and_inference(saved, monkeypatch, base_format):
    """Experts stacked in place (each expert's buffers views of its projection's stack: no copy)
    under torch's grouped GEMM compute the loop's logits without autograd, and its gradients with
    it (NVFP4: the stack dequantized without global scales, applied per output row; dX from the
    stack dequantized again); experts with LoRA stay on the loop; the CPU keeps the loop."""
    from qerl_pipe.kernels import torch_grouped
    from qerl_pipe.model.kernel_copies import all_experts_grouped, attach_grouped_experts, detach_grouped_experts

    model = load_model(saved["all_sparse"][0], base_format, dtype=torch.float32, lora=LoraSpec(4, 8))
    randomize_lora_b(model, 0.2)
    ids, params = _ids(batch=3, length=11), lora_parameters(model)
    with torch.no_grad():
        loop = model.logits(ids)
    loop_grads = torch.autograd.grad(model.logits(ids).square().mean(), params)
    assert attach_grouped_experts(model) == 0 and not all_experts_grouped(model)  # the CPU keeps the loop
    monkeypatch.setattr(torch_grouped, "runs_here", lambda device, dtype: True)  # as on an sm_90 GPU
    assert attach_grouped_experts(model) == 0 and all_experts_grouped(model)  # no bytes added ...
    for moe in (m.mlp for m in model.layers):  # ... every expert's buffers are slices of the stacks
        assert moe.grouped is moe.stacked
        for name in moe.experts[0].gate_up_proj.fmt.buffers:
            stack = getattr(moe.stacked.gate_up, name)
            assert stack.shape[0] == len(moe.experts)
            assert all(getattr(e.gate_up_proj, name).data_ptr() == stack[i].data_ptr() for i, e in enumerate(moe.experts))
    calls = []
    matmul = torch_grouped.StackedExperts.matmul
    monkeypatch.setattr(torch_grouped.StackedExperts, "matmul",
                        lambda self, *a, **kw: calls.append(1) or matmul(self, *a, **kw))
    with torch.no_grad():
        grouped = model.logits(ids)
    torch.testing.assert_close(grouped, loop, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2 * len(model.layers)  # one grouped GEMM per projection and layer
    model.gradient_checkpointing = True
    for g, r in zip(torch.autograd.grad(model.logits(ids).square().mean(), params), loop_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-4)
    assert len(calls) == 3 * 2 * len(model.layers)  # training: the forward and its recompute too
    from qerl_pipe.engine.graphs import model_fingerprint

    from qerl_pipe.model.moe import inference_modules

    grouped_print = model_fingerprint(model)
    # The engine's per-generate walks skip the experts of grouped layers (their forward reads the stacks).
    experts = {id(e) for layer in model.layers for e in layer.mlp.experts.modules()}
    assert {id(m) for m in inference_modules(model)} == {id(m) for m in model.modules()} - experts
    detach_grouped_experts(model)
    assert model_fingerprint(model) != grouped_print  # graphs captured over the grouped experts go stale
    assert [id(m) for m in inference_modules(model)] == [id(m) for m in model.modules()]
    with torch.no_grad():
        assert torch.equal(model.logits(ids), loop)  # the views serve the loop as the buffers did
    with_lora = load_model(saved["all_sparse"][0], base_format, dtype=torch.float32, lora=LoraSpec(4, 8, experts=True))
    assert attach_grouped_experts(with_lora) == 0 and not all_experts_grouped(with_lora)


# --- the CLI pipeline ---------------------------------------------------------------------------

def test_pipeline_quantizes_trains_and_exports_a_peft_adapter(tmp_path):
    """quantize -> build-engine -> 2 train steps -> export peft, on a tiny Qwen3-MoE (CPU, seconds);
    the adapter loads in `peft` over the original transformers model and computes our engine's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qerl_pipe.jobs.engine_artifact import load_engine
    from qerl_pipe.model.peft import load_adapter_weights

    source = make_tiny_model(tmp_path / "moe", "qwen3_moe", num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, norm_topk_prob=True)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stages: [quantize, build-engine, train, export]\nmodel:\n  source: {source}\n"
                      "export:\n  format: peft\n")
    settings = ["quantize.quality.perplexity=never", "engine.max_seq_len=64", "engine.max_batch=8", "engine.device=cpu",
                "engine.dtype=float32", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2",
                "train.max_new_tokens=4", "train.eval_limit=0", "train.device=cpu", "train.lora.experts=true"]
    store = tmp_path / "artifacts"
    out = last_line(cli("run", recipe, "--artifacts", store, *[a for s in settings for a in ("--set", s)]))
    (engine_dir,) = store.glob("build-engine-*")
    quantized = next(store.glob("quantize-*"))
    assert cli("verify", quantized).exit_code == 0
    with safe_open(str(list_shards(quantized)[0]), "pt") as fh:
        assert fh.get_tensor("model.layers.0.mlp.experts.3.down_proj.weight").dtype == torch.uint8
        assert fh.get_tensor("model.layers.0.mlp.gate.weight").dtype == torch.bfloat16
    adapter = read_adapter(out)
    assert adapter.spec.experts and "base_model.model.model.layers.2.mlp.experts.3.down_proj.lora_B.weight" in adapter.shapes
    model, _ = load_engine(engine_dir, "cpu", lora=adapter.spec)  # eval's path: the adapter over the engine
    load_adapter_weights(model, out / "adapter_model.safetensors")
    # PEFT over the original transformers model computes what our decoder computes with the
    # adapter over that same (bf16) base, and the adapter changes the outputs.
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    reference = load_model(source, "bf16", dtype=torch.float32, lora=adapter.spec)
    load_adapter_weights(reference, out / "adapter_model.safetensors")
    ids = _ids(1, 12, seed=4) % 300  # the tokenizer's vocabulary
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = PeftModel.from_pretrained(hf, str(out)).eval()
    assert not [w for w in caught if "missing adapter keys" in str(w.message) or "unexpected" in str(w.message)]
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, reference.logits(ids), atol=1e-4, rtol=1e-4)


def test_nvfp4_stack_decodes_through_the_grouped_w4a16_gemm(monkeypatch):
    """An NVFP4 stack in inference with at most `MAX_PASS_TOKENS` rows per expert (a decode step)
    runs our grouped W4A16 GEMM, given the routing's active experts; more rows, autograd or a
    dense stack keep dequantize + torch's grouped GEMM. (The kernel's numbers: the GPU tests.)"""
    from qerl_pipe.formats.nvfp4 import quantize_nvfp4
    from qerl_pipe.kernels import cuda_ext
    from qerl_pipe.model.kernel_copies import stack_expert_buffers
    from qerl_pipe.model.linear import QuantLinear

    linears = [QuantLinear(64, [32], ["w"], "nvfp4", torch.bfloat16, "cpu") for _ in range(3)]
    for lin in linears:
        lin.set_base(quantize_nvfp4(torch.randn(32, 64)))
    stack = stack_expert_buffers(linears)
    rows, offsets = torch.randn(5, 64, dtype=torch.bfloat16), torch.tensor([0, 2, 2, 5])
    active = torch.tensor([0, 2, -1], dtype=torch.int32)
    calls = []

    def grouped_gemm(rows_, qweight, scales, global_scale, offsets_, n, k, max_rows, active_):
        calls.append((max_rows, active_))
        assert qweight is stack.qweight and offsets_ is offsets and (n, k) == (32, 64)
        return torch.zeros(rows_.shape[0], n, dtype=rows_.dtype)

    monkeypatch.setattr(cuda_ext, "available", lambda device: True)  # as on a Hopper GPU
    monkeypatch.setattr(cuda_ext, "grouped_gemm", grouped_gemm)
    # ... whose dequantize pass the other calls take (its numbers are not what this test checks)
    monkeypatch.setattr(cuda_ext, "dequantize", lambda w: torch.zeros(w.out_features, w.in_features,
                                                                      dtype=torch.bfloat16))
    with torch.no_grad():
        out = stack.matmul(rows, offsets, active=active, max_rows=3)
        assert calls == [(3, active)] and out.abs().sum() == 0
        stack.matmul(rows, offsets, max_rows=cuda_ext.MAX_PASS_TOKENS + 1)  # a prefill: dequantize
    stack.matmul(rows.requires_grad_(), offsets, max_rows=3)  # training: autograd through torch's path
    assert len(calls) == 1


def test_humming_copies_leave_few_rows_per_expert_to_the_stack():
    """With humming's copies, a projection runs our grouped W4A16 GEMM on the stack where each
    expert gets at most FEW_ROWS rows and the routing listed the active experts, humming's copy
    otherwise (and where our kernel does not run)."""
    from qerl_pipe.kernels.humming_experts import FEW_ROWS, HummingOrStack

    class Fake:
        num_experts, nbytes = 4, 7

        def __init__(self, name: str):
            self.name, self.runs = name, True

        def matmul(self, rows, offsets, deterministic=True, active=None, max_rows=None):
            return self.name

        def runs_grouped_w4a16(self, rows, max_rows):
            return self.runs

    stack = Fake("stack")
    experts = HummingOrStack(Fake("humming"), stack)
    rows, offsets, active = torch.zeros(1), torch.zeros(2), torch.zeros(1)
    assert experts.matmul(rows, offsets, active=active, max_rows=FEW_ROWS) == "stack"
    assert experts.matmul(rows, offsets, active=active, max_rows=FEW_ROWS + 1) == "humming"
    assert experts.matmul(rows, offsets, max_rows=1) == "humming"  # the torch routing lists no experts
    stack.runs = False
    assert experts.matmul(rows, offsets, active=active, max_rows=1) == "humming"
    assert experts.nbytes == 7 and experts.num_experts == 4
