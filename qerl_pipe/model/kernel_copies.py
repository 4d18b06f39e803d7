"""humming-kernels copies of a model's NVFP4 linears, for the rows the dispatch table gives humming.

humming reads its own layout, so a linear it serves holds its base twice (ours for the rows our
GEMM wins, humming's for the others): 0.5625 bytes per weight more. `attach_humming` makes the
copies only for the layer shapes the active table (`kernels.dispatch`) sends to humming (the
engine asks for them only where the memory plan left room); it compiles humming's kernels for them
now, before any CUDA graph is captured. Without copies those rows run our kernels (the table's
fallback rule), which the one log line says.

An NVFP4 MoE's experts get a copy of the same kind: each sparse layer's experts stacked per
projection for humming's grouped GEMM (`kernels.humming_experts`, `attach_grouped_experts`), so
an inference forward runs a layer's experts in two launches without a host sync. Not where the
experts carry LoRA (the grouped GEMM applies none): those keep the per-expert path.
"""

from __future__ import annotations

import torch
from torch import nn

from qerl_pipe.kernels import dispatch, humming_backend
from qerl_pipe.kernels.optional_backend import failure
from qerl_pipe.kernels.tiled import untile_nvfp4
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


def _groupable(model: nn.Module) -> list[SparseMoE]:
    """The sparse layers whose experts can run as grouped GEMMs: NVFP4 experts on CUDA, no LoRA."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if not layers or not all(e.gate_up_proj.fmt.hopper_dispatch for m in layers for e in m.experts):
        return []
    if layers[0].experts[0].gate_up_proj.qweight.device.type != "cuda":
        return []
    return [m for m in layers if not any(len(lin.lora_A) for e in m.experts for lin in (e.gate_up_proj, e.down_proj))]


def attach_grouped_experts(model: nn.Module) -> int:
    """Give each sparse layer whose experts can run grouped (`_groupable`) its stacked humming
    copies, compiled now; returns the bytes added (0 when humming cannot run here)."""
    from qerl_pipe.kernels.humming_experts import HummingExperts

    layers = [m for m in _groupable(model) if m.grouped is None]
    if not layers:
        return 0
    device = layers[0].experts[0].gate_up_proj.qweight.device
    if not humming_backend.available(device):
        return 0
    _, deterministic = dispatch.active(device)
    added = 0
    try:
        with torch.no_grad():
            for i, layer in enumerate(layers):
                gate_up = HummingExperts([untile_nvfp4(e.gate_up_proj.kernel_weight) for e in layer.experts])
                down = HummingExperts([untile_nvfp4(e.down_proj.kernel_weight) for e in layer.experts])
                if i == 0:  # one compile per projection shape and schedule
                    gate_up.compile(deterministic)
                    down.compile(deterministic)
                layer.grouped = GroupedExperts(gate_up, down, len(layer.experts))
                added += gate_up.nbytes + down.nbytes
    except Exception as exc:  # every layer keeps the per-expert path
        detach_grouped_experts(model)
        log(f"kernels: no grouped experts ({failure(exc)}); the per-expert path serves the MoE layers")
        return 0
    log(f"kernels: grouped humming experts for {len(layers)} MoE layers ({added / 2**30:.2f} GiB), "
        f"{'deterministic' if deterministic else 'fast (not deterministic)'} schedule")
    return added


def detach_grouped_experts(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, SparseMoE):
            m.grouped = None
