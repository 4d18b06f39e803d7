"""The RL step on a tiny random model (CPU): chunked logprobs, micro-batching = one big batch,
AQN noise in rollouts only, overlong masking, dynamic sampling, KL, and GRPO raising a reward."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from qerl_pipe.model.random_init import init_random_model
from qerl_pipe.engine import Engine, plan_limits
from qerl_pipe.jobs.train_config import train_config
from qerl_pipe.model.load import load_model
from qerl_pipe.model.lora import LoraSpec, apply_lora, lora_disabled, lora_parameters
from qerl_pipe.model.norm import RMSNorm
from qerl_pipe.recipe import TrainSection
from qerl_pipe.rl.algo.aqn import noisy_norms
from qerl_pipe.rl.algo.logprobs import sequence_logprobs
from qerl_pipe.rl.loop.trainer import Group, Trainer, build_batch
from qerl_pipe.rl.task.tasks import load_problems, render_prompt

CONFIG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


def letter_e(completion: str, problem) -> float:
    """A verifiable reward a random model can learn fast: the share of 'e' among the characters."""
    return completion.count("e") / max(1, len(completion))


def e_on_odd_answers(completion: str, problem) -> float:
    """letter_e for problems with an odd answer, a constant 0 otherwise (flat groups)."""
    return letter_e(completion, problem) if int(problem.answer) % 2 else 0.0


def _random_lora_model(base_format: str = "nvfp4"):
    model = init_random_model(CONFIG, base_format, seed=0, dtype=torch.float32, lora=LoraSpec(4, 8))
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    return model


def test_sequence_logprobs_equal_the_full_softmax_with_gradients():
    model = _random_lora_model()
    ids = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(ids)
    attention[1, 7:] = 0
    response = torch.zeros_like(ids)
    response[:, 4:] = 1
    response[1, 7:] = 0
    weights = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))

    logp, entropy = sequence_logprobs(model, ids, attention, response, temperature=0.7, chunk=4)
    (logp * weights).sum().backward()
    ours = [p.grad.clone() for p in lora_parameters(model)]
    model.zero_grad()

    full = torch.log_softmax(model.logits(ids, attention_mask=attention).float() / 0.7, dim=-1)
    want = torch.zeros(3, 10)
    want[:, 1:] = full[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    want_entropy = torch.zeros(3, 10)
    want_entropy[:, 1:] = -(full.exp() * full).sum(-1)[:, :-1]
    want, want_entropy = want * response, want_entropy * response
    (want * weights).sum().backward()
    torch.testing.assert_close(logp, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=1e-5)
    for got, ref in zip(ours, [p.grad for p in lora_parameters(model)]):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-4)
    assert not entropy.requires_grad


# ---------------------------------------------------------------------- a Trainer on a tiny model


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    from transformers import AutoTokenizer

    return tiny_llama, AutoTokenizer.from_pretrained(str(tiny_llama))


def make_trainer(tiny, **overrides) -> Trainer:
    model_dir, tokenizer = tiny
    values = dict(steps=4, prompts_per_step=4, group_size=4, max_new_tokens=12, lr=1e-2, micro_batch_size=16,
                  gradient_checkpointing=False, rewards={"accuracy": 0.0, "custom": ["tests.rl.test_rl_trainer:letter_e"]},
                  aqn={"num_stages": 3})
    section = TrainSection.model_validate({**values, **overrides})
    model = load_model(model_dir, "nvfp4", dtype=torch.float32)
    apply_lora(model, LoraSpec(section.lora.rank, section.lora.alpha), seed=section.seed)
    limits = plan_limits(model.config, max_seq_len=128, max_batch=32, dtype=torch.float32)
    problems = load_problems("arithmetic:64", seed=section.seed)
    prompts = [render_prompt(tokenizer, p, section.instruction) for p in problems]
    return Trainer(model, Engine(model, limits), tokenizer, problems, prompts, train_config(section),
                   (tokenizer.eos_token_id,))


def _lora_grads(trainer: Trainer, micro_batch_size: int, loss: str, batch) -> list[torch.Tensor]:
    trainer.cfg = replace(trainer.cfg, micro_batch=micro_batch_size, loss=replace(trainer.cfg.loss, loss_type=loss))
    captured = []
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: captured.append([p.grad.clone() for p in trainer.params])  # no update
    try:
        trainer._update(batch)
    finally:
        trainer.optimizer.step = step
    return captured[0]


@pytest.mark.parametrize("loss", ["dapo", "grpo", "dr_grpo"])
def test_micro_batches_give_the_gradient_of_one_big_batch(tiny, loss):
    trainer = make_trainer(tiny)
    gen = torch.Generator().manual_seed(3)
    groups = []
    for g in range(3):  # responses of different lengths, rewards with a spread
        prompt = torch.randint(3, 300, (5 + g,), generator=gen).tolist()
        responses = [torch.randint(3, 300, (2 + 3 * i,), generator=gen).tolist() for i in range(4)]
        groups.append(Group(prompt, responses, [[-1.0] * len(r) for r in responses], ["stop"] * 4,
                            torch.rand(4, generator=gen)))
    whole = _lora_grads(trainer, 12, loss, groups)
    split = _lora_grads(trainer, 5, loss, groups)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
    assert any(float(a.abs().max()) > 0 for a in whole)


def test_overlong_rows_get_no_loss_and_the_batch_is_aligned():
    groups = [Group([5, 6, 7], [[1, 2], [3, 4, 9]], [[-0.5, -0.25], [-1.0, -2.0, -3.0]], ["stop", "length"],
                    torch.tensor([1.0, 0.0]))]
    batch = build_batch(groups, torch.tensor([1.0, -1.0]), mask_overlong=True, device=torch.device("cpu"))
    assert batch.input_ids.tolist() == [[5, 6, 7, 1, 2, 0], [5, 6, 7, 3, 4, 9]]
    assert batch.response_mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]]
    assert batch.rollout_logp[0, 3:5].tolist() == [-0.5, -0.25]
    (mb,) = batch.split(8)
    kept = build_batch(groups, torch.tensor([1.0, -1.0]), mask_overlong=False, device=torch.device("cpu"))
    assert mb.input_ids.shape == (2, 6) and kept.loss_mask.tolist() == kept.response_mask.tolist()


@pytest.mark.parametrize("apply_in_training", [False, True])
def test_aqn_noise_reaches_rollouts_and_training_only_when_asked(tiny, apply_in_training):
    # Stages of 3 steps: step 0 noise-free, steps >= 1 noisy.
    trainer = make_trainer(tiny, steps=3, aqn={"num_stages": 3, "sigma_start": 0.05, "sigma_end": 0.01,
                                              "apply_in_training": apply_in_training})
    norms = noisy_norms(trainer.model)
    others = [m for m in trainer.model.modules() if isinstance(m, RMSNorm) and all(m is not n for n in norms)]
    seen: dict[str, list[float]] = {"rollout": [], "train": []}

    def spy(kind, fn):
        def wrapped(*args, **kwargs):
            seen[kind].append(max(float(n.noise.abs().max()) for n in norms))
            assert all(float(m.noise.abs().max()) == 0 for m in others)  # the final norm, q/k norms: never
            return fn(*args, **kwargs)
        return wrapped

    trainer.engine.generate = spy("rollout", trainer.engine.generate)
    trainer.model.forward = spy("train", trainer.model.forward)
    records = [trainer.step() for _ in range(3)]
    assert [r["sigma"] for r in records] == [0.0, 0.05, pytest.approx(0.01)]
    assert seen["rollout"][0] == 0.0 and seen["rollout"][1] > 0.01 and seen["rollout"][2] > 0.002
    noisy_training = [x for x in seen["train"][len(seen["train"]) // 3:] if x > 0]
    assert bool(noisy_training) == apply_in_training
    assert all(float(n.noise.abs().max()) == 0 for n in norms)  # cleared after the step


METRIC_KEYS = {"step", "reward_mean", "reward_std", "accuracy", "entropy", "response_length_mean", "truncation_rate",
               "clip_fraction", "kl", "sigma", "lr", "rollout_tokens_per_s", "train_tokens_per_s", "step_seconds",
               "peak_gpu_memory_gib", "loss", "grad_norm", "kept_groups", "draws"}


@pytest.mark.slow
def test_grpo_raises_a_verifiable_reward(tiny):
    # The tiny model's LM head (init std 0.02) can barely move a logit; temperature 0.25 gives the
    # adapter the leverage a real model has (and the same temperature enters the logprobs).
    trainer = make_trainer(tiny, steps=16, loss="grpo", prompts_per_step=4, group_size=8, max_new_tokens=16,
                           lr=2e-2, temperature=0.25, warmup_steps=1, aqn={"schedule": "none"})
    records = [trainer.step() for _ in range(16)]
    assert METRIC_KEYS <= records[0].keys()
    assert records[0]["peak_gpu_memory_gib"] is None and records[0]["lr"] == pytest.approx(2e-2)
    first = sum(r["reward_mean"] for r in records[:4]) / 4
    last = sum(r["reward_mean"] for r in records[-4:]) / 4
    assert last > first + 0.08 and last > 4 * first, [round(r["reward_mean"], 3) for r in records]
    assert all(math.isfinite(r["loss"]) and r["entropy"] > 0 for r in records)
    assert records[-1]["entropy"] < records[0]["entropy"]


def test_each_step_keeps_its_first_rollout_with_its_question_and_reward(tiny):
    trainer = make_trainer(tiny, steps=3, aqn={"schedule": "none"},
                           rewards={"accuracy": 0.0, "custom": ["tests.rl.test_rl_trainer:e_on_odd_answers"]})
    draws = []
    generate = trainer.engine.generate
    trainer.engine.generate = lambda prompts, **kw: draws.append((prompts[0], out := generate(prompts, **kw))) or out
    for _ in range(3):
        first_draw = len(draws)
        sample = trainer.step()["sample"]
        prompt, out = draws[first_draw]
        assert sample["completion"] == trainer.tokenizer.batch_decode(out.tokens[:1], skip_special_tokens=True)[0]
        problem = next(p for p in trainer.problems if p.question == sample["question"])
        assert trainer.prompts[trainer.problems.index(problem)] == list(prompt)
        # the parity reward depends on the problem: a question paired with another's completion shows
        assert sample["reward"] == pytest.approx(e_on_odd_answers(sample["completion"], problem))


def test_kl_to_the_base_and_mu_updates(tiny):
    with_kl = make_trainer(tiny, steps=2, kl_coef=0.1, lr=5e-2, aqn={"schedule": "none"})
    first, second = with_kl.step(), with_kl.step()
    assert first["kl"] < 1e-7 < second["kl"]  # a fresh adapter is the base; after an update it is not
    two_updates = make_trainer(tiny, steps=1, mu=2, lr=5e-2, aqn={"schedule": "none"})
    record = two_updates.step()
    # The first update has ratio 1 exactly; the second sees the policy moved by the first.
    assert record["clip_fraction"] > 0 and two_updates.optimizer.state[two_updates.params[0]]["step"] == 2


def test_dynamic_sampling_drops_flat_groups_and_draws_more(tiny):
    trainer = make_trainer(tiny, steps=2, rewards={"accuracy": 0.0, "custom": ["tests.rl.test_rl_trainer:e_on_odd_answers"]},
                           dynamic_sampling={"enabled": True, "max_draws": 4})
    kept = []
    update = trainer._update
    trainer._update = lambda groups: kept.append(groups) or update(groups)
    record = trainer.step()
    assert record["draws"] > 1 and record["zero_variance_fraction"] > 0
    assert record["kept_groups"] == len(kept[0]) <= trainer.cfg.prompts_per_step
    assert all(float(g.rewards.std()) > 0 for g in kept[0])


def test_all_flat_groups_skip_the_passes_but_step_adamw(tiny):
    trainer = make_trainer(tiny, steps=2, rewards={"accuracy": 0.0, "format": 1.0})  # nobody writes \boxed{}
    record = trainer.step()
    assert record["reward_mean"] == 0 and record["entropy"] is None and record["train_tokens"] == 0
    assert trainer.optimizer.state[trainer.params[0]]["step"] == 1


def test_rollouts_sample_from_the_adapter_the_optimizer_just_updated(tiny):
    """One model, no sync: after updates, the engine's logprobs are the trainer's (not the base's)."""
    trainer = make_trainer(tiny, steps=3, lr=5e-2, temperature=0.5, aqn={"schedule": "none"})
    for _ in range(2):
        trainer.step()
    out = trainer.engine.generate(trainer.prompts[:4], n=2, sampling=trainer_sampling(trainer))
    batch = rollout_batch(out, trainer.prompts, "cpu")
    with torch.no_grad():
        logp, _ = trainer._logprobs(batch)
        with lora_disabled(trainer.model):
            base, _ = trainer._logprobs(batch)
    mask = batch.response_mask.bool()
    assert (logp - batch.rollout_logp)[mask].abs().max() < 1e-4
    assert (base - batch.rollout_logp)[mask].abs().max() > 1e-2  # the adapter did move the policy


def rollout_batch(out, prompts, device: str):
    """The training batch of `out`, the engine's 2 samples for each of `prompts[:4]` (rewards 0)."""
    groups = [Group(prompts[p], out.tokens[2 * p:2 * p + 2], out.logprobs[2 * p:2 * p + 2],
                    out.finish_reasons[2 * p:2 * p + 2], torch.zeros(2)) for p in range(4)]
    return build_batch(groups, torch.zeros(8), False, torch.device(device))


def trainer_sampling(trainer: Trainer):
    from qerl_pipe.engine import SamplingParams

    cfg = trainer.cfg
    return SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                          stop_token_ids=trainer.stop_token_ids, seed=123)


def test_non_finite_rollouts_stop_the_run_instead_of_training_on_empty_rewards(tiny):
    """NaN weights give all-zero rewards, flat groups and a 'step' that learns nothing: an error."""
    from qerl_pipe.errors import QerlError

    trainer = make_trainer(tiny)
    dict(trainer.model.named_parameters())["layers.1.input_layernorm.weight"].data.fill_(float("nan"))
    with pytest.raises(QerlError, match=r"train step 0: the rollout's log-probabilities are not finite .*"
                                        r"build-engine --force"):
        trainer.step()


def test_a_non_finite_loss_stops_the_run(tiny):
    from qerl_pipe.errors import QerlError

    trainer = make_trainer(tiny, dynamic_sampling={"enabled": True, "max_draws": 4})
    forward = trainer._logprobs

    def nan_logprobs(batch):
        logp, entropy = forward(batch)
        return logp * float("nan"), entropy
    trainer._logprobs = nan_logprobs
    with pytest.raises(QerlError, match=r"the loss or its gradient are not finite .*lower train.lr"):
        trainer.step()
