"""The NVFP4 checkpoint writer (modelopt's unified HF layout), used by `quantize` and by the
merged-NVFP4 export. Nothing is written before the whole model is known to quantize
(`plan_checkpoint` checks every tensor and takes each fused group's amax first).
See docs/formats.md, section "Writing NVFP4 checkpoints"."""

from __future__ import annotations

import fnmatch
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

import qerl_pipe
from qerl_pipe.errors import QerlError, QuantizationError
from qerl_pipe.formats.checkpoint import ShardWriter, cast_floating, list_shards, open_shard, refuse_non_finite
from qerl_pipe.formats.hf_config import read_model_config
from qerl_pipe.formats.modelopt_layout import config_quantization_config, hf_quant_config, nvfp4_tensors
from qerl_pipe.formats.names import FUSED_GROUPS, HF_LINEAR_WEIGHT, ROUTER_WEIGHT, experts_group_key, fused_group_key
from qerl_pipe.formats.nvfp4 import (
    BLOCK_SIZE, NVFP4Weight, dequantize_nvfp4, global_scale_from_amax, quantize_nvfp4_in_row_chunks,
    shared_global_scale,
)
from qerl_pipe.formats.quant_error import ErrorSums, LayerError
from qerl_pipe.log import progress
from qerl_pipe.strict_json import write_json


# Tokenizer and generation files copied so the artifact loads as a model directory.
COPY_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                  "*.model", "generation_config.json", "chat_template.*")
# Rows are quantized in chunks of about this many elements: NVFP4 rows are independent once the
# global scale is fixed, so the bytes are the same, and the fp32 temporaries stay ~16 MB each
# instead of several copies of the largest tensor.
_CHUNK_ELEMENTS = 1 << 22


@dataclass
class WritePlan:
    """What pass 1 learned: which tensors to quantize, and each one's global (and input) scale."""

    quantized: dict[str, str] = field(default_factory=dict)  # weight name -> module name
    group_amax: dict[str, torch.Tensor] = field(default_factory=dict)  # group or module -> weight amax
    excluded: set[str] = field(default_factory=set)

    def scale_key(self, module: str) -> str:
        return fused_group_key(module) or module

    def input_key(self, module: str) -> str:
        """What shares `module`'s input scale: its fused group, or for an expert every expert of
        its layer (modelopt's MoE export: one gate/up and one down input_scale per layer)."""
        return experts_group_key(module) or self.scale_key(module)


def is_excluded(module: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def plan_checkpoint(shards: list[Path], exclude: list[str]) -> WritePlan:
    plan = WritePlan()
    for shard in progress(shards, "check weights", len(shards)):
        with open_shard(shard) as fh:
            for name in fh.keys():
                match = HF_LINEAR_WEIGHT.match(name)
                if router := ROUTER_WEIGHT.match(name):
                    plan.excluded.add(router.group(1))  # 16-bit, and named so in the configs
                if not match or is_excluded(match.group(1), exclude):
                    # Norms, embeddings and excluded linears are copied as they are: checked here.
                    refuse_non_finite(name, fh.get_tensor(name))
                    if match:
                        plan.excluded.add(match.group(1))
                    continue
                module = match.group(1)
                weight = fh.get_tensor(name)
                if weight.dim() != 2 or weight.shape[1] % BLOCK_SIZE:
                    raise QuantizationError(f"{name} has shape {tuple(weight.shape)}: NVFP4 needs in_features to be a "
                                            f"multiple of {BLOCK_SIZE}; exclude the module with --set "
                                            f"'quantize.exclude=[lm_head, {module}]'")
                amax = weight.abs().amax().float()  # exact in the weight's own dtype; NaN propagates
                if not bool(torch.isfinite(amax)):
                    refuse_non_finite(name, weight)
                plan.quantized[name] = module
                key = plan.scale_key(module)
                plan.group_amax[key] = torch.maximum(plan.group_amax[key], amax) if key in plan.group_amax else amax
    return plan


def input_scales(plan: WritePlan, input_amax: dict[str, float] | None) -> dict[str, torch.Tensor]:
    """input_scale per module from calibration; fused groups share the max of their members."""
    if input_amax is None:
        return {}
    missing = [m for m in plan.quantized.values() if m not in input_amax]
    if missing and experts_group_key(missing[0]) is not None:
        raise QerlError(f"the calibration has no statistics for the MoE experts ({missing[0]} and {len(missing) - 1} "
                        "more): calibrate hooks nn.Linear modules, which transformers' stacked experts are not; "
                        "quantize this model without --calibration (W4A16_NVFP4)")
    if missing:
        raise QerlError(f"the calibration has no statistics for {missing[0]} (and {len(missing) - 1} more): "
                        "it was made for another model; re-run calibrate on this model")
    group: dict[str, float] = {}
    for module in plan.quantized.values():
        key = plan.input_key(module)
        group[key] = max(group.get(key, 0.0), input_amax[module])
    return {m: global_scale_from_amax(torch.tensor(group[plan.input_key(m)])) for m in plan.quantized.values()}


def out_dtype(choice: str, config: dict) -> torch.dtype:
    if choice != "auto":
        return getattr(torch, choice)
    declared = config.get("torch_dtype") or config.get("dtype")
    return torch.float16 if declared == "float16" else torch.bfloat16


def write_shards(shards: list[Path], out: Path, plan: WritePlan, input_scales: dict[str, torch.Tensor],
                  dtype: torch.dtype, method: str,
                  channel_mean_square: dict[str, torch.Tensor] | None = None) -> dict[str, LayerError]:
    """Pass 2: quantize and write one output shard per input shard; returns each module's errors.
    `channel_mean_square` steers `act-mse`'s search, and with any method gives the output error."""
    ms = channel_mean_square or {}
    errors: dict[str, LayerError] = {}
    writer = ShardWriter(out, max_bytes=float("inf"), shards=len(shards))  # shards end where the source's do
    for shard in progress(shards, "quantize", len(shards)):
        with open_shard(shard) as fh:
            for name in fh.keys():
                tensor = fh.get_tensor(name)
                module = plan.quantized.get(name)
                if module is None:
                    writer.add(name, cast_floating(tensor, dtype))
                    continue
                w, errors[module] = quantize_in_row_chunks(
                    tensor, global_scale_from_amax(plan.group_amax[plan.scale_key(module)]), name, method,
                    ms.get(module) if method == "act-mse" else None, ms.get(module))
                for key, t in nvfp4_tensors(module, w, input_scales.get(module)).items():
                    writer.add(key, t)
                del tensor
        writer.close_shard()  # one output shard per input shard, as the source is cut
    writer.finish()
    return errors


def quantize_in_row_chunks(weight: torch.Tensor, global_scale: torch.Tensor, name: str, method: str = "rtn",
                           channel_weight: torch.Tensor | None = None,
                           channel_mean_square: torch.Tensor | None = None) -> tuple[NVFP4Weight, LayerError]:
    """NVFP4 of `weight` and its errors (`quant_error`), a bounded block of rows at a time: the
    weight error always, the output error when `channel_mean_square` is given."""
    sums = ErrorSums(channel_mean_square, name)
    packed = quantize_nvfp4_in_row_chunks(weight, global_scale, name=name, chunk_elements=_CHUNK_ELEMENTS,
                                          on_chunk=lambda chunk, q: sums.add(chunk, dequantize_nvfp4(q)),
                                          method=method, channel_weight=channel_weight)
    return packed, sums.result()


def write_configs(source: Path, out: Path, quant_algo: str, exclude_modules: list[str], dtype: torch.dtype) -> None:
    """An NVFP4 checkpoint's config.json (with its quantization_config), hf_quant_config.json, tokenizer files."""
    quantization = config_quantization_config(quant_algo, exclude_modules, qerl_pipe.__version__)
    write_dense_config(source, out, dtype, quantization)
    write_json(out / "hf_quant_config.json", hf_quant_config(quant_algo, exclude_modules, qerl_pipe.__version__))


def copy_model_files(source: Path, out: Path) -> None:
    """The tokenizer and generation files, so that a directory of weights loads as a model."""
    for pattern in COPY_PATTERNS:
        for path in source.glob(pattern):
            if path.is_file():
                shutil.copy2(path, out / path.name)


@dataclass
class NVFP4StreamWriter:
    """The writer for weights known only as they stream by (a LoRA merge): linears are quantized as
    they come, a fused group waits until all its members are in, so that they share one global
    scale (and input scale) as `write_shards` gives them from its plan."""

    writer: ShardWriter
    exclude: list[str]
    dtype: torch.dtype
    input_scales: dict[str, torch.Tensor]  # fused group or module -> input_scale; empty: W4A16
    pending: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    excluded: set[str] = field(default_factory=set)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        match = HF_LINEAR_WEIGHT.match(name)
        module = match.group(1) if match else None
        if router := ROUTER_WEIGHT.match(name):
            self.excluded.add(router.group(1))
        if module is None or is_excluded(module, self.exclude):
            if module is not None:
                self.excluded.add(module)
            self.writer.add(name, cast_floating(tensor, self.dtype))
            return
        group = fused_group_key(module)
        if group is None:
            self._write([(module, tensor)])
            return
        members = self.pending.setdefault(group, {})
        members[module] = tensor
        parent, projections = group.rpartition(".")[0], FUSED_GROUPS[group.rpartition(".")[2]]
        expected = [f"{parent}.{p}" for p in projections if not is_excluded(f"{parent}.{p}", self.exclude)]
        if set(members) == set(expected):
            del self.pending[group]
            self._write([(m, members[m]) for m in expected])

    def _write(self, modules: list[tuple[str, torch.Tensor]]) -> None:
        scale = shared_global_scale(w for _, w in modules)
        if not bool(torch.isfinite(scale)):
            raise QerlError(f"{modules[0][0]}: the merged weight has non-finite values; the adapter is damaged")
        key = fused_group_key(modules[0][0]) or modules[0][0]
        input_scale = None
        if self.input_scales:
            if key not in self.input_scales:
                raise QerlError(f"{key} has no input_scale in the run's NVFP4 checkpoint (it was excluded there); "
                                "exclude it here too (export.exclude) or set export.calibration=none")
            input_scale = self.input_scales[key]
        for module, weight in modules:
            # Own copies of the shared scales: safetensors refuses tensors that share memory.
            packed, error = quantize_in_row_chunks(weight, scale.clone(), f"{module}.weight")
            self.errors[module] = error.weight
            own_input_scale = None if input_scale is None else input_scale.clone()
            for n, t in nvfp4_tensors(module, packed, own_input_scale).items():
                self.writer.add(n, t)

    def finish(self) -> None:
        if self.pending:
            group = next(iter(self.pending))
            raise QerlError(f"the base lacks members of the fused group {group} ({sorted(self.pending[group])} found)")
        self.writer.finish()


def write_dense_config(source: Path, out: Path, dtype: torch.dtype, quantization: dict | None = None) -> None:
    """config.json of a model made from `source` in `dtype`, dense (16-bit) unless `quantization` is its
    quantization_config, and its tokenizer files."""
    config = read_model_config(source)
    config.pop("quantization_config", None)  # the weights are dense now, or quantized as `quantization` says
    if quantization is not None:
        config["quantization_config"] = quantization
    # config.json names its dtype `dtype` where only that key is there, else `torch_dtype`.
    dtype_key = "dtype" if "dtype" in config and "torch_dtype" not in config else "torch_dtype"
    config[dtype_key] = str(dtype).removeprefix("torch.")
    write_json(out / "config.json", config)
    copy_model_files(source, out)


def read_input_scales(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """`input_scale` per fused group / module from an NVFP4 checkpoint (empty: W4A16): the base model's
    calibration statistics; the merged model's activations differ from them by the adapter's effect."""
    scales: dict[str, torch.Tensor] = {}
    for shard in list_shards(checkpoint_dir):
        with open_shard(shard) as fh:
            for key in fh.keys():
                if key.endswith(".input_scale"):
                    module = key.removesuffix(".input_scale")
                    scales[fused_group_key(module) or module] = fh.get_tensor(key).float().reshape(())
    return scales
