"""Kernel copies and stacks of a model's weights, made (humming's compiled) before CUDA graph capture:
humming's layout of the NVFP4 linears the dispatch table sends to it (`attach_humming`), the MoE
experts' grouped stacks and copies (`attach_grouped_experts`; not for LoRA experts, nor on the CPU).
See docs/model.md, sections "The model (`qerl_pipe/model/`)" and "Mixture of experts (Qwen3-MoE)"."""

from __future__ import annotations

import torch
from torch import nn

from qerl_pipe.kernels import dispatch, humming_backend, torch_grouped
from qerl_pipe.kernels.optional_backend import failure
from qerl_pipe.kernels.tiled import untile_nvfp4
from qerl_pipe.kernels.torch_grouped import StackedExperts
from qerl_pipe.log import log
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.moe import GroupedExperts, SparseMoE


def _nvfp4_linears(model: nn.Module) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear) and m.fmt.hopper_dispatch]


def humming_linears(model: nn.Module) -> list[QuantLinear]:
    """The NVFP4 linears whose shape some row of the active table sends to humming."""
    linears = _nvfp4_linears(model)
    if not linears or linears[0].qweight.device.type != "cuda":
        return []
    table, deterministic = dispatch.active(linears[0].qweight.device)
    shapes = dispatch.humming_schedules(table, deterministic)  # shape -> schedules
    return [m for m in linears if (m.out_features, m.in_features) in shapes]


def copy_bytes(linears: list[QuantLinear]) -> int:
    """What humming copies of `linears` take: the same bytes as their NVFP4 bases."""
    return sum(m.qweight.numel() * 4 + m.scales.numel() + 4 for m in linears)


def attach_humming(model: nn.Module) -> int:
    """Give the linears the active table routes to humming their humming copy (when humming runs
    here); returns the bytes added."""
    linears = [m for m in humming_linears(model) if m.humming is None]
    if not linears:
        return 0
    device = linears[0].qweight.device
    if not humming_backend.available(device):
        return 0
    table, deterministic = dispatch.active(device)
    schedules = dispatch.humming_schedules(table, deterministic)
    refused: dict[tuple[int, int], str] = {}
    compiled: set[tuple[int, int]] = set()
    with torch.no_grad():
        for m in linears:
            shape = (m.out_features, m.in_features)
            if shape in refused:
                continue
            try:
                copy = humming_backend.HummingNVFP4(untile_nvfp4(m.kernel_weight))
                if shape not in compiled:  # one compile per shape and schedule
                    for schedule in sorted(schedules[shape]):
                        copy.compile(schedule)
                    compiled.add(shape)
            except Exception as exc:  # that shape's rows fall back to our kernels
                refused[shape] = failure(exc)
                continue
            m.humming = copy
    made = [m for m in linears if m.humming is not None]
    added = copy_bytes(made)
    log(f"kernels: humming copies of {len(made)} NVFP4 linears ({added / 2**30:.2f} GiB), "
        f"{'deterministic' if deterministic else 'fast (not deterministic)'} schedule"
        + "".join(f"; [{n}, {k}] refused ({why}), our kernels serve it" for (n, k), why in refused.items()))
    return added


def detach_humming(model: nn.Module) -> None:
    for m in _nvfp4_linears(model):
        m.humming = None


def _sparse_layers(model: nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def _expert_device(layer: SparseMoE) -> torch.device:
    return layer.experts[0].gate_up_proj.base_device()


def _groupable(model: Decoder) -> list[SparseMoE]:
    """The sparse layers whose experts can run as grouped GEMMs: bf16 or NVFP4 experts with a
    bf16 model on a GPU where torch's grouped GEMM runs (sm_90+), without LoRA or bias on the
    experts (the grouped GEMMs apply neither). Nothing on the CPU or in other formats."""
    layers = _sparse_layers(model)
    if not layers or not torch_grouped.runs_here(_expert_device(layers[0]), model.dtype):
        return []
    linears = [lin for m in layers for e in m.experts for lin in (e.gate_up_proj, e.down_proj)]
    if not all(lin.fmt.dense or lin.fmt.hopper_dispatch for lin in linears):
        return []
    return [m for m in layers if not any(len(lin.lora_A) or lin.bias is not None
                                         for e in m.experts for lin in (e.gate_up_proj, e.down_proj))]


def stack_expert_buffers(linears: list[QuantLinear]) -> StackedExperts:
    """The frozen bases of `linears` (one per expert, one format and shape) stacked along a new
    first dimension, each linear's buffers becoming views of their slice: one allocation of the
    projection's weights at a time, the old buffers then freed (no second copy stays)."""
    first = linears[0]
    stacked = {}
    for key in first.fmt.buffers:
        stacked[key] = torch.stack([getattr(lin, key) for lin in linears])
        for i, lin in enumerate(linears):
            setattr(lin, key, stacked[key][i])
    return StackedExperts(first.out_features, first.in_features, **stacked)


def _stack(layer: SparseMoE) -> GroupedExperts:
    return GroupedExperts(stack_expert_buffers([e.gate_up_proj for e in layer.experts]),
                          stack_expert_buffers([e.down_proj for e in layer.experts]), len(layer.experts))


def _humming_grouped(layer: SparseMoE, compile_now: bool, deterministic: bool) -> GroupedExperts:
    """humming's copies of the layer's NVFP4 experts, with the layer's stacks serving the decode
    steps of few rows per expert (`humming_experts.HummingOrStack`)."""
    from qerl_pipe.kernels.humming_experts import HummingExperts, HummingOrStack

    gate_up = HummingOrStack(HummingExperts([untile_nvfp4(e.gate_up_proj.kernel_weight) for e in layer.experts]),
                             layer.stacked.gate_up)
    down = HummingOrStack(HummingExperts([untile_nvfp4(e.down_proj.kernel_weight) for e in layer.experts]),
                          layer.stacked.down)
    if compile_now:  # one compile per projection shape and schedule
        gate_up.compile(deterministic)
        down.compile(deterministic)
    return GroupedExperts(gate_up, down, len(layer.experts))


def _attach_humming_experts(layers: list[SparseMoE]) -> int:
    """humming's grouped copies for the rollouts of NVFP4 experts; returns the bytes added (0,
    with every layer left on its stack, when humming does not run here or fails)."""
    device = _expert_device(layers[0])
    if not humming_backend.available(device):
        return 0
    _, deterministic = dispatch.active(device)
    added = 0
    try:
        with torch.no_grad():
            for i, layer in enumerate(layers):
                layer.grouped = _humming_grouped(layer, i == 0, deterministic)
                added += layer.grouped.gate_up.nbytes + layer.grouped.down.nbytes
    except Exception as exc:  # the stacks serve the rollouts too
        for layer in layers:
            layer.grouped = layer.stacked
        log(f"kernels: no humming expert copies ({failure(exc)}); torch's grouped GEMM serves the MoE rollouts")
        return 0
    log(f"kernels: humming grouped copies of {len(layers)} MoE layers' experts ({added / 2**30:.2f} GiB), "
        f"{'deterministic' if deterministic else 'fast (not deterministic)'} schedule")
    return added


def attach_grouped_experts(model: Decoder, copies: bool = True) -> int:
    """Run the experts of every sparse layer that can (`_groupable`) as grouped GEMMs: their
    bases stacked in place (`stacked`: training, and torch's grouped GEMM for inference), and for
    NVFP4 experts with `copies` humming's grouped copies for inference (`grouped`), compiled now.
    Returns the bytes added: the copies' (the stacks add none)."""
    layers = _groupable(model)
    if not layers:
        return 0
    with torch.no_grad():
        for layer in layers:
            if layer.stacked is None:
                layer.stacked = _stack(layer)
    nvfp4 = not layers[0].experts[0].gate_up_proj.fmt.dense
    wanting = [m for m in layers if m.grouped is None or m.grouped is m.stacked]
    added = _attach_humming_experts(wanting) if copies and nvfp4 and wanting else 0
    for layer in layers:
        if layer.grouped is None or not copies:
            layer.grouped = layer.stacked
    on_stacks = sum(layer.grouped is layer.stacked for layer in layers)
    if on_stacks:  # said of the layers that run them, not of those humming's earlier copies serve
        log(f"kernels: torch's grouped GEMM over the stacked experts of {on_stacks} MoE layers")
    return added


def all_experts_grouped(model: nn.Module) -> bool:
    """Whether every sparse layer runs grouped (then an inference forward has no host sync and
    fixed shapes: a CUDA graph can replay it); true for a dense model."""
    return all(m.grouped is not None for m in _sparse_layers(model))


def detach_grouped_experts(model: nn.Module) -> None:
    """Back to the per-expert path (the experts' buffers stay views of the stacks: the same values)."""
    for m in _sparse_layers(model):
        m.grouped = m.stacked = None
