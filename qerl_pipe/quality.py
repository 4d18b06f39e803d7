"""How much quantization costs on held-out text: bf16 vs NVFP4 perplexity."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from qerl_pipe.formats.checkpoint import iter_quantized_checkpoint
from qerl_pipe.formats.nvfp4 import NVFP4Weight, dequantize_nvfp4
from qerl_pipe.log import progress


def perplexity(model: torch.nn.Module, ids: torch.Tensor, batch_size: int, label: str) -> float:
    """exp(mean next-token NLL) over all positions of `ids` [N, L]."""
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    with torch.inference_mode():
        batches = ids.split(batch_size)
        for batch in progress(batches, f"perplexity ({label})", len(batches)):
            batch = batch.to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
            )
            total_nll += float(nll)
            total_tokens += batch[:, 1:].numel()
    return math.exp(total_nll / total_tokens)


def load_dequantized_weights(model: torch.nn.Module, checkpoint_dir: Path) -> int:
    """Replace each quantized linear's weight by its dequantized NVFP4 value, read back from disk.

    Reading the checkpoint we just wrote (rather than the tensors in memory) makes the report
    vouch for the files, not for an intermediate.
    """
    modules = dict(model.named_modules())
    replaced = 0
    with torch.no_grad():
        for name, value, _input_scale in iter_quantized_checkpoint(checkpoint_dir):
            if isinstance(value, NVFP4Weight):
                linear = modules[name]
                linear.weight.copy_(dequantize_nvfp4(value, linear.weight.dtype).to(linear.weight.device))
                replaced += 1
    return replaced
