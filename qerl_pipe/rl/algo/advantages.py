"""From rewards to per-sequence advantages: group baselines (GRPO), scaling, DAPO's length shaping.

Sequences are ordered group by group: the G samples of prompt 0, then those of prompt 1, ..."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

ScaleRewards = Literal["group", "batch", "none"]
STD_EPS = 1e-4  # as TRL and the QeRL code: keeps a zero-variance group's advantages at 0


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if group_size < 2 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} (need G >= 2)")
    return rewards.float().view(-1, group_size)


def group_advantages(rewards: Tensor, group_size: int, scale: ScaleRewards = "group") -> Tensor:
    """A_i = (r_i - mean of its group) / (std + 1e-4), std unbiased over the group ('group'), over the
    whole batch ('batch', less sensitive to easy/hard prompts), or no division ('none', Dr. GRPO)."""
    grouped = _groups(rewards, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True) + STD_EPS)
    elif scale == "batch":
        centered = centered / (grouped.std() + STD_EPS)
    elif scale != "none":
        raise ValueError(f"scale_rewards {scale!r}: choose group, batch or none")
    return centered.view(-1)


def zero_variance_groups(rewards: Tensor, group_size: int) -> Tensor:
    """[P] bool: groups whose rewards are all equal (no learning signal; DAPO's dynamic sampling drops them)."""
    grouped = _groups(rewards, group_size)
    return (grouped == grouped[:, :1]).all(dim=1)


def soft_overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (arXiv:2503.14476, eq. 13), a reward term per sequence:
    0 up to max_len - buffer tokens, then falling linearly to -factor at max_len (and below past it)."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer {buffer} must lie in 1..max_len={max_len}")
    over = (lengths.float() - (max_len - buffer)).clamp(min=0)
    return -factor * torch.minimum(over / buffer, torch.ones_like(over))
