"""The quantize stage's work: a model's NVFP4 checkpoint in the modelopt layout, with its quality
report (`write_checkpoint`); the stage (`stages/quantize.py`) keys, seals and copies it."""

from __future__ import annotations

import time
from typing import Any

import torch

from qerl_pipe.artifacts import Artifact, PendingArtifact
from qerl_pipe.errors import ModelSourceError, QerlError
from qerl_pipe.formats.calibration import CHANNELS_FILE, read_channel_mean_square, read_input_amax
from qerl_pipe.formats.checkpoint import list_shards
from qerl_pipe.formats.modelopt_writer import (
    WritePlan, input_scales, out_dtype, plan_checkpoint, write_configs, write_shards,
)
from qerl_pipe.memwatch import PeakRSS, return_freed_tensors_to_os
from qerl_pipe.quality import layer_error_report, perplexity_report, print_quality_report
from qerl_pipe.recipe import QuantizeSection
from qerl_pipe.strict_json import write_json


def _channel_stats(method: str, calibration: Artifact | None, plan: WritePlan) -> tuple[dict[str, torch.Tensor] | None, str]:
    """Per quantized module, its input channels' mean squares (what act-mse weighs errors by, and
    what the report's output error needs), or None and why there are none."""
    if calibration is None:
        return None, "no calibration artifact (--calibration): output error not reported"
    try:
        stats = read_channel_mean_square(calibration.path)
    except FileNotFoundError as exc:
        if method == "act-mse":
            raise QerlError(f"{exc} (an older calibrate made it): re-run `qerl-pipe calibrate --force`") from None
        return None, "the calibration has no per-channel statistics (an older calibrate made it): output error not reported"
    missing = sorted(set(plan.quantized.values()) - set(stats))
    if missing:
        raise QerlError(f"calibration {calibration.path} has no statistics for {missing[:3]}; it is of another model")
    return stats, f"from {CHANNELS_FILE} of calibration {calibration.id}"


def write_checkpoint(pending: PendingArtifact, *, resolved: Any, section: QuantizeSection,
                      calibration: Artifact | None, trust_remote_code: bool) -> None:
    """The NVFP4 checkpoint of `resolved` into `pending`, its quality report and summary."""
    started = time.perf_counter()
    shards = list_shards(resolved.dir)
    exclude = sorted({"lm_head", *section.exclude})
    dtype = out_dtype(section.dtype, resolved.config)
    return_freed_tensors_to_os()
    with PeakRSS() as memory:
        plan = plan_checkpoint(shards, exclude)
        if not plan.quantized:
            raise ModelSourceError(f"{resolved.dir} has no Llama-family linear weights to quantize")
        scales = input_scales(plan, read_input_amax(calibration.path) if calibration else None)
        channel_ms, output_basis = _channel_stats(section.method, calibration, plan)
        errors = write_shards(shards, pending.dir, plan, scales, dtype, section.method, channel_ms)
    quant_algo = "NVFP4" if calibration else "W4A16_NVFP4"
    write_configs(resolved.dir, pending.dir, quant_algo, sorted({"lm_head", *plan.excluded}), dtype)
    quality = layer_error_report(section.method, errors, output_basis)
    write_json(pending.dir / "quality.json", quality)
    pending.reports.add("quality.json")  # read by people, never by a stage: not in the children's ids
    ppl = perplexity_report(resolved, pending.dir, section.quality, trust_remote_code)
    size_in = sum(p.stat().st_size for p in shards)
    size_out = sum(p.stat().st_size for p in pending.dir.glob("*.safetensors"))
    errs = quality["summary"]
    pending.summary.update({
        "quant_algo": quant_algo, "method": section.method, "quantized_linears": len(errors),
        "mean_relative_error": errs["mean_weight_error"], "max_relative_error": errs["max_weight_error"],
        # Expected output error from the calibration's channel statistics; None without them.
        "mean_output_relative_error": errs["mean_output_error"], "max_output_relative_error": errs["max_output_error"],
        "size_mb": {"in": size_in / 2**20, "out": size_out / 2**20}, "shards": len(shards),
        "largest_shard_mb": max(p.stat().st_size for p in shards) / 2**20,
        "peak_host_memory_mb": memory.peak_increase_bytes / 2**20, "perplexity": ppl,
        "seconds": round(time.perf_counter() - started, 2),
    })
    print_quality_report(quality["summary"], ppl, pending.summary, output_basis)


