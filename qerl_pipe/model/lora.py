"""LoRA on the decoder: which projections get adapters, the trainable parameters, PEFT names."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qerl_pipe.errors import ModelSourceError
from qerl_pipe.formats.names import LORA_TARGETS, is_expert, peft_name, targets_of
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.norm import RMSNorm


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...] = LORA_TARGETS
    # Also train every RMSNorm weight (QeRL's option); they export as PEFT modules_to_save.
    train_norms: bool = False
    # MoE models: also adapt every routed expert's projections among `targets` (one A/B per expert
    # and projection). Off by default: attention (and any dense MLP layers) only.
    experts: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.targets) - set(LORA_TARGETS)
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {sorted(unknown) or '()'} invalid; choose from {LORA_TARGETS}")
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")


def adapted_projections(names: tuple[str, ...], targets: tuple[str, ...]) -> list[str]:
    """The projections among `names` that LoRA `targets` adapt. A projection the checkpoint fuses
    (Phi3's `qkv_proj`) is one module to PEFT, so it takes all of its targets or none."""
    out = []
    for name in names:
        members = targets_of(name)
        chosen = [t for t in members if t in targets]
        if chosen and len(chosen) < len(members):
            raise ModelSourceError(f"this model stores {'/'.join(members)} as one module ({name}), so LoRA targets "
                             f"must name all of {list(members)} or none of them; got {list(targets)}")
        if chosen:
            out.append(name)
    return out


def check_lora_targets(config: DecoderConfig, targets: tuple[str, ...]) -> None:
    """Refuse, before any weight is read, LoRA targets that split a module the checkpoint fuses."""
    for _, _, _, projections in config.layer_linears():
        adapted_projections(tuple(name for name, _ in projections), targets)


def apply_lora(model: nn.Module, spec: LoraSpec, seed: int = 0) -> None:
    """Give every targeted projection a fresh adapter (B = 0: the model's outputs do not change)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            if is_expert(name) and not spec.experts:
                continue
            names = adapted_projections(module.names, spec.targets)
            if names:
                module.add_lora(names, spec.rank, spec.alpha, generator)
        elif isinstance(module, RMSNorm) and spec.train_norms:
            module.weight.requires_grad_(True)


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every trainable parameter: LoRA A/B and, with train_norms, the norm weights."""
    return [p for p in model.parameters() if p.requires_grad]


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Trainable tensors under PEFT's names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`:
    fused layers split back into their HF projections; with train_norms, `...model.norm.weight`)."""
    out: dict[str, Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            parent = name.rsplit(".", 1)[0]
            for proj in module.lora_A:
                prefix = peft_name(f"{parent}.{proj}")
                out[f"{prefix}.lora_A.weight"] = module.lora_A[proj].detach()
                out[f"{prefix}.lora_B.weight"] = module.lora_B[proj].detach()
        elif isinstance(module, RMSNorm) and module.weight.requires_grad:
            out[f"{peft_name(name)}.weight"] = module.weight.detach()
    return out


@contextmanager
def lora_disabled(model: nn.Module) -> Iterator[None]:
    """Run the base model alone (e.g. the reference policy of a KL term) without a second copy."""
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in linears:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in linears:
            m.lora_enabled = True


def merge_lora(weight: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """`W + scaling * B @ A` in float32; the caller casts once, so there is one rounding."""
    return torch.addmm(weight.float(), b.float(), a.float(), alpha=scaling)
