"""Clipped policy-gradient losses: GRPO, DAPO and Dr. GRPO, with optional k3 KL and truncated IS.

They differ in how token losses become one number; `LossNorm` carries the whole batch's sequence and
token counts, so micro-batch (and rank) losses add up to the full-batch loss exactly.
See docs/training.md, section "One step" (the loss, after the steps)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LossType = Literal["grpo", "dapo", "dr_grpo"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "dapo", "dr_grpo")


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_type: LossType = "dapo"
    eps_low: float = 0.2
    eps_high: float = 0.28  # DAPO's clip-higher; set equal to eps_low for classic PPO clipping
    kl_coef: float = 0.0  # k3 estimator of KL(policy || base), base = adapter disabled
    max_response_len: int = 0  # dr_grpo's constant denominator
    tis_cap: float | None = None  # truncated importance sampling for rollout/train mismatch

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss {self.loss_type!r} is unknown; choose one of {LOSS_TYPES}")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(f"clip range needs 0 <= eps_low < 1 and eps_high >= 0; got {self.eps_low}, {self.eps_high}")
        if self.loss_type == "dr_grpo" and self.max_response_len < 1:
            raise ValueError("dr_grpo needs max_response_len >= 1 (its constant length normaliser)")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ValueError(f"tis_cap {self.tis_cap} must be >= 1")


@dataclass(frozen=True)
class LossNorm:
    """Whole-batch counts the micro-batch losses are normalised by (summed over ranks if any)."""

    sequences: int
    tokens: int

    @classmethod
    def of(cls, mask: Tensor) -> "LossNorm":
        return cls(int(mask.shape[0]), int(mask.sum()))


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(policy || ref) per token: exp(d) - d - 1 with d = ref - logp (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def policy_loss(logp: Tensor, advantages: Tensor, mask: Tensor, cfg: PolicyLossConfig, *,
                old_logp: Tensor | None = None, ref_logp: Tensor | None = None, rollout_logp: Tensor | None = None,
                norm: LossNorm | None = None, mismatch: bool = True) -> tuple[Tensor, dict[str, float]]:
    """Loss of one (micro-)batch and its metrics. logp/old_logp/ref_logp/rollout_logp: [B, T] (old:
    the sampling policy for mu > 1, None = this one, ratio 1); advantages [B]; mask [B, T] (0 on
    padding and masked overlong sequences); rollout_logp: the engine's, for TIS (cfg.tis_cap) and
    `mismatch_metrics` when `mismatch`. docs/training.md."""
    mask = mask.to(logp.dtype)
    norm = norm or LossNorm.of(mask)
    old = logp.detach() if old_logp is None else old_logp
    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    a = advantages.to(logp.dtype)[:, None]
    unclipped = ratio * a
    clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * a
    per_token = -torch.minimum(unclipped, clipped)
    if cfg.tis_cap is not None and rollout_logp is not None:
        # The rollout engine's policy differs slightly from the trainer's (kernels, noise, FP8
        # activations): reweight by the truncated ratio trainer-old / rollout (Yao et al., "Your
        # efficient RL framework secretly brings you off-policy RL training", 2025).
        per_token = per_token * torch.exp(old - rollout_logp).clamp(max=cfg.tis_cap).detach()
    kl = None
    if cfg.kl_coef > 0 and ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + cfg.kl_coef * kl
    loss = _aggregate(per_token, mask, cfg, norm)
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        is_clipped = (unclipped > clipped).to(mask.dtype)  # the clip bound is the active term
        metrics = {"clip_fraction": float((is_clipped * mask).sum() / n), "ratio_mean": float((ratio * mask).sum() / n),
                   "kl": float((kl * mask).sum() / n) if kl is not None else 0.0}
        if rollout_logp is not None and mismatch:
            metrics.update(mismatch_metrics(old, rollout_logp, mask, cfg.tis_cap))
    return loss, metrics


# The mismatch metrics averaged over tokens (with `tis_ratio_max`, the max): every step logs them.
MISMATCH_MEANS = ("mismatch_k3", "tis_ratio_mean", "tis_truncated")


def mismatch_metrics(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                     cap: float | None) -> dict[str, float]:
    """How far the rollout's policy is from the trainer's on the sampled tokens (`mask` > 0):
    `mismatch_k3`, the mean k3 estimate of KL(rollout || trainer) per token (the tokens are the
    rollout's samples); the mean and max of the ratio trainer / rollout probability that TIS
    weights by; `tis_truncated`, the share of tokens whose ratio exceeds `cap` (0 without one)."""
    m = mask > 0
    if not bool(m.any()):
        return {"mismatch_k3": 0.0, "tis_ratio_mean": 1.0, "tis_ratio_max": 1.0, "tis_truncated": 0.0}
    trainer, rollout = trainer_logp.detach()[m].double(), rollout_logp[m].double()
    ratio = torch.exp(trainer - rollout)
    truncated = (ratio > cap).double().mean() if cap is not None else ratio.new_zeros(())
    stats = torch.stack([k3_kl(rollout, trainer).mean(), ratio.mean(), ratio.max(), truncated]).tolist()  # 1 sync
    return dict(zip(("mismatch_k3", "tis_ratio_mean", "tis_ratio_max", "tis_truncated"), stats))


def _aggregate(per_token: Tensor, mask: Tensor, cfg: PolicyLossConfig, norm: LossNorm) -> Tensor:
    masked = per_token * mask
    if cfg.loss_type == "grpo":
        per_sequence = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_sequence.sum() / max(norm.sequences, 1)
    if cfg.loss_type == "dapo":
        return masked.sum() / max(norm.tokens, 1)
    return masked.sum() / (max(norm.sequences, 1) * cfg.max_response_len)
