"""The quantize stage's quality report: per-layer weight and expected output error (quality.json),
bf16 vs NVFP4 perplexity on held-out text, and the console summary of both."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from qerl_pipe.errors import QerlError
from qerl_pipe.formats.checkpoint import iter_quantized_checkpoint
from qerl_pipe.formats.nvfp4 import NVFP4Weight, dequantize_nvfp4
from qerl_pipe.formats.quant_error import LayerError, summarize
from qerl_pipe.hf import compute_dtype, count_parameters, load_hf_causal_lm, load_tokenizer, pick_device
from qerl_pipe.log import console, log, progress
from qerl_pipe.recipe import QualitySection
from qerl_pipe.sources import ResolvedModel
from qerl_pipe.textdata import load_texts, pack_available
from qerl_pipe.userfiles import data_file_key, data_spec_key

# "auto" measures models up to this size: the 16-bit reference forward is the costly part.
_PERPLEXITY_AUTO_MAX_PARAMS = 1_000_000_000


def perplexity(model: torch.nn.Module, ids: torch.Tensor, batch_size: int, label: str) -> float:
    """exp(mean next-token NLL) over all positions of `ids` [N, L]."""
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    with torch.inference_mode():
        batches = ids.split(batch_size)
        for batch in progress(batches, f"perplexity ({label})", len(batches)):
            batch = batch.to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                    reduction="sum")
            total_nll += float(nll)
            total_tokens += batch[:, 1:].numel()
    return math.exp(total_nll / total_tokens)


def load_dequantized_weights(model: torch.nn.Module, checkpoint_dir: Path) -> None:
    """Each quantized linear's weight replaced by its NVFP4 value as read back from the checkpoint's files
    (not the tensors in memory), so that the report vouches for the files."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, value, _input_scale in iter_quantized_checkpoint(checkpoint_dir):
            if isinstance(value, NVFP4Weight):
                linear = modules[name]
                linear.weight.copy_(dequantize_nvfp4(value, linear.weight.dtype).to(linear.weight.device))


def _reports(q: QualitySection, n_params: int) -> bool:
    return q.perplexity == "always" or (q.perplexity == "auto" and n_params <= _PERPLEXITY_AUTO_MAX_PARAMS)


def quality_key(q: QualitySection, n_params: int) -> dict[str, Any] | str | None:
    """What of `quantize.quality` the quantize id holds (the report is in the manifest, so what
    changes it changes the id): "off" where the defaults would report, else the settings that shape
    it (a data file by path and sha256); None for the defaults' own result, so older artifacts
    keep their ids (`perplexity` auto and always agree where both measure)."""
    default = QualitySection()
    if not _reports(q, n_params):
        return "off" if _reports(default, n_params) else None
    settings = q.model_dump(exclude={"perplexity"})
    if _reports(default, n_params) and settings == default.model_dump(exclude={"perplexity"}):
        return None
    return settings | {"data": data_spec_key(q.data), "data_sha256": data_file_key(q.data)}


def perplexity_report(resolved: ResolvedModel, checkpoint: Path, q: QualitySection,
                      trust_remote_code: bool) -> dict | None:
    """quantize's report: bf16 vs NVFP4 perplexity, or None when off. Optional: what goes wrong in it is a warning
    and {"skipped": why}, never a failed stage that loses the checkpoint."""
    n_params = count_parameters(resolved.config)
    if not _reports(q, n_params):
        return None
    try:
        return _measure_perplexity(resolved, checkpoint, q, n_params, trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any failure of an optional report, OOM included
        reason = str(exc) if isinstance(exc, QerlError) else f"{type(exc).__name__}: {exc}"
        log(f"quantize: warning: no perplexity report ({reason}); the checkpoint is complete. "
            "quantize.quality.perplexity=never switches the report off")
        return {"skipped": reason}


def _measure_perplexity(resolved: ResolvedModel, checkpoint: Path, q: QualitySection, n_params: int,
                        trust_remote_code: bool) -> dict:
    device = pick_device(q.device)
    dtype = compute_dtype("auto", device, n_params)
    tokenizer = load_tokenizer(resolved.dir, trust_remote_code)
    ids = pack_available(load_texts(q.data, q.field), tokenizer, q.num_samples, q.seq_len)
    if ids.numel() < q.num_samples * q.seq_len:
        log(f"quantize: {q.data} gives {ids.numel()} tokens, fewer than quality.num_samples x seq_len = "
            f"{q.num_samples * q.seq_len}; the perplexity report uses those {ids.numel()}")
    model = load_hf_causal_lm(resolved.dir, dtype, device, trust_remote_code)
    reference = perplexity(model, ids, batch_size=4, label="16-bit")
    load_dequantized_weights(model, checkpoint)
    quantized = perplexity(model, ids, batch_size=4, label="nvfp4")
    if not (math.isfinite(reference) and math.isfinite(quantized)):  # the weights are checked: an overflow
        raise QerlError(f"the perplexity is not finite (16-bit {reference}, NVFP4 {quantized}, computed in "
                        f"{str(dtype).removeprefix('torch.')}: an activation overflowed)")
    return {"data": q.data, "tokens": ids.numel(), "compute_dtype": str(dtype).removeprefix("torch."),
            "bf16": round(reference, 4), "nvfp4_w4a16": round(quantized, 4),
            "increase_pct": round(100 * (quantized / reference - 1), 3)}


def print_quality_report(layers: dict, ppl: dict | None, summary: dict, output_basis: str) -> None:
    """The stage's console report: the worst layers with both errors, the means and maxima (`layers`:
    the report's `summarize` of them), size, memory, time and the perplexities."""
    from rich.table import Table

    table = Table(title=f"NVFP4 quantization error, {summary['method']} (worst layers)", show_lines=False)
    table.add_column("module")
    table.add_column("weight ‖ΔW‖/‖W‖", justify="right")
    table.add_column("output (calibration)", justify="right")
    for row in layers["worst_layers"]:
        output = "-" if row["output_error"] is None else f"{row['output_error']:.4f}"
        table.add_row(row["module"], f"{row['weight_error']:.4f}", output)
    console.print(table)
    log(f"quantize: {summary['quantized_linears']} linears ({summary['method']}), relative error mean/max: "
        f"weight {layers['mean_weight_error']:.4f}/{layers['max_weight_error']:.4f}, " + (
            f"output {layers['mean_output_error']:.4f}/{layers['max_output_error']:.4f}"
            if layers["mean_output_error"] is not None else output_basis))
    log(f"quantize: {summary['size_mb']['in']:.1f} MB -> {summary['size_mb']['out']:.1f} MB, "
        f"peak host memory +{summary['peak_host_memory_mb']:.0f} MB over {summary['seconds']} s")
    if ppl and "skipped" not in ppl:
        log(f"quantize: perplexity on {ppl['tokens']} tokens of {ppl['data']}: bf16 {ppl['bf16']:.3f} -> "
            f"NVFP4 (W4A16) {ppl['nvfp4_w4a16']:.3f} ({ppl['increase_pct']:+.2f}%)")


def layer_error_report(method: str, errors: dict[str, LayerError], output_basis: str) -> dict:
    """quality.json's per-layer part: `relative_error` (the weight's, the key older artifacts have
    too), `output_relative_error` (None without calibration statistics) and their summary."""
    has_output = all(e.output is not None for e in errors.values())
    return {"method": method, "relative_error": {m: e.weight for m, e in errors.items()},
            "output_relative_error": {m: e.output for m, e in errors.items()} if has_output else None,
            "output_error_basis": output_basis, "summary": summarize(errors)}
