"""A MoE layer's routing and combine in one Triton launch each (CUDA inference; `model.moe` has the
torch reference). Expert choice and order equal the reference's, a weight at most one bf16 ulp off;
`_route` takes up to `MAX_PAIRS` pairs. See docs/kernels.md, section "MoE experts and routing"."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# The most (token, choice) pairs one routing program sorts: batch 512 at k = 8.
MAX_PAIRS = 4096
_TOKENS_PER_BLOCK = 16
_OFFSETS_PER_BLOCK = 16
_COMBINE_COLUMNS = 1024


def fits(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether `_route` takes this many tokens (its sort runs in one program)."""
    return 0 < tokens * top_k <= MAX_PAIRS and num_experts * triton.next_power_of_2(tokens * top_k) < 2**30


@triton.jit
def _route(logit_ptr, weight_ptr, id_ptr, source_ptr, inverse_ptr, offset_ptr, active_ptr, T, s_logit,
           E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, P: tl.constexpr,
           TB: tl.constexpr, EB: tl.constexpr, RENORM: tl.constexpr):
    cols = tl.arange(0, EP)
    kcols = tl.arange(0, KP)
    # 1. Each token's top-k experts and weights, TB tokens at a time.
    for start in tl.range(0, T, TB):
        rows = start + tl.arange(0, TB)
        ok = rows < T
        z = tl.load(logit_ptr + rows[:, None] * s_logit + cols[None, :], mask=ok[:, None] & (cols[None, :] < E),
                    other=float("-inf")).to(tl.float32)
        top = tl.full((TB, KP), float("-inf"), tl.float32)
        ids = tl.zeros((TB, KP), tl.int32)
        rest = z
        for j in tl.static_range(K):
            v, i = tl.max(rest, axis=1, return_indices=True, return_indices_tie_break_left=True)
            top = tl.where(kcols[None, :] == j, v[:, None], top)
            ids = tl.where(kcols[None, :] == j, i[:, None], ids)
            rest = tl.where(cols[None, :] == i[:, None], float("-inf"), rest)
        m = tl.max(top, axis=1)  # the largest logit: the first choice
        e = tl.exp(top - m[:, None])  # -inf (past k) -> 0
        if RENORM:
            denominator = tl.sum(e, axis=1)
        else:
            denominator = tl.sum(tl.exp(z - m[:, None]), axis=1)
        w = e / denominator[:, None]
        where = rows[:, None] * K + kcols[None, :]
        keep = ok[:, None] & (kcols[None, :] < K)
        tl.store(weight_ptr + where, w.to(weight_ptr.dtype.element_ty), mask=keep)
        tl.store(id_ptr + where, ids, mask=keep)
    # The pairs' experts, written above by other threads of this program, read back below.
    tl.debug_barrier()
    # 2. The pairs sorted by expert (unique keys: a stable order), and where each one goes.
    pairs = T * K
    p = tl.arange(0, P)
    valid = p < pairs
    expert = tl.load(id_ptr + p, mask=valid, other=0, cache_modifier=".cg")
    key = tl.sort(tl.where(valid, expert * P + p, E * P + p))
    pair = key % P
    tl.store(source_ptr + p, (pair // K).to(tl.int64), mask=valid)
    tl.store(inverse_ptr + pair, p.to(tl.int64), mask=valid)
    # 3. Expert e's rows start after the pairs of every expert below it.
    for e0 in tl.static_range(0, E + 1, EB):
        ex = e0 + tl.arange(0, EB)
        below = (expert[None, :] < ex[:, None]) & valid[None, :]
        tl.store(offset_ptr + ex, tl.sum(below.to(tl.int64), axis=1), mask=ex <= E)
    tl.debug_barrier()
    # 4. The experts with rows, in expert order, then -1: expert e starts at sorted row offsets[e].
    sorted_expert = key // P  # E past the pairs
    first = tl.load(offset_ptr + tl.minimum(sorted_expert, E), mask=valid, other=-1, cache_modifier=".cg")
    start = valid & (first == p)
    tl.store(active_ptr + tl.cumsum(start.to(tl.int32), axis=0) - 1, sorted_expert, mask=start)
    slots = tl.arange(0, EP)
    tl.store(active_ptr + slots, -1, mask=(slots >= tl.sum(start.to(tl.int32), axis=0)) & (slots < E))


@triton.jit
def _combine(out_ptr, weight_ptr, inverse_ptr, y_ptr, H, s_out, s_y, K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = h < H
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(K):
        row = tl.load(inverse_ptr + t * K + j)
        w = tl.load(weight_ptr + t * K + j).to(tl.float32)
        acc += w * tl.load(out_ptr + row * s_out + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * s_y + h, acc.to(y_ptr.dtype.element_ty), mask=ok)


def launch_route(logits: Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """logits [T, E] -> (weights [T, k] in `dtype`, expert ids [T, k] int32, source [T*k] int64:
    the token of each expert-sorted row, inverse [T*k] int64: the sorted row of each (token,
    choice) pair, offsets [E + 1] int64: expert e's rows are offsets[e]:offsets[e + 1], active
    [E] int32: the experts with rows in order, then -1)."""
    tokens, experts = logits.shape
    if logits.stride(1) != 1 or not fits(tokens, top_k, experts):
        raise ValueError(f"routing {tokens} tokens x top-{top_k} of {experts} experts in one program needs "
                         f"contiguous rows and at most {MAX_PAIRS} pairs; got strides {logits.stride()}")
    device = logits.device
    weights = torch.empty(tokens, top_k, dtype=dtype, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
    source = torch.empty(tokens * top_k, dtype=torch.int64, device=device)
    inverse = torch.empty_like(source)
    offsets = torch.empty(experts + 1, dtype=torch.int64, device=device)
    active = torch.empty(experts, dtype=torch.int32, device=device)
    _route[(1,)](logits, weights, ids, source, inverse, offsets, active, tokens, logits.stride(0), E=experts,
                 EP=triton.next_power_of_2(experts), K=top_k, KP=triton.next_power_of_2(top_k),
                 P=triton.next_power_of_2(tokens * top_k), TB=_TOKENS_PER_BLOCK, EB=_OFFSETS_PER_BLOCK,
                 RENORM=renormalize, num_warps=8)
    return weights, ids, source, inverse, offsets, active


def launch_combine(out: Tensor, weights: Tensor, inverse: Tensor) -> Tensor:
    """out [T*k, H] (rows sorted by expert), weights [T, k], inverse [T*k] -> [T, H] in out's dtype."""
    tokens, top_k = weights.shape
    hidden = out.shape[1]
    if out.stride(1) != 1 or out.shape[0] != tokens * top_k or not weights.is_contiguous():
        raise ValueError(f"combine needs out [{tokens * top_k}, H] with contiguous rows and contiguous weights; "
                         f"got out {tuple(out.shape)} strides {out.stride()}")
    y = torch.empty(tokens, hidden, dtype=out.dtype, device=out.device)
    _combine[(tokens, triton.cdiv(hidden, _COMBINE_COLUMNS))](out, weights, inverse, y, hidden, out.stride(0),
                                                              y.stride(0), K=top_k, BLOCK=_COMBINE_COLUMNS, num_warps=4)
    return y
