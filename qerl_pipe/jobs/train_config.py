"""The trainer's config at the stage boundary: the recipe's train section with the memory plan's
settings in place of the recipe's bounds (`train_config`), and what the plan changed, in words
for the run's log and report (`plan_changes`)."""

from __future__ import annotations

from qerl_pipe.kernels.fp8 import KV_CODES
from qerl_pipe.memory.plan import GB, MemoryPlan
from qerl_pipe.recipe import TrainSection
from qerl_pipe.rl.algo.aqn import AqnSchedule
from qerl_pipe.rl.algo.logprobs import DEFAULT_CHUNK
from qerl_pipe.rl.algo.losses import PolicyLossConfig
from qerl_pipe.rl.loop.config import TrainConfig
from qerl_pipe.rl.task.rewards import RewardSpec

# The plan's settings as a recipe reader knows them.
SETTING_NAMES = {"kv_slots": "KV slots (engine.max_batch)", "micro_batch": "train.micro_batch_size",
                 "logprob_chunk": "LM-head chunk"}


FP8_TIS_CAP = 2.0  # train.tis_cap unset under FP8 / coded-KV rollouts: the cap verl, TRL and NeMo-RL ship


def tis_cap(section: TrainSection, fp8_rollout: bool = False) -> float | None:
    """The truncated-importance-sampling cap the trainer runs: the recipe's when it sets one (null
    included), else FP8_TIS_CAP for FP8 rollouts, else off."""
    if "tis_cap" in section.model_fields_set or not fp8_rollout:
        return section.tis_cap
    return FP8_TIS_CAP


def fp8_rollout(engine: dict) -> bool:
    """Whether an engine (its engine.json) rolls out in FP8 activations or a coded (fp8, int8) KV cache."""
    return engine.get("activations") == "fp8" or engine["limits"].get("kv_cache") in KV_CODES


def train_config(section: TrainSection, plan: MemoryPlan | None = None, fp8: bool = False) -> TrainConfig:
    """`section` as the trainer runs it: with `plan`, its micro-batch and LM-head chunk; without one
    (a trainer built by hand), the recipe's micro-batch and the default chunk. `fp8`: the engine's
    rollouts run FP8 (`fp8_rollout`), which sets the default `tis_cap`."""
    a, o = section.aqn, section.overlong
    return TrainConfig(
        steps=section.steps, seed=section.seed, prompts_per_step=section.prompts_per_step,
        group_size=section.group_size, max_new_tokens=section.max_new_tokens, temperature=section.temperature,
        top_p=section.top_p, top_k=section.top_k,
        loss=PolicyLossConfig(section.loss, section.eps_low, section.eps_high, section.kl_coef,
                              section.max_new_tokens, tis_cap(section, fp8)),
        scale_rewards=section.scale_rewards,
        rewards=RewardSpec(section.rewards.accuracy, section.rewards.format, tuple(section.rewards.custom)),
        aqn=AqnSchedule(a.schedule, a.sigma_start, a.sigma_end, a.num_stages), aqn_in_training=a.apply_in_training,
        overlong_mask=o.mask, overlong_penalty=o.soft_penalty,
        overlong_buffer=o.buffer or max(1, section.max_new_tokens // 4),
        dynamic_sampling=section.dynamic_sampling.enabled, max_draws=section.dynamic_sampling.max_draws,
        mu=section.mu, lr=section.lr, weight_decay=section.weight_decay, warmup_steps=section.warmup_steps,
        optimizer=section.optimizer,
        max_grad_norm=section.max_grad_norm, full=section.adapter == "full",
        micro_batch=plan.micro_batch if plan is not None else section.micro_batch_size,
        logprob_chunk=plan.logprob_chunk if plan is not None else DEFAULT_CHUNK,
        gradient_checkpointing=section.gradient_checkpointing,
    )


def plan_changes(plan: MemoryPlan) -> str:
    """One sentence: the settings the plan lowered below what the step would use without a budget,
    and why; or that the recipe's settings are used as they are."""
    changes = plan.changes()
    if not changes:
        return "the recipe's settings, unchanged"
    lowered = ", ".join(f"{SETTING_NAMES[c.setting]} {c.asked} -> {c.planned}" for c in changes)
    # A plan lowers a setting only to fit a budget, so there is one here.
    return (f"{lowered}, to fit {plan.budget_source} = {plan.budget_bytes / GB:.1f} GB "
            f"(estimated peak {plan.estimate_bytes / GB:.1f} GB)")
