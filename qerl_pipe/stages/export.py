"""`qerl-pipe export`: a run's LoRA adapter as a PEFT adapter, or merged into its base.

- `peft`: the run's `adapter_model.safetensors` + `adapter_config.json` (LoRA A/B under PEFT's
  names; trained norms as `modules_to_save`), for `peft.PeftModel.from_pretrained`.
- `merged-bf16`: a Hugging Face model directory whose weights are `W + (alpha/r) B A` (and the
  trained norm weights), from the original 16-bit model when the run's chain still has it,
  else from the dequantized NVFP4 checkpoint (said in the summary and a log line).
- `merged-nvfp4`: that merged model quantized by the NVFP4 checkpoint writer quantize uses
  (`formats.modelopt_writer.NVFP4StreamWriter`) into modelopt's unified HF layout (fused q/k/v and gate/up share their scales), for vLLM and TensorRT-LLM.

A full fine-tuning run (`train.adapter: full`) has no adapter: its `model/` directory holds the
trained weights, and the merged formats stream those instead of base + adapter (same writers);
`peft` is refused.

Weights stream one tensor at a time from the memory-mapped base, are merged in float32 and cast
once; output shards are written as they fill, so host memory stays near one output shard plus
one fused group, never two copies of the model.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact, load_artifact
from qerl_pipe.dag import ADAPTER_DIR, EXPORT, MODEL_DIR, check_kind, find_or_build, input_artifact
from qerl_pipe.errors import ArtifactError, QerlError
from qerl_pipe.formats.checkpoint import ShardWriter, cast_floating, list_shards
from qerl_pipe.formats.modelopt_writer import NVFP4StreamWriter, read_input_scales, write_configs, write_dense_config
from qerl_pipe.formats.modelopt_writer import out_dtype as checkpoint_dtype
from qerl_pipe.lineage import Chain, MergeBase, find_merge_base, walk_chain
from qerl_pipe.log import log, progress
from qerl_pipe.model.merge import check_adapter_fits_checkpoint, merged_tensors
from qerl_pipe.model.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraTensors, lora_tensors, read_adapter
from qerl_pipe.recipe import ExportSection, Recipe

STAGE = EXPORT
KINDS = {"peft": "export-peft", "merged-bf16": "export-merged-bf16", "merged-nvfp4": "export-merged-nvfp4"}


def is_full_run(run: Artifact) -> bool:
    """Whether the run trained every weight (`train.adapter: full`) rather than an adapter."""
    return run.manifest.get("config", {}).get("train", {}).get("adapter") == "full"


def _check_run(run: Artifact) -> Path:
    """The run's adapter directory, or for a full run its trained model directory."""
    check_kind(run, "train", "--run")
    if is_full_run(run):
        model = run.path / MODEL_DIR
        if not (model / "config.json").is_file() or not list_shards(model):
            raise ArtifactError(f"full fine-tuning run {run.path} has no {MODEL_DIR}/ weights; re-create "
                                "it with `qerl-pipe train --force`")
        return model
    adapter = run.path / ADAPTER_DIR
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        if not (adapter / name).is_file():
            raise ArtifactError(f"run {run.path} has no {ADAPTER_DIR}/{name}; re-create it with "
                                "`qerl-pipe train --force`")
    return adapter


def out_dtype(section: ExportSection, base: MergeBase) -> torch.dtype:
    return checkpoint_dtype(section.dtype, json.loads((base.dir / "config.json").read_text()))


def _export_peft(adapter_dir: Path, chain: Chain | None, out: Path) -> dict[str, Any]:
    adapter = read_adapter(adapter_dir)  # checks it parses before copying
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        shutil.copy2(adapter_dir / name, out / name)
    return {
        "rank": adapter.config["r"], "alpha": adapter.config["lora_alpha"],
        "lora_modules": sum(name.endswith(".lora_A.weight") for name in adapter.shapes),
        "modules_to_save": adapter.config.get("modules_to_save"),
        "trained_over": chain.base_format if chain else None,
    }


def _export_merged(section: ExportSection, trained_over: str, base: MergeBase, adapter: LoraTensors,
                   input_scales: dict[str, Tensor], out: Path, full: bool = False) -> dict[str, Any]:
    """Merge `adapter` into `base` (with `full`, the base is the run's trained model and the
    adapter empty: every tensor is trained) and write it dense or as NVFP4."""
    dtype = out_dtype(section, base)
    writer = ShardWriter(out)
    nvfp4 = section.format == "merged-nvfp4"
    sink = NVFP4StreamWriter(writer, sorted({"lm_head", *section.exclude}), dtype, input_scales) if nvfp4 else None
    changed = 0
    for name, tensor, was_changed in progress(merged_tensors(base.dir, adapter), "merge"):
        changed += was_changed or full
        if sink is not None:
            sink.add(name, tensor)
        else:
            writer.add(name, cast_floating(tensor, dtype))
    summary: dict[str, Any] = {
        "base": base.description, "base_dequantized": base.dequantized, "trained_over": trained_over,
        "adapter": "full" if full else "lora",
        "dtype": str(dtype).removeprefix("torch."), "merged_linears": len(adapter.lora),
        "trained_norms": len(adapter.norms), "changed_tensors": changed,
    }
    if sink is None:
        writer.finish()
        write_dense_config(base.dir, out, dtype)
        return summary
    sink.finish()
    quant_algo = "NVFP4" if input_scales else "W4A16_NVFP4"
    write_configs(base.dir, out, quant_algo, sorted({"lm_head", *sink.excluded}), dtype)
    errors = sink.errors
    summary.update({"quant_algo": quant_algo, "quantized_linears": len(errors),
                    "mean_relative_error": sum(errors.values()) / max(1, len(errors)),
                    "max_relative_error": max(errors.values(), default=0.0)})
    return summary


def run_export(recipe: Recipe, store: ArtifactStore, *, run: Artifact | None = None, force: bool = False,
               build_missing: bool = False, find_only: bool = False) -> Artifact:
    """Export `run` (default: the recipe's run, found in the store; trained only with
    `build_missing`) in `recipe.export.format`.

    Every input is checked (run kind, chain, base, adapter fit) before anything is written.
    """
    section = recipe.export
    if run is None:
        run = input_artifact(STAGE.name, "--run", recipe, store, build_missing=build_missing, find_only=find_only)
    adapter_dir = _check_run(run)
    config: dict[str, Any] = {"format": section.format}
    parents = [run.id]
    chain = base = adapter = None
    input_scales: dict[str, Tensor] = {}
    full = is_full_run(run)
    if full:
        if section.format == "peft":
            raise QerlError(f"run {run.path.name} trained every weight (train.adapter=full) and has no adapter to "
                            "export as peft; use --format merged-bf16 (a Hugging Face model) or merged-nvfp4")
        # The run's model/ is the whole trained model: nothing to merge, the writers are the same.
        base = MergeBase(adapter_dir, False, {"run_model": MODEL_DIR}, [], "the run's fully trained weights")
        adapter = LoraTensors({}, {}, 0.0)
        config.update({"dtype": section.dtype, "base": base.identity})
        if section.format == "merged-nvfp4":  # a bf16 engine has no calibration: always W4A16
            config.update({"exclude": sorted({"lm_head", *section.exclude}), "calibration": section.calibration})
    elif section.format == "peft":
        try:
            chain = walk_chain(run, store)  # only to record what the adapter was trained over
        except ArtifactError:
            chain = None
    else:
        chain = walk_chain(run, store)
        base = find_merge_base(chain, store)
        adapter = lora_tensors(read_adapter(adapter_dir))
        check_adapter_fits_checkpoint(adapter, base.dir)
        config.update({"dtype": section.dtype, "base": base.identity})
        parents += base.parents
        if section.format == "merged-nvfp4":
            config.update({"exclude": sorted({"lm_head", *section.exclude}), "calibration": section.calibration})
            if section.calibration == "auto" and chain.quantized is not None:
                input_scales = read_input_scales(load_artifact(chain.quantized.path, verify=True).path)
                if input_scales and chain.quantized.id not in parents:
                    parents.append(chain.quantized.id)
    def build(pending: PendingArtifact) -> None:
        started = time.perf_counter()
        if section.format == "peft":
            summary = _export_peft(adapter_dir, chain, pending.dir)
        else:
            trained_over = "bf16" if full else chain.base_format
            summary = _export_merged(section, trained_over, base, adapter, input_scales, pending.dir, full)
        summary["seconds"] = round(time.perf_counter() - started, 2)
        summary["size_mb"] = sum(p.stat().st_size for p in pending.dir.rglob("*") if p.is_file()) / 2**20
        pending.summary.update(summary)
        over = f" over the {summary['base']}" if "base" in summary else ""
        log(f"export: {section.format} of {run.path.name}{over}, {summary['size_mb']:.1f} MB in {summary['seconds']} s")

    return find_or_build(STAGE, store, config=config, parents=parents, build=build, force=force,
                         find_only=find_only, kind=KINDS[section.format])
