"""`qerl-pipe export`: a run's LoRA adapter as a PEFT adapter, or merged into its base.

- `peft`: the run's `adapter_model.safetensors` + `adapter_config.json` (LoRA A/B under PEFT's
  names; trained norms as `modules_to_save`), for `peft.PeftModel.from_pretrained`.
- `merged-bf16`: a Hugging Face model directory whose weights are `W + (alpha/r) B A` (and the
  trained norm weights), from the original 16-bit model when the run's chain still has it,
  else from the dequantized NVFP4 checkpoint (said in the summary and a log line).
- `merged-nvfp4`: that merged model quantized by the quantize stage's own writers into modelopt's
  unified HF layout (fused q/k/v and gate/up share their scales), for vLLM and TensorRT-LLM.

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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from qerl_pipe.artifacts import Artifact, ArtifactStore, load_artifact
from qerl_pipe.errors import ArtifactError, QerlError
from qerl_pipe.formats.checkpoint import (
    INDEX_FILE, SINGLE_FILE, detect_quant_format, iter_quantized_checkpoint, list_shards, open_shard,
    save_safetensors,
)
from qerl_pipe.formats.modelopt_layout import FUSED_GROUPS, fused_group_key, nvfp4_tensors
from qerl_pipe.formats.nvfp4 import NVFP4Weight, dequantize_nvfp4, global_scale_from_amax
from qerl_pipe.formats.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from qerl_pipe.log import log, progress
from qerl_pipe.recipe import ExportSection, Recipe
from qerl_pipe.sources import IMPORT_STAGE, _dir_fingerprint
from qerl_pipe.stages import build_engine as build_engine_stage
from qerl_pipe.stages import quantize as quantize_stage
from qerl_pipe.stages import train as train_stage

STAGE = "export"
VERSION = 1
KINDS = {"peft": "export-peft", "merged-bf16": "export-merged-bf16", "merged-nvfp4": "export-merged-nvfp4"}
# Output shards close at this size: it bounds the host memory of a merge (one shard buffered).
SHARD_BYTES = 2 * 2**30
_PEFT_PREFIX = "base_model.model."
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


def is_full_run(run: Artifact) -> bool:
    """Whether the run trained every weight (`train.adapter: full`) rather than an adapter."""
    return run.manifest.get("config", {}).get("train", {}).get("adapter") == "full"


def _check_run(run: Artifact) -> Path:
    """The run's adapter directory, or for a full run its trained model directory."""
    if run.kind != train_stage.KIND:
        raise ArtifactError(f"{run.path} is a '{run.kind}' artifact, not a run; pass a `qerl-pipe train` "
                            "artifact (train-<id>) to --run")
    if is_full_run(run):
        model = run.path / train_stage.MODEL_DIR
        if not (model / "config.json").is_file() or not list_shards(model):
            raise ArtifactError(f"full fine-tuning run {run.path} has no {train_stage.MODEL_DIR}/ weights; re-create "
                                "it with `qerl-pipe train --force`")
        return model
    adapter = run.path / train_stage.ADAPTER_DIR
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        if not (adapter / name).is_file():
            raise ArtifactError(f"run {run.path} has no {train_stage.ADAPTER_DIR}/{name}; re-create it with "
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
    engine = _stored(store, build_engine_stage.STAGE, engine_id, "engine", run)
    config = engine.manifest["config"]
    base = config["base"]
    quantized = None
    if "quantized" in base:
        quantized = _stored(store, quantize_stage.STAGE, base["quantized"], "NVFP4 checkpoint", run)
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
    now = _dir_fingerprint(path) | ({"hub_id": content["hub_id"]} if "hub_id" in content else {})
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

@dataclass(frozen=True)
class _Adapter:
    """LoRA factors and trained norm weights by Hugging Face parameter name, and the LoRA scaling."""

    lora: dict[str, tuple[Tensor, Tensor]]  # "<module>.weight" -> (A [r, in], B [out, r])
    norms: dict[str, Tensor]  # "<norm>.weight" -> the trained weight
    scaling: float
    config: dict[str, Any]


def read_adapter(adapter_dir: Path) -> _Adapter:
    """A PEFT LoRA adapter as written by `formats.peft_adapter.save_adapter`."""
    try:
        config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{adapter_dir}: cannot read the adapter ({exc}); re-create the run with --force") from None
    if config.get("peft_type") != "LORA" or config.get("use_rslora") or config.get("use_dora"):
        raise ArtifactError(f"{adapter_dir}: only plain LoRA adapters can be merged (peft_type LORA, no rsLoRA/DoRA)")
    lora_a: dict[str, Tensor] = {}
    lora_b: dict[str, Tensor] = {}
    norms: dict[str, Tensor] = {}
    for key, t in tensors.items():
        name = key.removeprefix(_PEFT_PREFIX)
        if name.endswith(".lora_A.weight"):
            lora_a[name.removesuffix(".lora_A.weight") + ".weight"] = t
        elif name.endswith(".lora_B.weight"):
            lora_b[name.removesuffix(".lora_B.weight") + ".weight"] = t
        else:
            norms[name] = t
    if lora_a.keys() != lora_b.keys():
        raise ArtifactError(f"{adapter_dir}: some LoRA modules have A without B or B without A")
    lora = {name: (lora_a[name], lora_b[name]) for name in lora_a}
    return _Adapter(lora, norms, float(config["lora_alpha"]) / float(config["r"]), config)


def merge_lora(weight: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """`W + scaling * B @ A` in float32; the caller casts once, so there is one rounding."""
    return torch.addmm(weight.float(), b.float(), a.float(), alpha=scaling)


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


def _check_adapter_fits(adapter: _Adapter, base: _Base) -> None:
    names = _base_names(base.dir)
    missing = sorted((adapter.lora.keys() | adapter.norms.keys()) - names)
    if missing:
        raise ArtifactError(f"the run's adapter has {missing[0]} (and {len(missing) - 1} more) that the base in "
                            f"{base.dir} lacks: the adapter was trained over another model")


def _merged_tensors(base: _Base, adapter: _Adapter) -> Iterator[tuple[str, Tensor, bool]]:
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


# --- writing -----------------------------------------------------------------------------------

class _ShardWriter:
    """safetensors shards of up to SHARD_BYTES, written as they fill; HF names and index at the end."""

    def __init__(self, out: Path, max_bytes: int | None = None) -> None:
        self.out, self.max_bytes = out, max_bytes or SHARD_BYTES
        self.buffer: dict[str, Tensor] = {}
        self.buffered = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffered + nbytes > self.max_bytes:
            self._flush()
        self.buffer[name] = tensor.contiguous()
        self.buffered += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        path = self.out / f".part-{len(self.files):05d}.safetensors"  # the shard count is known only at the end
        save_safetensors(self.buffer, path, metadata={"format": "pt"})
        self.files.append((path, list(self.buffer)))
        self.buffer, self.buffered = {}, 0

    def finish(self) -> None:
        if self.buffer or not self.files:
            self._flush()
        n = len(self.files)
        names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (path, keys), name in zip(self.files, names):
            path.rename(self.out / name)
            weight_map.update({k: name for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _cast(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _copy_model_files(source: Path, out: Path) -> None:
    """Tokenizer, chat template and generation config: the directory loads standalone."""
    for pattern in quantize_stage.COPY_PATTERNS:
        for path in source.glob(pattern):
            if path.is_file():
                shutil.copy2(path, out / path.name)


def _write_dense_config(source: Path, out: Path, dtype: torch.dtype) -> None:
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)  # the weights are dense now
    key = "dtype" if "dtype" in config and "torch_dtype" not in config else "torch_dtype"
    config[key] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _copy_model_files(source, out)


@dataclass
class _NVFP4Sink:
    """Quantizes merged linears as they stream by; a fused group waits until all its members are in,
    so that they share one global scale (and input scale), as the quantize stage writes them."""

    writer: _ShardWriter
    exclude: list[str]
    dtype: torch.dtype
    input_scales: dict[str, Tensor]  # fused group or module -> input_scale; empty: W4A16
    pending: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    excluded: set[str] = field(default_factory=set)

    def add(self, name: str, tensor: Tensor) -> None:
        match = quantize_stage.LINEAR.match(name)
        module = match.group(1) if match else None
        if module is None or quantize_stage.is_excluded(module, self.exclude):
            if module is not None:
                self.excluded.add(module)
            self.writer.add(name, _cast(tensor, self.dtype))
            return
        group = fused_group_key(module)
        if group is None:
            self._write([(module, tensor)])
            return
        members = self.pending.setdefault(group, {})
        members[module] = tensor
        parent, projections = group.rpartition(".")[0], FUSED_GROUPS[group.rpartition(".")[2]]
        expected = [f"{parent}.{p}" for p in projections
                    if not quantize_stage.is_excluded(f"{parent}.{p}", self.exclude)]
        if set(members) == set(expected):
            del self.pending[group]
            self._write([(m, members[m]) for m in expected])

    def _write(self, modules: list[tuple[str, Tensor]]) -> None:
        amax = torch.stack([w.abs().amax().float() for _, w in modules]).amax()
        if not bool(torch.isfinite(amax)):
            raise QerlError(f"{modules[0][0]}: the merged weight has non-finite values; the adapter is damaged")
        scale = global_scale_from_amax(amax)
        key = fused_group_key(modules[0][0]) or modules[0][0]
        input_scale = None
        if self.input_scales:
            if key not in self.input_scales:
                raise QerlError(f"{key} has no input_scale in the run's NVFP4 checkpoint (it was excluded there); "
                                "exclude it here too (export.exclude) or set export.calibration=none")
            input_scale = self.input_scales[key]
        for module, weight in modules:
            # Own copies of the shared scales: safetensors refuses tensors that share memory.
            packed, self.errors[module] = quantize_stage.quantize_in_row_chunks(weight, scale.clone(),
                                                                                  f"{module}.weight")
            own_input_scale = None if input_scale is None else input_scale.clone()
            for n, t in nvfp4_tensors(module, packed, own_input_scale).items():
                self.writer.add(n, t)

    def finish(self) -> None:
        if self.pending:
            group = next(iter(self.pending))
            raise QerlError(f"the base lacks members of the fused group {group} ({sorted(self.pending[group])} found)")
        self.writer.finish()


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
    return quantize_stage.out_dtype(section.dtype, json.loads((base.dir / "config.json").read_text()))


def _export_peft(adapter_dir: Path, chain: _Chain | None, out: Path) -> dict[str, Any]:
    adapter = read_adapter(adapter_dir)  # checks it parses before copying
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        shutil.copy2(adapter_dir / name, out / name)
    return {
        "rank": adapter.config["r"], "alpha": adapter.config["lora_alpha"],
        "lora_modules": len(adapter.lora), "modules_to_save": adapter.config.get("modules_to_save"),
        "trained_over": chain.base_format if chain else None,
    }


def _export_merged(section: ExportSection, trained_over: str, base: _Base, adapter: _Adapter,
                   input_scales: dict[str, Tensor], out: Path, full: bool = False) -> dict[str, Any]:
    """Merge `adapter` into `base` (with `full`, the base is the run's trained model and the
    adapter empty: every tensor is trained) and write it dense or as NVFP4."""
    dtype = out_dtype(section, base)
    writer = _ShardWriter(out)
    nvfp4 = section.format == "merged-nvfp4"
    sink = _NVFP4Sink(writer, sorted({"lm_head", *section.exclude}), dtype, input_scales) if nvfp4 else None
    changed = 0
    for name, tensor, was_changed in progress(_merged_tensors(base, adapter), "merge"):
        changed += was_changed or full
        if sink is not None:
            sink.add(name, tensor)
        else:
            writer.add(name, _cast(tensor, dtype))
    summary: dict[str, Any] = {
        "base": base.description, "base_dequantized": base.dequantized, "trained_over": trained_over,
        "adapter": "full" if full else "lora",
        "dtype": str(dtype).removeprefix("torch."), "merged_linears": len(adapter.lora),
        "trained_norms": len(adapter.norms), "changed_tensors": changed,
    }
    if sink is None:
        writer.finish()
        _write_dense_config(base.dir, out, dtype)
        return summary
    sink.finish()
    quant_algo = "NVFP4" if input_scales else "W4A16_NVFP4"
    quantize_stage.write_configs(base.dir, out, quant_algo, sorted({"lm_head", *sink.excluded}), dtype)
    errors = sink.errors
    summary.update({"quant_algo": quant_algo, "quantized_linears": len(errors),
                    "mean_relative_error": sum(errors.values()) / max(1, len(errors)),
                    "max_relative_error": max(errors.values(), default=0.0)})
    return summary


def run_export(recipe: Recipe, store: ArtifactStore, *, run: Artifact | None = None, force: bool = False) -> Artifact:
    """Export `run` (default: the recipe's run, found or trained) in `recipe.export.format`.

    Every input is checked (run kind, chain, base, adapter fit) before anything is written.
    """
    section = recipe.export
    if run is None:
        run = train_stage.run_train(recipe, store)
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
        base = _Base(adapter_dir, False, {"run_model": train_stage.MODEL_DIR}, [],
                     "the run's fully trained weights")
        adapter = _Adapter({}, {}, 0.0, {})
        config.update({"dtype": section.dtype, "base": base.identity})
        if section.format == "merged-nvfp4":  # a bf16 engine has no calibration: always W4A16
            config.update({"exclude": sorted({"lm_head", *section.exclude}), "calibration": section.calibration})
    elif section.format == "peft":
        try:
            chain = _walk_chain(run, store)  # only to record what the adapter was trained over
        except ArtifactError:
            chain = None
    else:
        chain = _walk_chain(run, store)
        base = _find_base(chain, store)
        adapter = read_adapter(adapter_dir)
        _check_adapter_fits(adapter, base)
        config.update({"dtype": section.dtype, "base": base.identity})
        parents += base.parents
        if section.format == "merged-nvfp4":
            config.update({"exclude": sorted({"lm_head", *section.exclude}), "calibration": section.calibration})
            if section.calibration == "auto" and chain.quantized is not None:
                input_scales = _input_scales(load_artifact(chain.quantized.path, verify=True))
                if input_scales and chain.quantized.id not in parents:
                    parents.append(chain.quantized.id)
    with store.create(stage=STAGE, stage_version=VERSION, kind=KINDS[section.format], config=config,
                      parents=parents, force=force) as (pending, existing):
        if existing is not None:
            log(f"export: up to date, reusing {existing.path}")
            return existing
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
    return load_artifact(store.path_for(STAGE, pending.id), verify=False)
