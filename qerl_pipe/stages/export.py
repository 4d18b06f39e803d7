"""`qerl-pipe export`: a run's LoRA adapter as a PEFT adapter, or merged into its base.

- `peft`: the run's `adapter_model.safetensors` + `adapter_config.json` (LoRA A/B under PEFT's
  names; trained norms as `modules_to_save`), for `peft.PeftModel.from_pretrained`.
- `merged-bf16`: a Hugging Face model directory whose weights are `W + (alpha/r) B A` (and the
  trained norm weights), from the original 16-bit model when the run's chain still has it,
  else from the dequantized NVFP4 checkpoint (said in the summary and a log line).
- `merged-nvfp4`: that merged model quantized by the NVFP4 checkpoint writer quantize uses
  (`formats.modelopt_writer.NVFP4StreamWriter`) into modelopt's unified HF layout (fused q/k/v and gate/up share their scales), for vLLM and TensorRT-LLM.

Weights stream one tensor at a time from the memory-mapped base, are merged in float32 and cast
once; output shards are written as they fill, so host memory stays near one output shard plus
one fused group, never two copies of the model.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact, load_artifact
from qerl_pipe.dag import ADAPTER_DIR, EXPORT, check_kind, find_or_build, input_artifact
from qerl_pipe.errors import ArtifactError, QerlError
from qerl_pipe.formats.checkpoint import (
    ShardWriter, cast_floating, detect_quant_format, iter_quantized_checkpoint, list_shards, open_shard,
)
from qerl_pipe.formats.modelopt_layout import fused_group_key
from qerl_pipe.formats.modelopt_writer import NVFP4StreamWriter, copy_model_files, write_configs
from qerl_pipe.formats.modelopt_writer import out_dtype as checkpoint_dtype
from qerl_pipe.formats.nvfp4 import NVFP4Weight, dequantize_nvfp4
from qerl_pipe.model.lora import merge_lora
from qerl_pipe.model.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraTensors, lora_tensors, read_adapter
from qerl_pipe.log import log, progress
from qerl_pipe.recipe import ExportSection, Recipe
from qerl_pipe.sources import IMPORT_STAGE, dir_fingerprint

STAGE = EXPORT
KINDS = {"peft": "export-peft", "merged-bf16": "export-merged-bf16", "merged-nvfp4": "export-merged-nvfp4"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed by every loader


# --- the run and where its base is -------------------------------------------------------------

@dataclass(frozen=True)
class _Chain:
    """A run and what it was trained over: engine, its base format, the NVFP4 checkpoint (if any)
    and the recipe + content fingerprint of the original model."""

    run: Artifact
    engine: Artifact
    base_format: str
    quantized: Artifact | None
    model_key: dict[str, Any]


@dataclass(frozen=True)
class _Base:
    """The dense weights a merge starts from."""

    dir: Path
    dequantized: bool  # the dir holds NVFP4 weights, dequantized while streaming
    identity: dict[str, Any]  # names it in the artifact id
    parents: list[str]
    description: str


def _check_run(run: Artifact) -> Path:
    check_kind(run, "train", "--run")
    adapter = run.path / ADAPTER_DIR
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        if not (adapter / name).is_file():
            raise ArtifactError(f"run {run.path} has no {ADAPTER_DIR}/{name}; re-create it with "
                                "`qerl-pipe train --force`")
    return adapter


def _stored(store: ArtifactStore, stage: str, art_id: str, what: str, run: Artifact) -> Artifact:
    """A parent of the run by id, its manifest only (files are re-hashed when they are read)."""
    path = store.path_for(stage, art_id)
    found = load_artifact(path, verify=False) if path.is_dir() else None
    if found is None:
        raise ArtifactError(f"run {run.path.name} was trained over {what} {stage}-{art_id}, which is not in "
                            f"{store.root}; export from the store that holds the run's chain (--artifacts), or "
                            "rebuild it with the run's recipe")
    return found


def _walk_chain(run: Artifact, store: ArtifactStore) -> _Chain:
    """run -> engine -> (NVFP4 checkpoint ->) model source, as the manifests record them."""
    engine_id = run.manifest["parents"][0]
    engine = _stored(store, "build-engine", engine_id, "engine", run)
    config = engine.manifest["config"]
    base = config["base"]
    quantized = None
    if "quantized" in base:
        quantized = _stored(store, "quantize", base["quantized"], "NVFP4 checkpoint", run)
        model_key = quantized.manifest["config"]["model"]
    else:
        model_key = base["model"]
    return _Chain(run, engine, config["engine"]["base_format"], quantized, model_key)


def _original_model(model_key: dict[str, Any], store: ArtifactStore) -> tuple[Path | None, list[str], str]:
    """The original model directory if it is still there with the same content; else why not.

    Never downloads or imports: a merge must start from the weights the run's base was made from,
    and only the recorded fingerprint (files, sizes, mtimes) or the import artifact proves that.
    """
    content = model_key.get("content", {})
    source = model_key.get("source", {}).get("source", "?")
    if "artifact" in content:  # a GGUF source, imported once into the store
        try:
            imported = store.find_existing(IMPORT_STAGE, content["artifact"])
        except ArtifactError as exc:
            return None, [], str(exc)
        if imported is None:
            return None, [], f"its imported copy {IMPORT_STAGE}-{content['artifact']} is not in {store.root}"
        return imported.path, [imported.id], ""
    path = Path(content.get("path", ""))
    if not path.is_dir():
        return None, [], f"model source {source} ({path}) no longer exists"
    now = dir_fingerprint(path) | ({"hub_id": content["hub_id"]} if "hub_id" in content else {})
    if now != content:
        return None, [], f"model source {source} ({path}) changed since the run's base was made from it"
    return path, [], ""


def _find_base(chain: _Chain, store: ArtifactStore) -> _Base:
    original, parents, why_not = _original_model(chain.model_key, store)
    if original is not None:
        quant = detect_quant_format(json.loads((original / "config.json").read_text()))
        return _Base(original, quant is not None, {"model": chain.model_key}, parents,
                     f"original model {original.name}" + (" (NVFP4, dequantized)" if quant else ""))
    if chain.quantized is not None:
        log(f"export: the original 16-bit weights are not available ({why_not}); merging into the dequantized "
            f"NVFP4 checkpoint {chain.quantized.path.name} instead (the base the run was trained over)")
        load_artifact(chain.quantized.path, verify=True)  # re-hashed: a damaged checkpoint is never merged
        return _Base(chain.quantized.path, True, {"quantized": chain.quantized.id}, [chain.quantized.id],
                     f"dequantized NVFP4 checkpoint {chain.quantized.path.name} ({why_not})")
    raise QerlError(f"run {chain.run.path.name}: the base of its {chain.base_format} engine cannot be found "
                    f"({why_not}); put the model source back unchanged, or train a new run over it")


# --- the adapter -------------------------------------------------------------------------------

def _base_names(base_dir: Path) -> set[str]:
    """The parameter names a dense stream of `base_dir` yields (headers only, no tensor is read)."""
    names = set()
    for shard in list_shards(base_dir):
        with open_shard(shard) as fh:
            for key in fh.keys():
                module, _, suffix = key.rpartition(".")
                if suffix == "weight_packed":  # compressed-tensors NVFP4
                    names.add(f"{module}.weight")
                elif suffix not in ("weight_scale", "weight_scale_2", "input_scale", "weight_global_scale",
                                    "input_global_scale"):
                    names.add(key)
    return names


def _check_adapter_fits(adapter: LoraTensors, base: _Base) -> None:
    names = _base_names(base.dir)
    missing = sorted((adapter.lora.keys() | adapter.norms.keys()) - names)
    if missing:
        raise ArtifactError(f"the run's adapter has {missing[0]} (and {len(missing) - 1} more) that the base in "
                            f"{base.dir} lacks: the adapter was trained over another model")


def _merged_tensors(base: _Base, adapter: LoraTensors) -> Iterator[tuple[str, Tensor, bool]]:
    """(HF name, tensor, changed) over the base, LoRA merged (float32) and trained norms swapped in."""
    for name, item, _input_scale in iter_quantized_checkpoint(base.dir):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if isinstance(item, NVFP4Weight):
            # The values our NVFP4 model computes with (x @ dequantize(W)^T), in float32.
            name, item = f"{name}.weight", dequantize_nvfp4(item)
        if name in adapter.lora:
            a, b = adapter.lora[name]
            if b.shape[0] != item.shape[0] or a.shape[1] != item.shape[1]:
                raise ArtifactError(f"{name}: LoRA B {tuple(b.shape)} / A {tuple(a.shape)} do not fit the base weight "
                                    f"{tuple(item.shape)}; the adapter was trained over another model")
            yield name, merge_lora(item, a, b, adapter.scaling), True
        elif name in adapter.norms:
            yield name, adapter.norms[name].float(), True
        else:
            yield name, item, False


def _write_dense_config(source: Path, out: Path, dtype: torch.dtype) -> None:
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)  # the weights are dense now
    key = "dtype" if "dtype" in config and "torch_dtype" not in config else "torch_dtype"
    config[key] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_model_files(source, out)


def _input_scales(quantized: Artifact) -> dict[str, Tensor]:
    """`input_scale` per fused group / module from the run's NVFP4 checkpoint (empty: W4A16).

    They are the calibration's activation statistics of the base model (shared within fused
    groups already); the merged model's activations differ from them by the adapter's effect.
    """
    scales: dict[str, Tensor] = {}
    for shard in list_shards(quantized.path):
        with open_shard(shard) as fh:
            for key in fh.keys():
                if key.endswith(".input_scale"):
                    module = key.removesuffix(".input_scale")
                    scales[fused_group_key(module) or module] = fh.get_tensor(key).float().reshape(())
    return scales


# --- the stage ---------------------------------------------------------------------------------

def out_dtype(section: ExportSection, base: _Base) -> torch.dtype:
    return checkpoint_dtype(section.dtype, json.loads((base.dir / "config.json").read_text()))


def _export_peft(adapter_dir: Path, chain: _Chain | None, out: Path) -> dict[str, Any]:
    adapter = read_adapter(adapter_dir)  # checks it parses before copying
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        shutil.copy2(adapter_dir / name, out / name)
    return {
        "rank": adapter.config["r"], "alpha": adapter.config["lora_alpha"],
        "lora_modules": sum(name.endswith(".lora_A.weight") for name in adapter.shapes),
        "modules_to_save": adapter.config.get("modules_to_save"),
        "trained_over": chain.base_format if chain else None,
    }


def _export_merged(section: ExportSection, chain: _Chain, base: _Base, adapter: LoraTensors,
                   input_scales: dict[str, Tensor], out: Path) -> dict[str, Any]:
    dtype = out_dtype(section, base)
    writer = ShardWriter(out)
    nvfp4 = section.format == "merged-nvfp4"
    sink = NVFP4StreamWriter(writer, sorted({"lm_head", *section.exclude}), dtype, input_scales) if nvfp4 else None
    changed = 0
    for name, tensor, was_changed in progress(_merged_tensors(base, adapter), "merge"):
        changed += was_changed
        if sink is not None:
            sink.add(name, tensor)
        else:
            writer.add(name, cast_floating(tensor, dtype))
    summary: dict[str, Any] = {
        "base": base.description, "base_dequantized": base.dequantized, "trained_over": chain.base_format,
        "dtype": str(dtype).removeprefix("torch."), "merged_linears": len(adapter.lora),
        "trained_norms": len(adapter.norms), "changed_tensors": changed,
    }
    if sink is None:
        writer.finish()
        _write_dense_config(base.dir, out, dtype)
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
    if section.format == "peft":
        try:
            chain = _walk_chain(run, store)  # only to record what the adapter was trained over
        except ArtifactError:
            chain = None
    else:
        chain = _walk_chain(run, store)
        base = _find_base(chain, store)
        adapter = lora_tensors(read_adapter(adapter_dir))
        _check_adapter_fits(adapter, base)
        config.update({"dtype": section.dtype, "base": base.identity})
        parents += base.parents
        if section.format == "merged-nvfp4":
            config.update({"exclude": sorted({"lm_head", *section.exclude}), "calibration": section.calibration})
            if section.calibration == "auto" and chain.quantized is not None:
                input_scales = _input_scales(load_artifact(chain.quantized.path, verify=True))
                if input_scales and chain.quantized.id not in parents:
                    parents.append(chain.quantized.id)
    def build(pending: PendingArtifact) -> None:
        started = time.perf_counter()
        if section.format == "peft":
            summary = _export_peft(adapter_dir, chain, pending.dir)
        else:
            summary = _export_merged(section, chain, base, adapter, input_scales, pending.dir)
        summary["seconds"] = round(time.perf_counter() - started, 2)
        summary["size_mb"] = sum(p.stat().st_size for p in pending.dir.rglob("*") if p.is_file()) / 2**20
        pending.summary.update(summary)
        over = f" over the {summary['base']}" if "base" in summary else ""
        log(f"export: {section.format} of {run.path.name}{over}, {summary['size_mb']:.1f} MB in {summary['seconds']} s")

    return find_or_build(STAGE, store, config=config, parents=parents, build=build, force=force,
                         find_only=find_only, kind=KINDS[section.format])
