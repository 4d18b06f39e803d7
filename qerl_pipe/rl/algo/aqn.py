"""Adaptive Quantization Noise (QeRL, arXiv:2510.11696, §3.3): a scheduled Gaussian noise on the
RMSNorm scales that feed quantized linears, drawn afresh for every rollout step. Stage 0 of the K
stages is noise-free; stages 1..K-1 go from sigma_start to sigma_end along the schedule's curve.
See docs/training.md, section "One step" (2. AQN)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from qerl_pipe.errors import QerlError
from qerl_pipe.model.decoder import DecoderLayer
from qerl_pipe.model.norm import RMSNorm

AqnKind = Literal["exponential", "linear", "cosine", "log", "none"]
AQN_KINDS: tuple[str, ...] = ("exponential", "linear", "cosine", "log", "none")


class AqnError(QerlError):
    """An AQN schedule that cannot be built (names the bad value and the fix)."""


@dataclass(frozen=True)
class AqnSchedule:
    kind: AqnKind = "exponential"
    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    num_stages: int = 10

    def __post_init__(self) -> None:
        if self.kind not in AQN_KINDS:
            raise AqnError(f"AQN schedule {self.kind!r} is unknown; choose one of {AQN_KINDS}")
        if self.kind == "none":
            return
        if not (self.sigma_start > 0 and self.sigma_end > 0):
            raise AqnError(f"AQN sigmas must be > 0; got sigma_start={self.sigma_start}, sigma_end={self.sigma_end}")
        if self.sigma_end > self.sigma_start:
            raise AqnError(f"AQN sigma_end ({self.sigma_end}) > sigma_start ({self.sigma_start}): the noise "
                           "must decay; swap them")
        if self.num_stages < 3:
            raise AqnError(f"AQN num_stages must be >= 3 (a noise-free stage, then sigma_start ... sigma_end); "
                           f"got {self.num_stages}")

    def stage(self, step: int, total_steps: int) -> int:
        """Stage of 0-based `step` among `total_steps`: K equal spans, the last one absorbing rounding."""
        if total_steps < 1 or not 0 <= step < total_steps:
            raise AqnError(f"step {step} is outside 0..{total_steps - 1}")
        return min(self.num_stages - 1, step * self.num_stages // total_steps)

    def sigma(self, step: int, total_steps: int) -> float:
        """The noise standard deviation for rollout step `step` (0-based) of `total_steps`."""
        if self.kind == "none":
            return 0.0
        k = self.stage(step, total_steps)
        if k == 0:
            return 0.0
        t = (k - 1) / (self.num_stages - 2)  # 0 at stage 1, 1 at the last stage
        a, b = self.sigma_start, self.sigma_end
        if self.kind == "exponential":
            return a * (b / a) ** t
        if self.kind == "linear":
            return a + (b - a) * t
        if self.kind == "cosine":
            return b + (a - b) * 0.5 * (1.0 + math.cos(math.pi * t))
        # log: fast early decay, slow late; log-spaced fraction of the way, 1 + 9t in [1, 10].
        return a + (b - a) * math.log10(1.0 + 9.0 * t)


def noisy_norms(model: nn.Module) -> list[RMSNorm]:
    """The RMSNorms that AQN perturbs, in module order: those whose output feeds a quantized
    linear, q/k/v and gate/up (each layer says which: `post_attention_layernorm` in Llama,
    `pre_feedforward_layernorm` in Gemma). o_proj and down_proj read attention / MLP outputs,
    which no such norm scales (Gemma's norms on those outputs come after the linears)."""
    return [norm for m in model.modules() if isinstance(m, DecoderLayer) for norm in m.linear_input_norms()]


@torch.no_grad()
def draw_noise(model: nn.Module, sigma: float, generator: torch.Generator | None = None) -> int:
    """Fill each AQN norm's `noise` buffer in place (CUDA graphs captured over it see the new draw) with
    N(0, sigma^2) per channel, zeros for sigma = 0; returns the count."""
    norms = noisy_norms(model)
    for norm in norms:
        if sigma == 0.0:
            norm.noise.zero_()
        else:
            noise = torch.randn(norm.noise.shape, generator=generator, device=generator.device if generator else "cpu")
            norm.noise.copy_(noise.mul_(sigma))
    return len(norms)


@torch.no_grad()
def clear_noise(model: nn.Module) -> None:
    """Zero every RMSNorm's noise (the clean weights, e.g. for the training forward)."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.noise.zero_()
