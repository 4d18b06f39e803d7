"""Full fine-tuning (`train.adapter: full`) on tiny models (CPU): every weight trains through float32
masters, the shared model serves the next rollout, LM-head gradients, and the HF naming."""

from __future__ import annotations

import pytest
import torch

from qerl_pipe.model.random_init import init_random_model
from qerl_pipe.engine import Engine, plan_limits
from qerl_pipe.jobs.train_config import train_config
from qerl_pipe.model.full import FullTraining, full_training_bytes, make_fully_trainable
from qerl_pipe.model.load import load_model
from qerl_pipe.model.lora import LoraSpec
from qerl_pipe.model.save import hf_tensors
from qerl_pipe.recipe import TrainSection
from qerl_pipe.rl.algo.logprobs import sequence_logprobs
from qerl_pipe.rl.loop.trainer import Trainer
from qerl_pipe.rl.task.tasks import load_problems, render_prompt
from tests.conftest import make_tiny_model
from tests.rl.test_rl_trainer import CONFIG, rollout_batch, trainer_sampling


@pytest.fixture(scope="module")
def tiny_tied_qwen2(tmp_path_factory):
    """Qwen2 (q/k/v biases) with the LM head tied to the embedding."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-tied"), "qwen2", tie_word_embeddings=True)


def _full_trainer(model_dir, dtype: torch.dtype, **overrides) -> Trainer:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    values = dict(adapter="full", steps=3, prompts_per_step=4, group_size=4, max_new_tokens=12, lr=1e-2,
                  temperature=0.5, micro_batch_size=6, gradient_checkpointing=True, aqn={"schedule": "none"},
                  rewards={"accuracy": 0.0, "custom": ["tests.rl.test_rl_trainer:letter_e"]})
    section = TrainSection.model_validate({**values, **overrides})
    model = load_model(model_dir, "bf16", dtype=dtype)
    limits = plan_limits(model.config, max_seq_len=128, max_batch=32, dtype=dtype)
    problems = load_problems("arithmetic:64", seed=section.seed)
    prompts = [render_prompt(tokenizer, p, section.instruction) for p in problems]
    return Trainer(model, Engine(model, limits), tokenizer, problems, prompts, train_config(section),
                   (tokenizer.eos_token_id,))


@pytest.mark.parametrize("fixture, dtype", [("tiny_llama", torch.float32), ("tiny_tied_qwen2", torch.bfloat16)])
def test_a_few_full_steps_change_every_weight(request, fixture, dtype):
    trainer = _full_trainer(request.getfixturevalue(fixture), dtype)
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # Every weight is a trainable parameter: linears (and Qwen2's q/k/v biases), norms, embedding, head.
    assert not [n for n, _ in model.named_buffers() if n.endswith((".weight", ".bias"))]
    assert all(p.requires_grad for p in model.parameters())
    tied = model.config.tie_word_embeddings
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    if fixture == "tiny_tied_qwen2":
        assert tied and any(n.endswith("qkv_proj.bias") for n in before)
    for _ in range(2):
        record = trainer.step()
        assert record["grad_norm"] > 0 and record["kept_groups"] == 4
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert unchanged == []
    assert len(before) == len(trainer.params) == len(trainer.full.weights)
    if dtype == torch.float32:  # the weights are their own masters
        assert all(m is w for m, w in zip(trainer.params, trainer.full.weights))
    else:  # float32 masters, the model's weights their rounding; no bf16 gradient is kept
        assert all(m.dtype == torch.float32 and m is not w for m, w in zip(trainer.params, trainer.full.weights))
        for m, w in zip(trainer.params, trainer.full.weights):
            assert torch.equal(w, m.detach().to(w.dtype)) and w.grad is None


def test_the_shared_model_serves_the_rollout_after_each_update(tiny_llama):
    """No copy to sync and nothing stale: after updates, the engine samples from the updated weights."""
    trainer = _full_trainer(tiny_llama, torch.float32, lr=5e-2)
    pointers = [p.data_ptr() for p in trainer.model.parameters()]
    first = trainer.engine.generate(trainer.prompts[:4], n=2, sampling=trainer_sampling(trainer))
    for _ in range(2):
        trainer.step()
    # Updated in place: addresses a captured CUDA graph recorded stay valid.
    assert [p.data_ptr() for p in trainer.model.parameters()] == pointers
    out = trainer.engine.generate(trainer.prompts[:4], n=2, sampling=trainer_sampling(trainer))
    batch = rollout_batch(out, trainer.prompts, "cpu")
    with torch.no_grad():
        logp, _ = trainer._logprobs(batch)
    mask = batch.response_mask.bool()
    assert (logp - batch.rollout_logp)[mask].abs().max() < 1e-4
    assert out.tokens != first.tokens  # the policy moved, and the engine saw it


def test_the_lm_head_gets_its_gradient_through_the_chunked_logprobs():
    model = init_random_model(CONFIG, "bf16", seed=0, dtype=torch.float32)
    make_fully_trainable(model)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    attention, response = torch.ones_like(ids), torch.zeros_like(ids)
    response[:, 4:] = 1
    weights = torch.randn(2, 9, generator=torch.Generator().manual_seed(1))
    logp, _ = sequence_logprobs(model, ids, attention, response, temperature=0.7, chunk=3)
    (logp * weights).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    full = torch.log_softmax(model.logits(ids, attention_mask=attention).float() / 0.7, dim=-1)
    want = full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1) * response[:, 1:]
    (want * weights[:, 1:]).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, atol=1e-6, rtol=1e-4, msg=n)
    assert float(ours["lm_head.weight"].abs().max()) > 0


def test_full_training_refuses_a_4bit_base_or_an_adapter():
    with pytest.raises(ValueError, match="needs a bf16 base, not nvfp4"):
        FullTraining(init_random_model(CONFIG, "nvfp4", dtype=torch.float32))
    with pytest.raises(ValueError, match="carries a LoRA adapter"):
        FullTraining(init_random_model(CONFIG, "bf16", dtype=torch.float32, lora=LoraSpec(2, 4)))
    with pytest.raises(ValueError, match="needs the base policy"):
        TrainSection(adapter="full", kl_coef=0.1)


def test_hf_names_split_the_fused_projections_and_skip_a_tied_head():
    model = init_random_model({**CONFIG, "tie_word_embeddings": True}, "bf16", dtype=torch.float32)
    make_fully_trainable(model)  # every weight a parameter, so they can be counted below
    names = dict(hf_tensors(model))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    qkv = model.layers[0].self_attn.qkv_proj
    got = torch.cat([names[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(got, qkv.weight)
    assert names["model.layers.1.mlp.up_proj.weight"].shape == (128, 64)
    # Every element once: the HF tensors hold exactly the model's weights.
    assert sum(t.numel() for t in names.values()) == sum(p.numel() for p in model.parameters())


def test_full_training_memory_is_16_bytes_a_bf16_weight():
    assert full_training_bytes(10, torch.bfloat16) == 160  # master + gradient + two moments, float32
    assert full_training_bytes(10, torch.float32) == 120  # the weight is its own master
