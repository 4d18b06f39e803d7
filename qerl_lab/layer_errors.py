"""Per-layer errors of several quantize methods side by side, against rtn (`bench quantize-methods`).

Each method's figures come from its quantize artifact's quality.json (`formats.quant_error`): the
weight error ‖ΔW‖/‖W‖ and, with calibration statistics, the expected output error
sqrt(E‖ΔW x‖² / E‖W x‖²).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qerl_pipe.formats.quant_error import LayerError, summarize

BASELINE = "rtn"
# Relative slack for "no worse than rtn": the figures are sums of fp32 column sums.
_SLACK = 1e-6


def read_layer_errors(artifact: Path) -> dict[str, LayerError]:
    """A quantize artifact's per-layer errors (output None where it had no calibration statistics)."""
    quality = json.loads((artifact / "quality.json").read_text())
    outputs = quality.get("output_relative_error") or {}
    return {m: LayerError(w, outputs.get(m)) for m, w in quality["relative_error"].items()}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


_FIGURES = ("mean_weight_error", "max_weight_error", "mean_output_error", "max_output_error")


def _against_baseline(errors: dict[str, LayerError], base: dict[str, LayerError]) -> dict[str, Any]:
    """How the method's layers compare with rtn's: mean ratio, and how many got better / worse."""
    out: dict[str, Any] = {}
    for kind in ("weight", "output"):
        pairs = [(getattr(errors[m], kind), getattr(base[m], kind)) for m in base]
        if any(a is None or b is None for a, b in pairs):
            continue
        ratios = [a / b for a, b in pairs if b > 0]
        out[f"{kind}_error_ratio_mean"] = _mean(ratios) if ratios else None
        out[f"{kind}_error_ratio_max"] = max(ratios) if ratios else None
        out[f"layers_{kind}_better"] = sum(a < b * (1 - _SLACK) for a, b in pairs)
        out[f"layers_{kind}_worse"] = sum(a > b * (1 + _SLACK) for a, b in pairs)
    return out


def _rank_key(e: LayerError) -> float:
    return e.output if e.output is not None else e.weight


def compare_methods(errors: dict[str, dict[str, LayerError]], worst: int = 5) -> dict[str, Any]:
    """Side by side: each method's mean/max over layers (and, for the others, against rtn), the
    worst layers (each method's `worst` by output error, else weight error) with every method's
    figures, and the full per-layer table `{module: {method: [weight, output]}}`."""
    if BASELINE not in errors:
        raise ValueError(f"the comparison needs the {BASELINE} baseline among the methods")
    base = errors[BASELINE]
    methods = {}
    for method, layer in errors.items():
        if set(layer) != set(base):
            raise ValueError(f"{method} quantized other layers than {BASELINE}")
        methods[method] = {k: v for k, v in summarize(layer).items() if k in _FIGURES}
        if method != BASELINE:
            methods[method]["vs_rtn"] = _against_baseline(layer, base)
    chosen: list[str] = []
    for layer in errors.values():
        for module in sorted(layer, key=lambda m: _rank_key(layer[m]), reverse=True)[:worst]:
            if module not in chosen:
                chosen.append(module)
    chosen.sort(key=lambda m: _rank_key(base[m]), reverse=True)
    table = {m: {method: [layer[m].weight, layer[m].output] for method, layer in errors.items()} for m in base}
    return {"methods": methods, "worst_layers": {m: table[m] for m in chosen}, "per_layer": table}


def print_comparison(comparison: dict[str, Any]) -> None:
    """The comparison as two tables on the console (stderr): per method, and the worst layers."""
    from rich.table import Table

    from qerl_pipe.log import console

    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    summary = Table(title="per-layer relative error over layers (weight / expected output)")
    for column in ("method", "weight mean", "weight max", "output mean", "output max", "output vs rtn: better/worse"):
        summary.add_column(column, justify="left" if column == "method" else "right")
    for method, f in comparison["methods"].items():
        vs = f.get("vs_rtn", {})
        counts = f"{vs['layers_output_better']}/{vs['layers_output_worse']}" if "layers_output_better" in vs else "-"
        summary.add_row(method, fmt(f["mean_weight_error"]), fmt(f["max_weight_error"]),
                        fmt(f["mean_output_error"]), fmt(f["max_output_error"]), counts)
    console.print(summary)
    methods = list(comparison["methods"])
    worst = Table(title="worst layers: weight / output error per method")
    worst.add_column("layer.module", no_wrap=True)  # without "model.layers.", to fit 80 columns
    for method in methods:
        worst.add_column(method, justify="right")
    for module, row in comparison["worst_layers"].items():
        worst.add_row(module.removeprefix("model.layers."), *(f"{fmt(row[m][0])} / {fmt(row[m][1])}" for m in methods))
    console.print(worst)
