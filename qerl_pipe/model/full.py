"""Full fine-tuning: every weight of a 16-bit model trained, through float32 master copies.
The model keeps its weights in its own dtype (the engine computes with them); after each optimizer
step the masters are copied back *in place*, so addresses (and captured CUDA graphs) stay valid.
See docs/training.md, section "Full fine-tuning (`adapter: full`)"."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from qerl_pipe.model.linear import QuantLinear


def full_training_bytes(numel: int, dtype: torch.dtype) -> int:
    """What training `numel` weights of `dtype` adds to the model: AdamW's two float32 moments and
    a float32 gradient per weight, plus a float32 master unless the weight is float32 itself."""
    return numel * (3 * 4 + (0 if dtype == torch.float32 else 4))


def make_fully_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Turn every weight of a bf16-base model into a trainable parameter; returns them by name. The
    linears' frozen buffers become parameters on the same storage and state-dict names; a tied LM
    head is the embedding's tensor (listed once)."""
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        if not module.fmt.dense:
            raise ValueError(f"{name}: full fine-tuning needs a bf16 base, not {module.base_format} "
                             "(4-bit codes cannot take gradient updates)")
        if len(module.lora_A):
            raise ValueError(f"{name} carries a LoRA adapter; full fine-tuning trains the weights themselves")
        # Only once: a second call (another Trainer on the same model) keeps the same objects.
        if not isinstance(module.weight, nn.Parameter):
            module.weight = nn.Parameter(module.weight.detach(), requires_grad=True)
        if module.bias is not None and not isinstance(module.bias, nn.Parameter):
            module.bias = nn.Parameter(module.bias.detach(), requires_grad=True)
    for p in model.parameters():
        p.requires_grad_(True)
    return list(model.named_parameters())


class FullTraining:
    """The trainable weights of a fully fine-tuned model and the float32 `masters` AdamW steps (a
    float32 weight is its own); `push()` after every optimizer step. A newer FullTraining of the
    same model takes the gradients over from the older one."""

    def __init__(self, model: nn.Module):
        named = make_fully_trainable(model)
        for handle in getattr(model, "_full_training_hooks", []):
            handle.remove()
        self.names = [n for n, _ in named]
        self.weights = [p for _, p in named]
        self.masters: list[nn.Parameter] = [w if w.dtype == torch.float32 else nn.Parameter(w.detach().float().clone())
                                            for w in self.weights]
        model._full_training_hooks = [w.register_post_accumulate_grad_hook(self._mover(m))
                                      for w, m in zip(self.weights, self.masters) if m is not w]

    @staticmethod
    def _mover(master: nn.Parameter):
        # Accumulating micro-batches in float32 on the master keeps gradient accumulation exact
        # to float32 and frees each bf16 gradient right away (memory: 4 bytes per weight, not 6).
        def move(weight: Tensor) -> None:
            grad = weight.grad.float()
            master.grad = grad if master.grad is None else master.grad.add_(grad)
            weight.grad = None
        return move

    @torch.no_grad()
    def push(self) -> None:
        """Copy the masters into the model's weights in place (one rounding to the model dtype)."""
        for w, m in zip(self.weights, self.masters):
            if m is not w:
                w.copy_(m)

    def state_dict(self) -> dict[str, Tensor]:
        """The float32 masters by parameter name: with the optimizer state, all a resume needs."""
        return {n: m.detach() for n, m in zip(self.names, self.masters)}

    @torch.no_grad()
    def load_state_dict(self, tensors: Mapping[str, Tensor]) -> None:
        missing = sorted(set(self.names) - set(tensors))
        unknown = sorted(set(tensors) - set(self.names))
        if missing or unknown:
            raise ValueError(f"full weights do not match the model (missing {missing[:3]}, unexpected {unknown[:3]})")
        for n, m in zip(self.names, self.masters):
            t = tensors[n]
            if t.shape != m.shape:
                raise ValueError(f"{n}: stored shape {tuple(t.shape)} != model shape {tuple(m.shape)}")
            m.copy_(t)
        self.push()
