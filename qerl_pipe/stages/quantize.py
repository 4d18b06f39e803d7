"""`qerl-pipe quantize`: an HF model to an NVFP4 checkpoint in modelopt's unified HF layout.

The model is streamed shard by shard and tensor by tensor, so host memory stays near one shard
plus one tensor. A first pass reads every linear weight once to check it (finite, K % 16 == 0)
and to take the amax of each fused group (q/k/v, gate/up share one global scale); only then does
the second pass write anything. The artifact directory is itself a loadable model directory.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import qerl_pipe
from qerl_pipe.artifacts import Artifact, ArtifactStore, artifact_id, load_artifact
from qerl_pipe.artifacts.manifest import MANIFEST_NAME
from qerl_pipe.errors import ArtifactError, ModelSourceError, QerlError, QuantizationError, RecipeError
from qerl_pipe.formats.checkpoint import list_shards, open_shard, save_safetensors
from qerl_pipe.formats.modelopt_layout import (
    config_quantization_config, fused_group_key, hf_quant_config, nvfp4_tensors,
)
from qerl_pipe.formats.nvfp4 import (
    BLOCK_SIZE, NVFP4Weight, dequantize_nvfp4, global_scale_from_amax, quantize_nvfp4_in_row_chunks,
)
from qerl_pipe.log import console, log, progress
from qerl_pipe.memwatch import PeakRSS, return_freed_tensors_to_os
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.quality import load_dequantized_weights, perplexity
from qerl_pipe.recipe import QualitySection, QuantizeSection, Recipe
from qerl_pipe.sources import ResolvedModel, resolve_model
from qerl_pipe.stages.calibrate import KIND as CALIBRATION_KIND
from qerl_pipe.stages.calibrate import read_channel_mean_square, read_input_amax
from qerl_pipe.stages.common import (
    compute_dtype, count_parameters, load_hf_causal_lm, load_tokenizer, model_config_key, pick_device,
)
from qerl_pipe.textdata import load_texts, pack_available

STAGE = "quantize"
VERSION = 1
KIND = "nvfp4-checkpoint"
# The linears of a Llama-family decoder layer; embeddings, norms and lm_head stay 16-bit.
LINEAR = re.compile(r"^(.*\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj)\.weight$")
# Tokenizer and generation files copied so the artifact loads as a model directory.
COPY_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                  "*.model", "generation_config.json", "chat_template.*")
_PERPLEXITY_AUTO_MAX_PARAMS = 1_000_000_000
# Rows are quantized in chunks of about this many elements: NVFP4 rows are independent once the
# global scale is fixed, so the bytes are the same, and the fp32 temporaries stay ~16 MB each
# instead of several copies of the largest tensor.
_CHUNK_ELEMENTS = 1 << 22


@dataclass
class _Plan:
    """What pass 1 learned: which tensors to quantize, and each one's global (and input) scale."""

    quantized: dict[str, str] = field(default_factory=dict)  # weight name -> module name
    group_amax: dict[str, torch.Tensor] = field(default_factory=dict)  # group or module -> weight amax
    excluded: set[str] = field(default_factory=set)

    def scale_key(self, module: str) -> str:
        return fused_group_key(module) or module


def is_excluded(module: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def _plan(shards: list[Path], exclude: list[str]) -> _Plan:
    plan = _Plan()
    for shard in progress(shards, "check weights", len(shards)):
        with open_shard(shard) as fh:
            for name in fh.keys():
                match = LINEAR.match(name)
                if not match:
                    continue
                module = match.group(1)
                if is_excluded(module, exclude):
                    plan.excluded.add(module)
                    continue
                weight = fh.get_tensor(name)
                if weight.dim() != 2 or weight.shape[1] % BLOCK_SIZE:
                    raise QuantizationError(
                        f"{name} has shape {tuple(weight.shape)}: NVFP4 needs in_features to be a multiple of "
                        f"{BLOCK_SIZE}; exclude the module with --set 'quantize.exclude=[lm_head, {module}]'"
                    )
                amax = weight.abs().amax().float()  # exact in the weight's own dtype; NaN propagates
                if not bool(torch.isfinite(amax)):
                    raise QuantizationError(f"{name} has non-finite values (inf or nan); the model is damaged")
                plan.quantized[name] = module
                key = plan.scale_key(module)
                plan.group_amax[key] = torch.maximum(plan.group_amax[key], amax) if key in plan.group_amax else amax
    return plan


def _input_scales(plan: _Plan, input_amax: dict[str, float] | None) -> dict[str, torch.Tensor]:
    """input_scale per module from calibration; fused groups share the max of their members."""
    if input_amax is None:
        return {}
    missing = [m for m in plan.quantized.values() if m not in input_amax]
    if missing:
        raise QerlError(f"the calibration has no statistics for {missing[0]} (and {len(missing) - 1} more): "
                        "it was made for another model; re-run calibrate on this model")
    group: dict[str, float] = {}
    for module in plan.quantized.values():
        key = plan.scale_key(module)
        group[key] = max(group.get(key, 0.0), input_amax[module])
    return {m: global_scale_from_amax(torch.tensor(group[plan.scale_key(m)])) for m in plan.quantized.values()}


def out_dtype(choice: str, config: dict) -> torch.dtype:
    if choice != "auto":
        return getattr(torch, choice)
    declared = config.get("torch_dtype") or config.get("dtype")
    return torch.float16 if declared == "float16" else torch.bfloat16


def _write_shards(shards: list[Path], out: Path, plan: _Plan, input_scales: dict[str, torch.Tensor],
                  dtype: torch.dtype, method: str, channel_weights: dict[str, torch.Tensor]) -> dict[str, float]:
    """Pass 2: quantize and write one output shard per input shard; returns per-module relative error."""
    errors: dict[str, float] = {}
    weight_map: dict[str, str] = {}
    total_size = 0
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for shard, out_name in progress(zip(shards, names), "quantize", len(shards)):
        tensors: dict[str, torch.Tensor] = {}
        with open_shard(shard) as fh:
            for name in fh.keys():
                tensor = fh.get_tensor(name)
                module = plan.quantized.get(name)
                if module is None:
                    tensors[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
                    continue
                w, errors[module] = quantize_in_row_chunks(tensor, plan_global_scale(plan, module), name, method,
                                                           channel_weights.get(module))
                tensors.update(nvfp4_tensors(module, w, input_scales.get(module)))
                del tensor
        save_safetensors(tensors, out / out_name, metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = out_name
            total_size += t.numel() * t.element_size()
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return errors


def quantize_in_row_chunks(weight: torch.Tensor, global_scale: torch.Tensor, name: str, method: str = "rtn",
                           channel_weight: torch.Tensor | None = None) -> tuple[NVFP4Weight, float]:
    """NVFP4 of `weight` and its relative error ‖W − deq(Q(W))‖ / ‖W‖, a bounded block of rows at a time."""
    sums = [0.0, 0.0]  # squared error, squared reference

    def measure(chunk: torch.Tensor, q: NVFP4Weight) -> None:
        ref = chunk.float()
        sums[0] += float((dequantize_nvfp4(q) - ref).pow(2).sum())
        sums[1] += float(ref.pow(2).sum())

    packed = quantize_nvfp4_in_row_chunks(weight, global_scale, name=name, chunk_elements=_CHUNK_ELEMENTS,
                                          on_chunk=measure, method=method, channel_weight=channel_weight)
    return packed, (sums[0] / sums[1]) ** 0.5 if sums[1] > 0 else 0.0


def plan_global_scale(plan: _Plan, module: str) -> torch.Tensor:
    return global_scale_from_amax(plan.group_amax[plan.scale_key(module)])


def write_configs(source: Path, out: Path, quant_algo: str, exclude_modules: list[str], dtype: torch.dtype) -> None:
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = config_quantization_config(quant_algo, exclude_modules, qerl_pipe.__version__)
    if "torch_dtype" in config or "dtype" not in config:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    else:
        config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf_quant = hf_quant_config(quant_algo, exclude_modules, qerl_pipe.__version__)
    (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2) + "\n")
    for pattern in COPY_PATTERNS:
        for path in source.glob(pattern):
            if path.is_file():
                shutil.copy2(path, out / path.name)


def _perplexity_report(resolved: ResolvedModel, checkpoint: Path, section: QuantizeSection,
                       trust_remote_code: bool) -> dict | None:
    """bf16 vs NVFP4 perplexity, or None when switched off. The report is optional: whatever goes
    wrong in it is a warning and {"skipped": why}, never a failed stage that loses the checkpoint."""
    q = section.quality
    n_params = count_parameters(resolved.config)
    if q.perplexity == "never" or (q.perplexity == "auto" and n_params > _PERPLEXITY_AUTO_MAX_PARAMS):
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
    return {
        "data": q.data, "tokens": ids.numel(), "compute_dtype": str(dtype).removeprefix("torch."),
        "bf16": round(reference, 4), "nvfp4_w4a16": round(quantized, 4),
        "increase_pct": round(100 * (quantized / reference - 1), 3),
    }


def _channel_weights(method: str, calibration: Artifact | None, plan: _Plan) -> dict[str, torch.Tensor]:
    """Per quantized module, the input channels' mean squares that act-mse weighs errors by."""
    if method != "act-mse":
        return {}
    assert calibration is not None  # run_quantize refuses act-mse without one
    try:
        stats = read_channel_mean_square(calibration)
    except FileNotFoundError as exc:
        raise QerlError(f"{exc} (an older calibrate made it): re-run `qerl-pipe calibrate --force`") from None
    missing = sorted(set(plan.quantized.values()) - set(stats))
    if missing:
        raise QerlError(f"calibration {calibration.path} has no statistics for {missing[:3]}; it is of another model")
    return stats


def _check_calibration(calibration: Artifact, model_key: dict) -> None:
    if calibration.kind != CALIBRATION_KIND:
        raise ArtifactError(f"{calibration.path} is a '{calibration.kind}' artifact, not a calibration")
    if calibration.manifest["config"].get("model") != model_key:
        raise QerlError(f"calibration {calibration.path.name} was made for another model (or another version of it); "
                        "run `qerl-pipe calibrate` with the same model first")


def _holds_copy(output: Path, art_id: str) -> bool:
    """Whether `output` is an intact copy of artifact `art_id` (the same command run again)."""
    if not (output / MANIFEST_NAME).is_file():
        return False
    try:
        copy = load_artifact(output, verify=True)
    except ArtifactError:
        return False
    return copy.id == art_id


def _check_output_dir(output: Path | None, art_id: str) -> None:
    if output is None or not output.exists() or _holds_copy(output, art_id):
        return
    if not output.is_dir() or any(output.iterdir()):
        raise ArtifactError(f"output directory {output} exists and is not empty; choose a new path (nothing was written)")


def _copy_to_output(artifact: Artifact, output: Path) -> None:
    """Copy the finished checkpoint to a user-chosen directory, atomically (temp sibling, then rename);
    a directory that already holds this very checkpoint is left as it is."""
    if _holds_copy(output, artifact.id):
        log(f"quantize: {output} already holds this checkpoint")
        return
    _check_output_dir(output, artifact.id)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".tmp-{output.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(artifact.path, tmp)
    if output.exists():
        output.rmdir()  # checked empty above
    tmp.rename(output)


def _report(errors: dict[str, float], ppl: dict | None, summary: dict) -> None:
    from rich.table import Table

    table = Table(title="NVFP4 quantization error (worst layers)", show_lines=False)
    table.add_column("module")
    table.add_column("‖W−Q(W)‖/‖W‖", justify="right")
    for module, err in sorted(errors.items(), key=lambda kv: -kv[1])[:5]:
        table.add_row(module, f"{err:.4f}")
    console.print(table)
    log(f"quantize: {summary['quantized_linears']} linears, mean relative error {summary['mean_relative_error']:.4f}, "
        f"{summary['size_mb']['in']:.1f} MB -> {summary['size_mb']['out']:.1f} MB, "
        f"peak host memory +{summary['peak_host_memory_mb']:.0f} MB over {summary['seconds']} s")
    if ppl and "skipped" not in ppl:
        log(f"quantize: perplexity on {ppl['tokens']} tokens of {ppl['data']}: bf16 {ppl['bf16']:.3f} -> "
            f"NVFP4 (W4A16) {ppl['nvfp4_w4a16']:.3f} ({ppl['increase_pct']:+.2f}%)")


def run_quantize(recipe: Recipe, store: ArtifactStore, *, calibration: Artifact | None = None,
                 output: Path | None = None, force: bool = False) -> Artifact:
    resolved = resolve_model(recipe.model, store)
    DecoderConfig.from_hf(resolved.config)
    section = recipe.quantize
    model_key = model_config_key(resolved, recipe.model)
    if calibration is not None:
        _check_calibration(calibration, model_key)
    elif section.method == "act-mse":
        raise RecipeError("quantize.method=act-mse weighs errors by calibration statistics: run "
                          "`qerl-pipe calibrate` and pass --calibration ART, or use `qerl-pipe run`, which chains them")
    # The quality report's settings do not change the weights, so they are not part of the id:
    # switching the report off or on reuses the same checkpoint.
    quantize_key = section.model_dump(exclude={"quality"})
    if quantize_key["method"] == "rtn":
        del quantize_key["method"]  # the default: artifacts made before the setting existed keep their ids
    config = {"model": model_key, "quantize": quantize_key, "calibrated": calibration is not None}
    parents = resolved.parents + ([calibration.id] if calibration else [])
    _check_output_dir(output, artifact_id(STAGE, VERSION, config, parents))  # before any work
    with store.create(stage=STAGE, stage_version=VERSION, kind=KIND, config=config,
                      parents=parents, force=force) as (pending, existing):
        if existing is not None:
            log(f"quantize: up to date, reusing {existing.path}")
            artifact = existing
        else:
            started = time.perf_counter()
            shards = list_shards(resolved.dir)
            exclude = sorted({"lm_head", *section.exclude})
            dtype = out_dtype(section.dtype, resolved.config)
            return_freed_tensors_to_os()
            with PeakRSS() as memory:
                plan = _plan(shards, exclude)
                if not plan.quantized:
                    raise ModelSourceError(f"{resolved.dir} has no Llama-family linear weights to quantize")
                input_scales = _input_scales(plan, read_input_amax(calibration) if calibration else None)
                errors = _write_shards(shards, pending.dir, plan, input_scales, dtype, section.method,
                                       _channel_weights(section.method, calibration, plan))
            quant_algo = "NVFP4" if calibration else "W4A16_NVFP4"
            exclude_modules = sorted({"lm_head", *plan.excluded})
            write_configs(resolved.dir, pending.dir, quant_algo, exclude_modules, dtype)
            (pending.dir / "quality.json").write_text(json.dumps({"relative_error": errors}, indent=2) + "\n")
            ppl = _perplexity_report(resolved, pending.dir, section, recipe.model.trust_remote_code)
            size_in = sum(p.stat().st_size for p in shards)
            size_out = sum(p.stat().st_size for p in pending.dir.glob("*.safetensors"))
            pending.summary.update({
                "quant_algo": quant_algo,
                "method": section.method,
                "quantized_linears": len(errors),
                "mean_relative_error": sum(errors.values()) / len(errors),
                "max_relative_error": max(errors.values()),
                "size_mb": {"in": size_in / 2**20, "out": size_out / 2**20},
                "shards": len(shards),
                "largest_shard_mb": max(p.stat().st_size for p in shards) / 2**20,
                "peak_host_memory_mb": memory.peak_increase_bytes / 2**20,
                "perplexity": ppl,
                "seconds": round(time.perf_counter() - started, 2),
            })
            _report(errors, ppl, pending.summary)
    if existing is None:
        artifact = store.find_existing(STAGE, pending.id)
    if output is not None:
        _copy_to_output(artifact, output)
        log(f"quantize: the checkpoint is in {output}")
    return artifact
