"""Per-layer quantization error: of the weight, and of the layer's output predicted from the
calibration's channel mean squares (no forward pass), accumulated over the quantizer's row chunks
without a copy of a whole tensor. See docs/formats.md, section "Per-layer error in the quality report"."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from qerl_pipe.errors import QerlError


@dataclass(frozen=True)
class LayerError:
    """One linear's relative errors; `output` is None without calibration statistics."""

    weight: float
    output: float | None = None


class ErrorSums:
    """Running sums of one weight's errors over its row chunks (float64 on the host)."""

    def __init__(self, channel_mean_square: Tensor | None = None, name: str = "tensor") -> None:
        self.name = name
        # float64: the weighted sums span many decades of activation scale across channels. It moves
        # to the weight's device at the first chunk, so each chunk's sums reach the host in one copy.
        self.ms = None if channel_mean_square is None else channel_mean_square.detach().double()
        self.sums = [0.0] * 4  # squared error and reference, then both weighted by the mean squares

    def add(self, reference: Tensor, dequantized: Tensor) -> None:
        """Account for rows `reference` [n, K] and their dequantized quantization (same shape)."""
        ref = reference.float()
        err_cols = (dequantized.float() - ref).pow_(2).sum(0)  # per input channel ‖ΔW[:, j]‖² over these rows
        cols = torch.stack((err_cols, ref.pow(2).sum(0))).double()
        sums = cols.sum(1)
        if self.ms is not None:
            if self.ms.shape != err_cols.shape:
                raise QerlError(f"{self.name}: the calibration has {self.ms.numel()} input channels, the weight "
                                f"{err_cols.numel()}; it was made for another model")
            self.ms = self.ms.to(cols.device)  # once: later chunks find it there
            sums = torch.cat((sums, cols @ self.ms))
        for i, value in enumerate(sums.tolist()):  # the chunk's one device-to-host copy
            self.sums[i] += value

    def result(self) -> LayerError:
        return LayerError(_ratio(*self.sums[:2]), None if self.ms is None else _ratio(*self.sums[2:]))


def _ratio(error_sq: float, ref_sq: float) -> float:
    # An all-zero weight (or one whose inputs are all zero) is reproduced exactly: no error.
    return math.sqrt(error_sq / ref_sq) if ref_sq > 0 else 0.0


def summarize(errors: dict[str, LayerError], worst: int = 5) -> dict:
    """Mean and max over layers of each error, and the `worst` layers (by output error when known)."""
    if not errors:
        return {"layers": 0}
    weight = [e.weight for e in errors.values()]
    outputs = [e.output for e in errors.values() if e.output is not None]
    key = (lambda kv: kv[1].output) if len(outputs) == len(errors) else (lambda kv: kv[1].weight)
    ranked = sorted(errors.items(), key=key, reverse=True)[:worst]
    return {
        "layers": len(errors),
        "mean_weight_error": sum(weight) / len(weight),
        "max_weight_error": max(weight),
        "mean_output_error": sum(outputs) / len(outputs) if outputs else None,
        "max_output_error": max(outputs) if outputs else None,
        "worst_layers": [{"module": m, "weight_error": e.weight, "output_error": e.output} for m, e in ranked],
    }
