"""Build a Decoder from a Hugging Face directory (bf16 or NVFP4 checkpoint), one tensor at a time
(safetensors, never torch.load): each linear is converted as soon as its projections are all read,
so peak memory is the model plus one fused layer. See docs/model.md, section "Loading"."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from qerl_pipe.errors import ModelSourceError
from qerl_pipe.formats.checkpoint import detect_quant_format, iter_quantized_checkpoint
from qerl_pipe.formats.hf_config import CONFIG_NAME, read_model_config
from qerl_pipe.formats.names import FUSED_INDEX, PROJECTIONS, from_hf_name
from qerl_pipe.formats.nvfp4 import NVFP4Weight, dequantize_nvfp4, quantize_nvfp4_in_row_chunks
from qerl_pipe.kernels.base_formats import FORMATS, BaseFormat, base_format as format_entry
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.lora import LoraSpec, apply_lora

log = logging.getLogger(__name__)

# Tensors some checkpoints carry that the model recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(model_dir: Path | str, base_format: str = "bf16", dtype: torch.dtype = torch.bfloat16,
               device: torch.device | str = "cpu", lora: LoraSpec | None = None) -> Decoder:
    """Load a bf16 HF model (quantized on the fly to `base_format`) or an NVFP4 checkpoint (modelopt or
    compressed-tensors: as nvfp4, or dequantized for bf16; NF4 needs the bf16 model, no re-rounding)."""
    model_dir = Path(model_dir)
    fmt = format_entry(base_format)
    if not (model_dir / CONFIG_NAME).is_file():
        raise ModelSourceError(f"{model_dir} has no config.json; pass a Hugging Face model directory")
    hf = read_model_config(model_dir)
    model = Decoder(DecoderConfig.from_hf(hf), fmt.name, dtype, device)
    quant = detect_quant_format(hf)
    if quant is not None and not fmt.loads_nvfp4_checkpoint:
        readers = " or ".join(repr(f.name) for f in FORMATS.values() if f.loads_nvfp4_checkpoint)
        raise ModelSourceError(f"{model_dir} is an NVFP4 checkpoint ({quant}); {fmt.name.upper()} needs the original "
                               f"bf16 model, or load this one with base_format={readers}")
    assembler = _Assembler(model, fmt, dtype, device)
    # Unquantized checkpoints come through the same reader: every tensor by its own name.
    for name, item, _input_scale in iter_quantized_checkpoint(model_dir):  # W4A16: input scales unused
        assembler.add(name, item)
    assembler.finish(model_dir)
    if lora is not None:
        apply_lora(model, lora)
    return model


def model_memory_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and buffers (a tied weight counts once)."""
    storages = {(t.device, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta"}
    return sum(storages.values())


def _fuse_nvfp4(parts: list[NVFP4Weight], name: str) -> NVFP4Weight:
    """Concatenate NVFP4 projections along N; they must share a global scale to be one tensor."""
    scales = torch.stack([p.global_scale.float().reshape(()) for p in parts])
    if bool((scales == scales[0]).all()):
        packed = torch.cat([p.packed for p in parts])
        return NVFP4Weight(packed, torch.cat([p.block_scales for p in parts]), parts[0].global_scale)
    # Not from our quantizer (TensorRT-LLM would refuse it too): re-round under the shared scale,
    # which changes some codes; vLLM does the equivalent, with the same loss.
    log.warning("%s: fused projections have different NVFP4 global scales; requantizing under one", name)
    return quantize_nvfp4_in_row_chunks(torch.cat([dequantize_nvfp4(p) for p in parts]), name=name)


class _Assembler:
    """Collects checkpoint tensors by HF name and installs each piece as soon as it is complete."""

    def __init__(self, model: Decoder, fmt: BaseFormat, dtype: torch.dtype, device: torch.device | str):
        self.model, self.fmt, self.dtype, self.device = model, fmt, dtype, device
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        self.pending: dict[tuple[str, str], list[Any]] = {}  # (linear, "weight"|"bias") -> parts
        # Everything the checkpoint must provide (a tied lm_head is the embedding: named_parameters
        # lists a shared tensor once).
        self.missing = {n for n, _ in model.named_parameters()}
        self.missing |= {f"{n}.weight" for n in self.linears}
        self.missing |= {f"{n}.bias" for n, m in self.linears.items() if m.bias is not None}

    def add(self, hf_name: str, item: Tensor | NVFP4Weight) -> None:
        if hf_name.endswith(IGNORED_SUFFIXES):
            return
        name = from_hf_name(hf_name)
        if isinstance(item, NVFP4Weight):  # a quantized linear, by module name
            if name.rpartition(".")[2] in PROJECTIONS:
                self._add_linear_part(name, "weight", item)
                return
            # Something we keep dense (an lm_head quantized by an exporter without exclusions).
            name, item = f"{name}.weight", dequantize_nvfp4(item, self.dtype)
        module_name, _, kind = name.rpartition(".")
        if module_name.rpartition(".")[2] in PROJECTIONS:
            self._add_linear_part(module_name, kind, item)
            return
        if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
            return  # some tied checkpoints store the shared matrix twice
        param = self.model.get_parameter(name) if name in self.missing else None
        if param is None:
            raise ModelSourceError(f"checkpoint tensor {hf_name!r} has no place in a "
                                   f"{self.model.config.model_type} model")
        if param.shape != item.shape:
            raise ModelSourceError(f"{hf_name}: checkpoint shape {tuple(item.shape)} != model shape "
                                   f"{tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(item)
        self.missing.discard(name)

    def _add_linear_part(self, module_name: str, kind: str, part: Tensor | NVFP4Weight) -> None:
        parent, _, proj = module_name.rpartition(".")
        fused, index = FUSED_INDEX.get(proj, (proj, 0))
        target = f"{parent}.{fused}"
        linear = self.linears.get(target)
        if linear is None or kind not in ("weight", "bias"):
            raise ModelSourceError(f"checkpoint tensor {module_name}.{kind} has no place in the model")
        part = part.to(self.device)
        if isinstance(part, NVFP4Weight) and self.fmt.dense:
            part = dequantize_nvfp4(part, self.dtype)
        parts = self.pending.setdefault((target, kind), [None] * len(linear.names))
        parts[index] = part
        if any(p is None for p in parts):
            return
        del self.pending[(target, kind)]
        if kind == "bias":
            with torch.no_grad():
                linear.bias.copy_(torch.cat(parts))
        elif all(isinstance(p, NVFP4Weight) for p in parts):
            linear.set_base(_fuse_nvfp4(parts, target))
        else:
            # Dense, or a group that the checkpoint's exclusions left partly unquantized.
            dense = [dequantize_nvfp4(p) if isinstance(p, NVFP4Weight) else p for p in parts]
            linear.set_base(self.fmt.quantize(torch.cat(dense), target, self.dtype))
        self.missing.discard(f"{target}.{kind}")

    def finish(self, model_dir: Path) -> None:
        incomplete = sorted({f"{t}.{kind}" for t, kind in self.pending} | self.missing)
        if incomplete:
            more = f" and {len(incomplete) - 5} more" if len(incomplete) > 5 else ""
            shown = ", ".join(incomplete[:5]) + more
            raise ModelSourceError(f"{model_dir}: checkpoint lacks {shown}")
