"""humming-kernels copies of a model's NVFP4 linears, for the rows the dispatch table gives humming.

humming reads its own layout, so a linear it serves holds its base twice (ours for the rows our
GEMM wins, humming's for the others): 0.5625 bytes per weight more. `attach_humming` makes the
copies only for the layer shapes the active table (`kernels.dispatch`) sends to humming (the
engine asks for them only where the memory plan left room); it compiles humming's kernels for them
now, before any CUDA graph is captured. Without copies those rows run our kernels (the table's
fallback rule), which the one log line says.

An NVFP4 MoE's experts get a copy of the same kind: each sparse layer's experts stacked per
projection for humming's grouped GEMM (`kernels.humming_experts`, `attach_grouped_experts`), so
an inference forward runs a layer's experts in two launches without a host sync. A bf16 MoE's
experts run torch's grouped GEMM the same way (`kernels.torch_grouped`), over their own weights
restacked in place (no copy). Not where the experts carry LoRA (the grouped GEMMs apply none):
those keep the per-expert path, and so does every MoE on the CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from qerl_pipe.kernels import dispatch, humming_backend, torch_grouped
from qerl_pipe.kernels.optional_backend import failure
from qerl_pipe.kernels.tiled import untile_nvfp4
from qerl_pipe.kernels.torch_grouped import TorchGroupedExperts
from qerl_pipe.log import log
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
    shapes = dispatch.humming_shapes(table, deterministic)
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


def _groupable(model: nn.Module) -> tuple[list[SparseMoE], str | None]:
    """The sparse layers whose experts can run as grouped GEMMs on their device, and the grouped
    kernels' name: humming's for NVFP4 experts, torch's for bf16 ones (sm_90+); none for other
    formats, on the CPU, or where the experts carry LoRA (or a bias) the grouped GEMMs don't apply."""
    layers = _sparse_layers(model)
    if not layers:
        return [], None
    linears = [lin for m in layers for e in m.experts for lin in (e.gate_up_proj, e.down_proj)]
    device = _expert_device(layers[0])
    if linears[0].fmt.hopper_dispatch and all(lin.fmt.hopper_dispatch for lin in linears):
        kernels = "humming" if device.type == "cuda" and humming_backend.available(device) else None
    elif all(lin.fmt.dense and lin.weight.dtype == torch.bfloat16 for lin in linears):
        kernels = "torch" if torch_grouped.runs_here(device) else None
    else:
        kernels = None
    if kernels is None:
        return [], None
    plain = [m for m in layers if not any(len(lin.lora_A) or lin.bias is not None
                                          for e in m.experts for lin in (e.gate_up_proj, e.down_proj))]
    return plain, kernels


def _humming_grouped(layer: SparseMoE, compile_now: bool, deterministic: bool) -> GroupedExperts:
    from qerl_pipe.kernels.humming_experts import HummingExperts

    gate_up = HummingExperts([untile_nvfp4(e.gate_up_proj.kernel_weight) for e in layer.experts])
    down = HummingExperts([untile_nvfp4(e.down_proj.kernel_weight) for e in layer.experts])
    if compile_now:  # one compile per projection shape and schedule
        gate_up.compile(deterministic)
        down.compile(deterministic)
    return GroupedExperts(gate_up, down, len(layer.experts))


def stack_expert_weights(linears: list[QuantLinear]) -> torch.Tensor:
    """The dense weights of `linears` (one per expert) stacked [E, N, K], each linear's weight
    becoming a view of its slice: one allocation of the layer's weights at a time, then the old
    ones are freed (no second copy stays)."""
    stacked = torch.stack([lin.weight for lin in linears])
    for i, lin in enumerate(linears):
        lin.weight = stacked[i]
    return stacked


def _torch_grouped(layer: SparseMoE) -> GroupedExperts:
    gate_up = TorchGroupedExperts(stack_expert_weights([e.gate_up_proj for e in layer.experts]))
    down = TorchGroupedExperts(stack_expert_weights([e.down_proj for e in layer.experts]))
    return GroupedExperts(gate_up, down, len(layer.experts))


def attach_grouped_experts(model: nn.Module) -> int:
    """Give each sparse layer whose experts can run grouped (`_groupable`) its grouped experts:
    humming copies (compiled now) for NVFP4, views of the stacked weights for bf16. Returns the
    bytes added (0 for bf16, and where nothing can run grouped here)."""
    candidates, kernels = _groupable(model)
    layers = [m for m in candidates if m.grouped is None]
    if not layers:
        return 0
    _, deterministic = dispatch.active(_expert_device(layers[0]))
    added = 0
    try:
        with torch.no_grad():
            for i, layer in enumerate(layers):
                grouped = (_humming_grouped(layer, i == 0, deterministic) if kernels == "humming"
                           else _torch_grouped(layer))
                layer.grouped = grouped
                added += grouped.gate_up.nbytes + grouped.down.nbytes
    except Exception as exc:  # every layer keeps the per-expert path
        detach_grouped_experts(model)
        log(f"kernels: no grouped experts ({failure(exc)}); the per-expert path serves the MoE layers")
        return 0
    log(f"kernels: grouped {kernels} experts for {len(layers)} MoE layers ({added / 2**30:.2f} GiB added)"
        + (f", {'deterministic' if deterministic else 'fast (not deterministic)'} schedule" if kernels == "humming" else ""))
    return added


def all_experts_grouped(model: nn.Module) -> bool:
    """Whether every sparse layer runs grouped (then an inference forward has no host sync and
    fixed shapes: a CUDA graph can replay it); true for a dense model."""
    return all(m.grouped is not None for m in _sparse_layers(model))


def detach_grouped_experts(model: nn.Module) -> None:
    for m in _sparse_layers(model):
        m.grouped = None
