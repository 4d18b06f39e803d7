"""The learning-rate schedule and the per-step seeds: both pure functions of the step number,
so a resumed run sees exactly what an uninterrupted one would."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosine:
    """LR factor at optimizer-schedule step s: linear warmup (s + 1) / warmup, then a cosine from 1
    towards 0 over the remaining steps. A class, not a lambda, so LambdaLR.state_dict() keeps it."""

    def __init__(self, warmup_steps: int, total_steps: int):
        self.warmup_steps, self.total_steps = warmup_steps, total_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps))


def step_seed(seed: int, step: int, stream: int = 0) -> int:
    """A 63-bit seed for (run seed, step, stream): splitmix64 of the three, so neighbouring steps
    and streams (0 = sampling, 1 = AQN noise, 2+ = extra rollout draws) get unrelated seeds."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    return x >> 1
