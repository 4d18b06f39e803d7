"""An NVFP4 MoE's experts through humming's grouped GEMM, on a GPU (`pytest -m gpu`): the same
logits as the per-expert path, the same bits on every run, the engine attaching and using them,
and a model whose experts carry LoRA keeping the per-expert path."""

from __future__ import annotations

import pytest
import torch

from bench.random_model import init_random_model
from bench.shapes import QWEN3_MOE_SHAPES
from qerl_pipe.engine import Engine, SamplingParams, plan_limits
from qerl_pipe.kernels import humming_backend
from qerl_pipe.model.kernel_copies import attach_grouped_experts, detach_grouped_experts
from qerl_pipe.model.lora import LoraSpec
from qerl_pipe.model.moe import SparseMoE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Qwen3-30B-A3B's routing (16 of its experts, 8 per token) at a small width.
CONFIG = {**QWEN3_MOE_SHAPES["qwen3-30b-a3b"], "hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 2, "head_dim": 64, "num_experts": 16, "moe_intermediate_size": 256,
          "vocab_size": 1024}


@pytest.fixture(scope="module", autouse=True)
def _humming() -> None:
    if not humming_backend.available("cuda"):
        pytest.skip("humming-kernels do not run here (see the log)")


def _layers(model) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def test_grouped_experts_match_the_per_expert_path_and_repeat() -> None:
    torch.manual_seed(0)
    model = init_random_model(CONFIG, "nvfp4", device="cuda")
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 37), device="cuda")
    with torch.no_grad():
        loop = model.logits(ids).float()
        assert attach_grouped_experts(model) > 0 and all(m.grouped is not None for m in _layers(model))
        grouped = model.logits(ids).float()
        again = model.logits(ids).float()
    assert float((grouped - loop).norm() / loop.norm()) < 2e-2
    assert torch.equal(grouped, again)
    detach_grouped_experts(model)
    assert all(m.grouped is None for m in _layers(model))


def test_engine_uses_grouped_experts_and_expert_lora_keeps_the_loop() -> None:
    torch.manual_seed(1)
    model = init_random_model(CONFIG, "nvfp4", device="cuda")
    engine = Engine(model, plan_limits(model.config, max_batch=4, max_seq_len=64))
    assert all(m.grouped is not None for m in _layers(model))
    out = engine.generate([[1, 2, 3], [4, 5, 6, 7]], sampling=SamplingParams(temperature=0, max_new_tokens=8))
    assert all(len(t) == 8 for t in out.tokens)
    with_lora = init_random_model(CONFIG, "nvfp4", device="cuda", lora=LoraSpec(rank=16, alpha=32, experts=True))
    assert attach_grouped_experts(with_lora) == 0 and all(m.grouped is None for m in _layers(with_lora))
