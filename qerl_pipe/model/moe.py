"""Routed experts (Qwen3-MoE): `Router`, `SparseMoE` (experts are ordinary `QuantLinear`s under
the checkpoint's names), `run_experts` (the per-expert loop: the CPU, experts with LoRA) and
`run_grouped` (one grouped GEMM per projection, offsets on the device, no host sync). The router
is frozen: no load-balancing loss. See docs/model.md, section "Mixture of experts (Qwen3-MoE)"."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qerl_pipe.kernels import dispatch
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.linear import Project, QuantLinear, call_module

Gate = Callable[[Tensor], Tensor]  # the fused gate_up output -> act(gate) * up


class GroupedMatmul(Protocol):
    # `active` (the experts with rows first) and `max_rows` (the most any expert gets) let a kernel
    # size its grid to the routing; a kernel that does not need them ignores them.
    def matmul(self, rows: Tensor, offsets: Tensor, deterministic: bool = True, active: Tensor | None = None,
               max_rows: int | None = None) -> Tensor: ...


@dataclass(frozen=True)
class GroupedExperts:
    """A sparse layer's experts as one grouped GEMM per projection (`kernels.humming_experts`,
    `kernels.torch_grouped`)."""

    gate_up: GroupedMatmul
    down: GroupedMatmul
    num_experts: int


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


@dataclass(frozen=True)
class Routing:
    """Where a layer's (token, choice) pairs go: sorted by expert, expert e's rows are
    offsets[e]:offsets[e + 1]; `source` [T*k] is each sorted row's token, `inverse` [T*k] each
    pair's sorted row, `weights` [T, k] the routing weights; `active` (int32 [E], from the fused
    routing only) the experts with rows in order, then -1."""

    weights: Tensor
    source: Tensor
    inverse: Tensor
    offsets: Tensor
    active: Tensor | None = None


def sort_by_expert(weights: Tensor, ids: Tensor, num_experts: int) -> Routing:
    """The routing of ids [T, k] in torch ops (the reference; what autograd runs through)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)  # stable: each expert sees its tokens in order
    # The inverse permutation by one scatter, not a second sort.
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    # Expert e's rows start where the sorted ids reach e: a binary search on the device, not
    # bincount, which reads the largest id back to the host to size its output.
    experts = torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype)
    return Routing(weights, order // k, inverse, torch.searchsorted(flat[order], experts))


def route_fused(router: Router, x: Tensor, num_experts: int) -> Routing:
    """`sort_by_expert(*router(x))` in one Triton launch after the router's GEMM (CUDA inference,
    `kernels.triton_moe.fits`)."""
    from qerl_pipe.kernels import triton_moe

    weights, _, source, inverse, offsets, active = triton_moe.launch_route(F.linear(x, router.weight), router.top_k,
                                                                           router.renormalize, x.dtype)
    return Routing(weights, source, inverse, offsets, active)


def _combine(out: Tensor, routing: Routing) -> Tensor:
    """Expert-sorted outputs [T*k, hidden] -> weighted and summed per token [T, hidden]."""
    t, k = routing.weights.shape
    if not torch.is_grad_enabled() and out.is_cuda:  # inference on a GPU: one Triton launch
        from qerl_pipe.kernels import triton_moe

        return triton_moe.launch_combine(out, routing.weights.contiguous(), routing.inverse)
    # Back to (token, choice) order by a gather, then each token's k outputs weighted and summed in
    # one batched matmul (fp32 accumulation, a fixed order): an index_add over tokens would add
    # with atomics on CUDA, in an order that changes run to run.
    return torch.bmm(routing.weights.reshape(t, 1, k), out[routing.inverse].reshape(t, k, -1)).reshape(t, -1)


def run_experts(x: Tensor, routing: Routing, experts: nn.ModuleList, gate: Gate,
                project: Project = call_module) -> Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t of x [T, hidden]: the (token,
    choice) pairs sorted by expert into one [T*k, hidden] block, each expert on its slice. Autograd
    flows through gathers, slices and sum (dX through the bases, LoRA gradients per expert)."""
    # The one host sync: per-linear kernels take their row count as a shape.
    bounds = routing.offsets.tolist()
    rows = x[routing.source]
    spans = [(expert, start, end) for expert, start, end in zip(experts, bounds[:-1], bounds[1:]) if end > start]
    # The activation runs once over every expert's rows (it is elementwise per row, so the same
    # values): on CUDA it is a torch.compile'd function, whose per-call cost would otherwise be
    # paid once per expert.
    hidden = gate(torch.cat([project(expert.gate_up_proj, rows[start:end]) for expert, start, end in spans]))
    out = torch.cat([project(expert.down_proj, hidden[start:end]) for expert, start, end in spans])
    return _combine(out, routing)


def run_grouped(x: Tensor, routing: Routing, grouped: GroupedExperts, gate: Gate,
                deterministic: bool = True) -> Tensor:
    """What `run_experts` computes, through each projection's grouped GEMM over all experts
    (`kernels.humming_experts`, `kernels.torch_grouped`): the experts' row offsets stay on the
    device, so no host sync."""
    rows = x[routing.source]
    # An expert gets each token at most once: at most T of the T * k rows.
    shape = {"active": routing.active, "max_rows": routing.weights.shape[0]}
    hidden = gate(grouped.gate_up.matmul(rows, routing.offsets, deterministic, **shape))
    return _combine(grouped.down.matmul(hidden, routing.offsets, deterministic, **shape), routing)


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
        grouped = self.stacked if torch.is_grad_enabled() else self.grouped
        num_experts = len(self.experts)
        if grouped is not None and not torch.is_grad_enabled() and self.fused_routing(flat):
            routing = route_fused(self.gate, flat, num_experts)
        else:
            routing = sort_by_expert(*self.gate(flat), num_experts)
        if grouped is not None:
            _, deterministic = dispatch.active(flat.device)  # the dispatch column every linear follows
            out = run_grouped(flat, routing, grouped, self.activation, deterministic)
        else:
            out = run_experts(flat, routing, self.experts, self.activation, project)
        return out.reshape(x.shape)

    def fused_routing(self, x: Tensor) -> bool:
        """Whether this inference call routes in one Triton launch (CUDA, few enough pairs)."""
        if not x.is_cuda:
            return False
        from qerl_pipe.kernels import triton_moe

        return triton_moe.fits(x.shape[0], self.gate.top_k, len(self.experts))


def inference_modules(model: nn.Module) -> Iterator[nn.Module]:
    """`model.modules()` less the per-expert modules of sparse layers that run grouped in inference
    (`grouped` set: their forward reads the grouped copies, never the experts' own modules). What
    the engine walks once per `generate`: Qwen3-30B-A3B has 12,288 expert linears and 38k expert
    tensors, a fifth of a second of Python to visit."""
    stack: list[nn.Module] = [model]
    while stack:
        module = stack.pop()
        yield module
        children = [c for c in module._modules.values() if c is not None]
        if isinstance(module, SparseMoE) and module.grouped is not None:
            children = [c for c in children if c is not module.experts]
        stack.extend(reversed(children))
