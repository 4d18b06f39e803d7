"""`qerl-pipe export`: a run's LoRA adapter as a PEFT adapter (`peft`), or merged into its base in
bf16 (`merged-bf16`) or quantized to modelopt's NVFP4 layout (`merged-nvfp4`); a full fine-tuning
run's trained model in the merged formats. This module checks the run, finds its base (`lineage`)
and keys the artifact; the merge streams in `model.merge.write_merged` (docs/export.md)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from torch import Tensor

from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact, load_artifact
from qerl_pipe.dag import EXPORT, register
from qerl_pipe.errors import ArtifactError, QerlError
from qerl_pipe.formats.checkpoint import list_shards
from qerl_pipe.formats.hf_config import read_model_config
from qerl_pipe.formats.modelopt_writer import out_dtype, read_input_scales
from qerl_pipe.lineage import Chain, MergeBase, find_merge_base, is_full_run, walk_chain
from qerl_pipe.log import log
from qerl_pipe.model.merge import check_adapter_fits_checkpoint, write_merged
from qerl_pipe.model.peft import (
    ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS, LoraTensors, copy_adapter, lora_tensors, read_adapter,
)
from qerl_pipe.jobs.train_job import MODEL_DIR
from qerl_pipe.recipe import ExportSection
from qerl_pipe.runner import StageCall

STAGE = EXPORT


def _check_run(run: Artifact) -> Path:
    """The run's adapter directory, or for a full run its trained model directory."""
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


@dataclass
class _Export:
    """What an export of a run reads, and what names it."""

    config: dict[str, Any]
    parents: list[str]
    chain: Chain | None = None
    base: MergeBase | None = None
    adapter: LoraTensors | None = None
    input_scales: dict[str, Tensor] = field(default_factory=dict)


def _full_run_export(run: Artifact, section: ExportSection, model_dir: Path) -> _Export:
    """A full fine-tuning run: its model/ is the whole trained model, nothing to merge."""
    if section.format == "peft":
        raise QerlError(f"run {run.path.name} trained every weight (train.adapter=full) and has no adapter to "
                        "export as peft; use --format merged-bf16 (a Hugging Face model) or merged-nvfp4")
    base = MergeBase(model_dir, False, {"run_model": MODEL_DIR}, [], "the run's fully trained weights")
    out = _Export({"format": section.format, "dtype": section.dtype, "base": base.identity}, [run.id],
                  base=base, adapter=LoraTensors({}, {}, 0.0))
    if section.format == "merged-nvfp4":  # a bf16 engine has no calibration: always W4A16
        out.config.update({"exclude": sorted({"lm_head", *section.exclude}), "calibration": section.calibration})
    return out


def _adapter_export(run: Artifact, section: ExportSection, adapter_dir: Path, store: ArtifactStore) -> _Export:
    """A LoRA run: its adapter as is (peft), or merged into the base its chain names."""
    out = _Export({"format": section.format}, [run.id])
    if section.format == "peft":
        try:
            out.chain = walk_chain(run, store)  # only to record what the adapter was trained over
        except ArtifactError:
            pass
        return out
    out.chain = chain = walk_chain(run, store)
    out.base = base = find_merge_base(chain, store)
    out.adapter = lora_tensors(read_adapter(adapter_dir))
    check_adapter_fits_checkpoint(out.adapter, base.dir)
    out.config.update({"dtype": section.dtype, "base": base.identity})
    out.parents += base.parents
    if section.format == "merged-nvfp4":
        out.config.update({"exclude": sorted({"lm_head", *section.exclude}), "calibration": section.calibration})
        if section.calibration == "auto" and chain.quantized is not None:
            if base.identity.get("quantized") != chain.quantized.id:  # else find_merge_base re-hashed it
                load_artifact(chain.quantized.path, verify=True)
            out.input_scales = read_input_scales(chain.quantized.path)
            if out.input_scales and chain.quantized.id not in out.parents:
                out.parents.append(chain.quantized.id)
    return out


def _write(pending: PendingArtifact, *, export: _Export, section: ExportSection, run: Artifact,
           source_dir: Path, full: bool) -> None:
    started = time.perf_counter()
    chain, base = export.chain, export.base
    if section.format == "peft":
        summary = {**copy_adapter(source_dir, pending.dir), "trained_over": chain.base_format if chain else None}
    else:
        nvfp4 = section.format == "merged-nvfp4"
        summary = {"base": base.description, "base_dequantized": base.dequantized,
                   "trained_over": "bf16" if full else chain.base_format, "adapter": "full" if full else "lora",
                   **write_merged(base.dir, export.adapter, pending.dir,
                                  out_dtype(section.dtype, read_model_config(base.dir)),
                                  sorted({"lm_head", *section.exclude}) if nvfp4 else None, export.input_scales,
                                  full)}
    summary["seconds"] = round(time.perf_counter() - started, 2)
    summary["size_mb"] = sum(p.stat().st_size for p in pending.dir.rglob("*") if p.is_file()) / 2**20
    pending.summary.update(summary)
    over = f" over the {summary['base']}" if "base" in summary else ""
    log(f"export: {section.format} of {run.path.name}{over}, {summary['size_mb']:.1f} MB in {summary['seconds']} s")


@register(STAGE)
def export_stage(call: StageCall) -> Artifact:
    """Export the run in `recipe.export.format`; every input is checked (run kind, chain, base,
    adapter fit) before anything is written."""
    section, run = call.recipe.export, call.input("run")
    source_dir = _check_run(run)
    full = is_full_run(run)
    export = (_full_run_export(run, section, source_dir) if full
              else _adapter_export(run, section, source_dir, call.store))
    build = partial(_write, export=export, section=section, run=run, source_dir=source_dir, full=full)
    return call.seal(config=export.config, parents=export.parents, build=build, kind=f"export-{section.format}")
