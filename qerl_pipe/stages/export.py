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
once (`model.merge.write_merged`); this module checks the run, finds its base (`lineage`) and
keys the artifact.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from torch import Tensor

from qerl_pipe.artifacts import Artifact, PendingArtifact, load_artifact
from qerl_pipe.dag import EXPORT, register
from qerl_pipe.errors import ArtifactError, QerlError
from qerl_pipe.formats.checkpoint import list_shards
from qerl_pipe.formats.hf_config import read_model_config
from qerl_pipe.formats.modelopt_writer import out_dtype, read_input_scales
from qerl_pipe.lineage import MergeBase, find_merge_base, is_full_run, walk_chain
from qerl_pipe.log import log
from qerl_pipe.model.merge import check_adapter_fits_checkpoint, write_merged
from qerl_pipe.model.peft import (
    ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS, LoraTensors, copy_adapter, lora_tensors, read_adapter,
)
from qerl_pipe.jobs.train_job import MODEL_DIR
from qerl_pipe.runner import StageCall

STAGE = EXPORT
KINDS = {"peft": "export-peft", "merged-bf16": "export-merged-bf16", "merged-nvfp4": "export-merged-nvfp4"}


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


@register(STAGE)
def export_stage(call: StageCall) -> Artifact:
    """Export the run in `recipe.export.format`; every input is checked (run kind, chain, base,
    adapter fit) before anything is written."""
    store, section = call.store, call.recipe.export
    run = call.input("run")
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
                if base.identity.get("quantized") != chain.quantized.id:  # else find_merge_base re-hashed it
                    load_artifact(chain.quantized.path, verify=True)
                input_scales = read_input_scales(chain.quantized.path)
                if input_scales and chain.quantized.id not in parents:
                    parents.append(chain.quantized.id)
    def build(pending: PendingArtifact) -> None:
        started = time.perf_counter()
        if section.format == "peft":
            summary = {**copy_adapter(adapter_dir, pending.dir), "trained_over": chain.base_format if chain else None}
        else:
            nvfp4 = section.format == "merged-nvfp4"
            summary = {"base": base.description, "base_dequantized": base.dequantized,
                       "trained_over": "bf16" if full else chain.base_format, "adapter": "full" if full else "lora",
                       **write_merged(base.dir, adapter, pending.dir,
                                      out_dtype(section.dtype, read_model_config(base.dir)),
                                      sorted({"lm_head", *section.exclude}) if nvfp4 else None, input_scales, full)}
        summary["seconds"] = round(time.perf_counter() - started, 2)
        summary["size_mb"] = sum(p.stat().st_size for p in pending.dir.rglob("*") if p.is_file()) / 2**20
        pending.summary.update(summary)
        over = f" over the {summary['base']}" if "base" in summary else ""
        log(f"export: {section.format} of {run.path.name}{over}, {summary['size_mb']:.1f} MB in {summary['seconds']} s")

    return call.seal(config=config, parents=parents, build=build, kind=KINDS[section.format])
