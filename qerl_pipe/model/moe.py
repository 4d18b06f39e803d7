"""Routed experts (Qwen3-MoE): the router, the experts and the one loop that runs them.

A sparse layer's MLP is `SparseMoE`: a router (`gate`, a frozen 16-bit [experts, hidden] matrix, as
modelopt and vLLM keep it) picks each token's top-k experts, and each expert is a small gated MLP
whose two linears are ordinary `QuantLinear`s (gate/up fused, down), named as the checkpoint names
them (`mlp.experts.E.gate_up_proj`). So everything the dense linears have, an expert has too: the
NVFP4 / NF4 / bf16 bases and their kernels, the CPU dense copy, the engine's stored weights, LoRA
per expert and its PEFT names, the merged exports.

Routing, as transformers computes it: logits `x Wᵀ` in the model dtype, softmax in float32, top-k,
renormalised to sum 1 when `norm_topk_prob`, cast back to the model dtype; each expert's output is
scaled by its weight and the k of them summed. The router stays frozen (LoRA trains the linears
only), so no load-balancing loss is added: the routing a run starts with is the routing it keeps.

`run_experts` sorts the token-expert pairs by expert with torch ops (one host sync per layer, for
the per-expert row counts the per-linear kernels need as shapes), runs each expert that got rows
through the per-linear path (`project`: the module itself in training, the engine's fused LoRA
in rollouts), the activation once over all of them, then weights and scatters the rows back.
`run_grouped` does the same with one grouped GEMM per projection over the sorted rows and the
experts' row offsets kept on the device (no host sync, fixed shapes: a CUDA graph replays it):
what runs where the experts carry no LoRA, on a GPU (set by `model.kernel_copies`): torch's
grouped GEMM over the experts' stacked bases in training (`SparseMoE.stacked`; NVFP4 stacks
dequantized per layer) and rollouts (`SparseMoE.grouped`), or humming-kernels' W4A16 grouped GEMM
for the rollouts of NVFP4 experts where its copies were made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qerl_pipe.kernels import dispatch
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.linear import QuantLinear

# project(linear, x [..., in]) -> [..., out] (the decoder's `Project`, repeated here so that this
# module does not import the decoder that builds it).
Project = Callable[[QuantLinear, Tensor], Tensor]
Gate = Callable[[Tensor], Tensor]  # the fused gate_up output -> act(gate) * up


class GroupedMatmul(Protocol):
    def matmul(self, rows: Tensor, offsets: Tensor, deterministic: bool = True) -> Tensor: ...


@dataclass(frozen=True)
class GroupedExperts:
    """A sparse layer's experts as one grouped GEMM per projection (`kernels.humming_experts`,
    `kernels.torch_grouped`)."""

    gate_up: GroupedMatmul
    down: GroupedMatmul
    num_experts: int


def call_module(linear: QuantLinear, x: Tensor) -> Tensor:
    return linear(x)


class Router(nn.Module):
    """Top-k softmax routing over `num_experts`, from a frozen [num_experts, hidden] weight."""

    def __init__(self, cfg: DecoderConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        weight = torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.top_k, self.renormalize = cfg.experts_per_token, cfg.norm_topk_prob

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class Expert(nn.Module):
    """One expert: act(gate) * up, then down, over the rows routed to it."""

    def __init__(self, cfg: DecoderConfig, base_format: str, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        (_, _, h, gate_up), (_, _, i, down) = cfg.expert_linears()
        self.gate_up_proj = QuantLinear(h, [n for _, n in gate_up], [p for p, _ in gate_up], base_format, dtype,
                                        device)
        self.down_proj = QuantLinear(i, [n for _, n in down], [p for p, _ in down], base_format, dtype, device)


def _by_expert(ids: Tensor) -> tuple[Tensor, Tensor]:
    """The order that sorts the (token, choice) pairs of ids [T, k] by expert (stable, so each
    expert sees its tokens in order), and the flat expert ids [T*k]."""
    flat = ids.reshape(-1)
    return flat.argsort(stable=True), flat


def _combine(out: Tensor, weights: Tensor, order: Tensor, t: int, k: int) -> Tensor:
    """Expert-sorted outputs [T*k, hidden] -> weighted and summed per token [T, hidden]."""
    # Back to (token, choice) order by a gather through the inverse permutation (one scatter, not
    # a second sort), then each token's k outputs weighted and summed in one batched matmul (fp32
    # accumulation, a fixed order): an index_add over tokens would add with atomics on CUDA, in an
    # order that changes run to run.
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return torch.bmm(weights.reshape(t, 1, k), out[inverse].reshape(t, k, -1)).reshape(t, -1)


def run_experts(x: Tensor, weights: Tensor, ids: Tensor, experts: nn.ModuleList, gate: Gate,
                project: Project = call_module) -> Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t of x [T, hidden].

    The (token, choice) pairs are sorted by expert, gathered into one [T*k, hidden] block, and
    each expert runs on its contiguous slice. Autograd flows through the gathers, the slices and
    the sum, so the training forward, dX through the frozen bases and LoRA gradients per expert
    come for free.
    """
    t, k = ids.shape
    order, flat = _by_expert(ids)
    # The one host sync: per-linear kernels take their row count as a shape.
    bounds = torch.bincount(flat, minlength=len(experts)).cumsum(0).tolist()
    rows = x[order // k]
    spans = [(expert, start, end) for expert, start, end in zip(experts, [0, *bounds[:-1]], bounds) if end > start]
    # The activation runs once over every expert's rows (it is elementwise per row, so the same
    # values): on CUDA it is a torch.compile'd function, whose per-call cost would otherwise be
    # paid once per expert.
    hidden = gate(torch.cat([project(expert.gate_up_proj, rows[start:end]) for expert, start, end in spans]))
    out = torch.cat([project(expert.down_proj, hidden[start:end]) for expert, start, end in spans])
    return _combine(out, weights, order, t, k)


def run_grouped(x: Tensor, weights: Tensor, ids: Tensor, grouped: GroupedExperts, gate: Gate,
                deterministic: bool = True) -> Tensor:
    """What `run_experts` computes, through each projection's grouped GEMM over all experts
    (`kernels.humming_experts`): the experts' row offsets stay on the device, so no host sync."""
    t, k = ids.shape
    order, flat = _by_expert(ids)
    # Expert e's rows start where the sorted ids reach e: a binary search on the device, not
    # bincount, which reads the largest id back to the host to size its output.
    experts = torch.arange(grouped.num_experts + 1, device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(flat[order], experts)
    rows = x[order // k]
    hidden = gate(grouped.gate_up.matmul(rows, offsets, deterministic))
    return _combine(grouped.down.matmul(hidden, offsets, deterministic), weights, order, t, k)


class SparseMoE(nn.Module):
    """A sparse layer's MLP: the router (`gate`, HF's name) and the experts."""

    def __init__(self, cfg: DecoderConfig, base_format: str, dtype: torch.dtype, device: torch.device | str,
                 gate: Gate):
        super().__init__()
        self.gate = Router(cfg, dtype, device)
        self.experts = nn.ModuleList(Expert(cfg, base_format, dtype, device) for _ in range(cfg.num_experts))
        self.activation = gate
        # Set by the engine (`model.kernel_copies`) where the experts run as grouped GEMMs; not
        # modules or buffers: never saved, made from the experts' bases each time an engine starts.
        # `stacked`: the experts' own bases stacked in place (torch's grouped GEMM, autograd too);
        # `grouped`: what inference runs (the stacks, or humming's copies of NVFP4 experts).
        self.stacked: GroupedExperts | None = None
        self.grouped: GroupedExperts | None = None

    def forward(self, x: Tensor, project: Project = call_module) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.gate(flat)
        grouped = self.stacked if torch.is_grad_enabled() else self.grouped
        if grouped is not None:
            _, deterministic = dispatch.active(flat.device)  # the dispatch column every linear follows
            out = run_grouped(flat, weights, ids, grouped, self.activation, deterministic)
        else:
            out = run_experts(flat, weights, ids, self.experts, self.activation, project)
        return out.reshape(x.shape)
