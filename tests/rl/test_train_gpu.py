"""The RL loop on CUDA (run on the H200 with `pytest -m gpu`): NVFP4 base through the Triton
kernels, CUDA-graph rollouts that see each optimizer step and each AQN draw, peak memory metric."""

from __future__ import annotations

import math

import pytest
import torch

from qerl_pipe.engine import Engine, SamplingParams, plan_limits
from qerl_pipe.jobs.train_config import train_config
from qerl_pipe.model.load import load_model
from qerl_pipe.model.lora import LoraSpec, apply_lora, lora_disabled
from qerl_pipe.recipe import TrainSection
from qerl_pipe.rl.loop.trainer import Trainer
from qerl_pipe.rl.task.tasks import load_problems, render_prompt
from tests.rl.test_rl_trainer import rollout_batch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.mark.parametrize("base_format", ["nvfp4", "bf16"])
def test_training_steps_on_cuda_with_graph_rollouts(tiny_llama, base_format):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    section = TrainSection.model_validate(dict(
        steps=6, prompts_per_step=4, group_size=4, max_new_tokens=16, lr=5e-2, temperature=0.5,
        micro_batch_size=8, rewards={"accuracy": 0.0, "custom": ["tests.rl.test_rl_trainer:letter_e"]},
        aqn={"num_stages": 3, "sigma_start": 0.05, "sigma_end": 0.01}, kl_coef=0.01, mu=2))
    model = load_model(tiny_llama, base_format, dtype=torch.bfloat16, device="cuda")
    apply_lora(model, LoraSpec(8, 16), seed=0)
    limits = plan_limits(model.config, max_seq_len=128, max_batch=16, dtype=torch.bfloat16, cuda_graphs=True)
    engine = Engine(model, limits)
    assert engine.uses_cuda_graphs
    problems = load_problems("arithmetic:64")
    prompts = [render_prompt(tokenizer, p) for p in problems]
    trainer = Trainer(model, engine, tokenizer, problems, prompts, train_config(section),
                      (tokenizer.eos_token_id,))
    records = [trainer.step() for _ in range(6)]
    for r in records:
        assert math.isfinite(r["loss"]) and r["peak_gpu_memory_gib"] > 0 and r["rollout_tokens_per_s"] > 0
    # K = 3 stages of 2 steps each: stage 0 (steps 0-1) is noise-free.
    assert [r["sigma"] > 0 for r in records] == [False, False, True, True, True, True]
    assert engine.captured_graph_sizes

    # The graphs replay over the LoRA the optimizer updated in place: engine logprobs = trainer's.
    params = SamplingParams(temperature=0.5, max_new_tokens=16, stop_token_ids=(tokenizer.eos_token_id,), seed=7)
    out = engine.generate(prompts[:4], n=2, sampling=params)
    batch = rollout_batch(out, prompts, "cuda")
    with torch.no_grad():
        logp, _ = trainer._logprobs(batch)
        with lora_disabled(model):
            base, _ = trainer._logprobs(batch)
    mask = batch.response_mask.bool()
    ours = (logp - batch.rollout_logp)[mask].abs().mean()
    stale = (base - batch.rollout_logp)[mask].abs().mean()
    print(f"{base_format}: |engine - trainer| mean {ours:.4f}, |engine - base| mean {stale:.4f}")
    assert ours < 0.05 and stale > 2 * ours


def test_full_fine_tuning_on_cuda_with_graph_rollouts(tiny_llama):
    """adapter: full on a bf16 model: a few steps move every weight, in place (same addresses), so
    the decode graphs captured before training are replayed, not recaptured, and sample from the
    updated model: the engine's logprobs are the trainer's over the new weights, not the old."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    section = TrainSection.model_validate(dict(
        adapter="full", steps=4, prompts_per_step=4, group_size=4, max_new_tokens=16, lr=1e-2, temperature=0.5,
        micro_batch_size=8, rewards={"accuracy": 0.0, "custom": ["tests.rl.test_rl_trainer:letter_e"]},
        aqn={"schedule": "none"}))
    model = load_model(tiny_llama, "bf16", dtype=torch.bfloat16, device="cuda")
    limits = plan_limits(model.config, max_seq_len=128, max_batch=16, dtype=torch.bfloat16, cuda_graphs=True)
    engine = Engine(model, limits)
    assert engine.uses_cuda_graphs
    problems = load_problems("arithmetic:64")
    prompts = [render_prompt(tokenizer, p) for p in problems]
    trainer = Trainer(model, engine, tokenizer, problems, prompts, train_config(section),
                      (tokenizer.eos_token_id,))
    params = SamplingParams(temperature=0.5, max_new_tokens=16, stop_token_ids=(tokenizer.eos_token_id,), seed=7)
    engine.generate(prompts[:4], n=2, sampling=params)  # captures the graphs the last rollout replays
    captured = dict(engine.runner.graphs._graphs)
    before = [p.detach().clone() for p in model.parameters()]
    pointers = [p.data_ptr() for p in model.parameters()]

    records = [trainer.step() for _ in range(4)]
    assert all(math.isfinite(r["loss"]) and r["peak_gpu_memory_gib"] > 0 for r in records)
    assert all(m.dtype == torch.float32 for m in trainer.params)  # float32 masters
    unchanged = [n for (n, p), b in zip(model.named_parameters(), before) if torch.equal(p, b)]
    assert unchanged == []  # every weight moved: linears, norms, embedding, head
    assert [p.data_ptr() for p in model.parameters()] == pointers  # in place: the graphs' addresses hold

    out = engine.generate(prompts[:4], n=2, sampling=params)
    assert captured and all(engine.runner.graphs._graphs.get(k) is g for k, g in captured.items())  # not recaptured
    batch = rollout_batch(out, prompts, "cuda")
    with torch.no_grad():
        logp, _ = trainer._logprobs(batch)
        now = [p.detach().clone() for p in model.parameters()]
        for p, b in zip(model.parameters(), before):  # the weights the graphs were first captured over
            p.copy_(b)
        stale, _ = trainer._logprobs(batch)
        for p, n in zip(model.parameters(), now):
            p.copy_(n)
    mask = batch.response_mask.bool()
    ours = (logp - batch.rollout_logp)[mask].abs().mean()
    old = (stale - batch.rollout_logp)[mask].abs().mean()
    print(f"full: |engine - trainer| mean {ours:.4f}, |engine - weights before training| mean {old:.4f}")
    assert ours < 0.05 and old > 2 * ours
