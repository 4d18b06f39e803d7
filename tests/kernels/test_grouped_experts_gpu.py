"""A MoE's experts through grouped GEMMs on a GPU (`pytest -m gpu`): humming's for NVFP4, torch's
for bf16. The same logits as the per-expert path, the same bits on every run, the engine attaching
them and decoding in CUDA graphs (the same greedy tokens as eager decode), and a model whose
experts carry LoRA keeping the per-expert path (and eager decode)."""

from __future__ import annotations

import pytest
import torch

from qerl_pipe.model.random_init import init_random_model
from qerl_pipe.model.shapes import QWEN3_MOE_SHAPES
from qerl_pipe.engine import Engine, SamplingParams, plan_limits
from qerl_pipe.kernels import humming_backend, torch_grouped
from qerl_pipe.kernels.humming_experts import HummingOrStack
from qerl_pipe.kernels.torch_grouped import StackedExperts
from qerl_pipe.model.kernel_copies import all_experts_grouped, attach_grouped_experts, detach_grouped_experts
from qerl_pipe.model.lora import LoraSpec, lora_parameters
from qerl_pipe.model.moe import SparseMoE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Qwen3-30B-A3B's routing (16 of its experts, 8 per token) at a small width.
CONFIG = {**QWEN3_MOE_SHAPES["qwen3-30b-a3b"], "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 2, "head_dim": 64, "num_experts": 16, "moe_intermediate_size": 256,
          "vocab_size": 1024}


def _runs(copies: bool) -> None:
    if not torch_grouped.runs_here(torch.device("cuda"), torch.bfloat16):
        pytest.skip("torch's grouped GEMM does not serve bf16 on this GPU")
    if copies and not humming_backend.available("cuda"):
        pytest.skip("humming-kernels do not run here (see the log)")


def _layers(model) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# (base format, humming copies): humming's grouped GEMM for NVFP4 rollouts where its copies are
# made, torch's over the stacked (NVFP4: dequantized) experts otherwise.
CASES = [("nvfp4", True), ("nvfp4", False), ("bf16", False)]


@pytest.mark.parametrize(("base_format", "copies"), CASES)
def test_grouped_experts_match_the_per_expert_path_and_repeat(base_format: str, copies: bool) -> None:
    _runs(copies)
    torch.manual_seed(0)
    model = init_random_model(CONFIG, base_format, device="cuda")
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 37), device="cuda")
    with torch.no_grad():
        loop = model.logits(ids).float()
        attach_grouped_experts(model, copies=copies)
        kind = HummingOrStack if copies else StackedExperts
        assert all(isinstance(m.grouped.gate_up, kind) for m in _layers(model))
        grouped = model.logits(ids).float()
        again = model.logits(ids).float()
    assert _rel(grouped, loop) < 2e-2
    assert torch.equal(grouped, again)
    detach_grouped_experts(model)
    assert not all_experts_grouped(model)


@pytest.mark.parametrize("base_format", ["nvfp4", "bf16"])
def test_training_through_stacked_experts_matches_the_per_expert_path(base_format: str) -> None:
    _runs(copies=False)
    torch.manual_seed(3)
    model = init_random_model(CONFIG, base_format, device="cuda", lora=LoraSpec(rank=16, alpha=32))
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 33), device="cuda")
    params = lora_parameters(model)
    loop = torch.autograd.grad(model.logits(ids).float().square().mean(), params)
    attach_grouped_experts(model, copies=False)
    model.gradient_checkpointing = True
    grads = torch.autograd.grad(model.logits(ids).float().square().mean(), params)
    assert _rel(torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in loop])) < 3e-2


@pytest.mark.parametrize(("base_format", "copies"), CASES)
def test_engine_decodes_grouped_experts_in_cuda_graphs_as_eagerly(base_format: str, copies: bool) -> None:
    _runs(copies)
    torch.manual_seed(1)
    model = init_random_model(CONFIG, base_format, device="cuda")
    # Four prompts in four slots: eager and graphed steps run the same rows (a graph size of 4).
    prompts, greedy = [[1, 2, 3], [4, 5, 6, 7], [8], [9, 10]], SamplingParams(temperature=0, max_new_tokens=12)
    limits = plan_limits(model.config, max_batch=4, max_seq_len=64, cuda_graphs=True)
    eager = Engine(model, limits, cuda_graphs=False, kernel_copies=copies)
    assert all_experts_grouped(model) and not eager.uses_cuda_graphs
    expected = eager.generate(prompts, sampling=greedy).tokens
    graphed = Engine(model, limits, kernel_copies=copies)
    assert graphed.uses_cuda_graphs
    assert graphed.generate(prompts, sampling=greedy).tokens == expected
    assert graphed.captured_graph_sizes


@pytest.mark.parametrize("base_format", ["nvfp4", "bf16"])
def test_expert_lora_keeps_the_per_expert_path_and_eager_decode(base_format: str) -> None:
    _runs(copies=False)
    torch.manual_seed(2)
    model = init_random_model(CONFIG, base_format, device="cuda", lora=LoraSpec(rank=16, alpha=32, experts=True))
    engine = Engine(model, plan_limits(model.config, max_batch=4, max_seq_len=64, cuda_graphs=True))
    assert not all_experts_grouped(model) and not engine.uses_cuda_graphs
    out = engine.generate([[1, 2, 3], [4, 5, 6, 7]], sampling=SamplingParams(temperature=0, max_new_tokens=8))
    assert all(len(t) == 8 for t in out.tokens)


@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_fused_routing_matches_torch_routing(tokens: int) -> None:
    """The one-launch routing (`kernels.triton_moe`) against the reference's torch ops on bf16
    logits: the same experts in the same order, the same sorted rows, and weights within one bf16
    rounding. Distinct logits (a shuffled grid, exact in bf16): on ties the choice is the lower
    expert in both, but torch does not promise the order of tied choices."""
    from qerl_pipe.kernels import triton_moe
    from qerl_pipe.model.moe import sort_by_expert

    experts, k = 128, 8
    grid = (torch.arange(experts, device="cuda") - experts // 2).to(torch.bfloat16) / 16
    logits = torch.stack([grid[torch.randperm(experts, device="cuda")] for _ in range(tokens)])
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(k, dim=-1)
    weights = (weights / weights.sum(dim=-1, keepdim=True)).to(torch.bfloat16)
    ref = sort_by_expert(weights, ids, experts)
    got_w, got_ids, source, inverse, offsets, active = triton_moe.launch_route(logits, k, True, torch.bfloat16)
    assert torch.equal(got_ids.long(), ids)
    with_rows = torch.nonzero(ref.offsets.diff()).flatten()
    assert torch.equal(active[:len(with_rows)].long(), with_rows) and bool((active[len(with_rows):] == -1).all())
    assert torch.equal(source, ref.source) and torch.equal(inverse, ref.inverse) and torch.equal(offsets, ref.offsets)
    assert float((got_w.float() - weights.float()).abs().max()) <= 2**-8
    out = torch.randn(tokens * k, 256, device="cuda", dtype=torch.bfloat16)
    expected = torch.bmm(weights.float().reshape(tokens, 1, k), out[inverse].float().reshape(tokens, k, -1))
    assert _rel(triton_moe.launch_combine(out, weights, inverse), expected.reshape(tokens, -1)) < 5e-3


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("with_active", [True, False])
@pytest.mark.parametrize("passes", ["one", "looped"])
def test_grouped_w4a16_gemm_on_the_nvfp4_stack(tokens: int, with_active: bool, passes: str) -> None:
    """Our grouped W4A16 GEMM (`cuda_ext.grouped_gemm`: the decode path of an NVFP4 stack) against
    each expert's dequantized weight, both projections' shapes (N off a 64-row block: padded rows
    must stay out), the grid over the routed experts alone or over all, the default pass for the
    most rows an expert can get or 8-token passes (more of them in the grid); the same bits again."""
    from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
    from qerl_pipe.kernels import cuda_ext, triton_moe
    from qerl_pipe.model.kernel_copies import stack_expert_buffers
    from qerl_pipe.model.linear import QuantLinear

    if not cuda_ext.available("cuda"):
        pytest.skip("our CUDA kernels do not run here (see the log)")
    torch.manual_seed(4)
    experts, k = 16, 4
    for n, kdim in ((300, 512), (512, 160)):
        linears = [QuantLinear(kdim, [n], ["w"], "nvfp4", torch.bfloat16, "cuda") for _ in range(experts)]
        for lin in linears:
            lin.set_base(quantize_nvfp4(torch.randn(n, kdim, device="cuda") * 0.05))
        dense = [dequantize_nvfp4(lin.base_weight(), torch.float32) for lin in linears]  # the reference
        stack = stack_expert_buffers(linears)
        logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16)
        _, _, source, _, offsets, active = triton_moe.launch_route(logits, k, True, torch.bfloat16)
        rows = torch.randn(tokens, kdim, device="cuda", dtype=torch.bfloat16)[source]
        config = cuda_ext.grouped_config(tokens if passes == "one" else 1)
        with torch.no_grad():
            got = cuda_ext.grouped_gemm(rows, stack.qweight, stack.scales, stack.global_scale, offsets, n, kdim,
                                        tokens, active if with_active else None, config)
            again = cuda_ext.grouped_gemm(rows, stack.qweight, stack.scales, stack.global_scale, offsets, n, kdim,
                                          tokens, active if with_active else None, config)
        bounds = offsets.tolist()
        expected = torch.cat([rows[bounds[e]:bounds[e + 1]].float() @ dense[e].T for e in range(experts)])
        assert _rel(got, expected) < 1e-2, (n, kdim)
        assert torch.equal(got, again)
