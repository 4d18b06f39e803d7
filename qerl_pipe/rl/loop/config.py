"""TrainConfig: everything the trainer reads, fixed for the run.

Built at the stage boundary (`jobs.train_config`) from the recipe's train section and the memory
plan: `micro_batch` and `logprob_chunk` are the plan's choices, not the recipe's upper bounds.
See docs/training.md, section "Memory budget: the step planner"."""

from __future__ import annotations

from dataclasses import dataclass

from qerl_pipe.rl.algo.aqn import AqnSchedule
from qerl_pipe.rl.algo.losses import PolicyLossConfig
from qerl_pipe.rl.task.rewards import RewardSpec


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    seed: int  # the data order, AQN draws and sampling
    prompts_per_step: int  # B
    group_size: int  # G
    # Rollout sampling (the temperature is also the log-probabilities').
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    # The method.
    loss: PolicyLossConfig
    scale_rewards: str  # "group", "batch" or "none"
    rewards: RewardSpec
    aqn: AqnSchedule
    aqn_in_training: bool  # keep the rollout's noise in the training forward
    overlong_mask: bool  # responses cut at max_new_tokens get no loss
    overlong_penalty: bool  # DAPO's soft overlong penalty on the reward
    overlong_buffer: int  # that penalty's ramp, in tokens
    dynamic_sampling: bool
    max_draws: int  # generation rounds per step when dynamic sampling drops flat groups
    # The optimizer.
    mu: int  # updates per batch of rollouts
    lr: float
    weight_decay: float
    warmup_steps: int
    optimizer: str  # "adamw" (torch) or "adamw8bit" (bitsandbytes: 8-bit moments, CUDA)
    max_grad_norm: float | None
    full: bool  # every weight trains (a bf16 base), not a LoRA adapter
    # How the work is cut: the memory plan's values.
    micro_batch: int  # sequences per forward/backward
    logprob_chunk: int  # response tokens whose logits exist at once
    gradient_checkpointing: bool

    def __post_init__(self) -> None:
        if self.full and self.loss.kl_coef > 0:
            raise ValueError("kl_coef > 0 needs a frozen base policy, which full fine-tuning does not keep")
