"""The engine's sampling step in two Triton kernels (CUDA; `engine.sampling.sample` is the reference). Noise and
temperature are computed as the reference computes them on CUDA: the same tokens, the logprob off only by its
sum order. See docs/kernels.md, "The decode step's kernels", and docs/engine.md, "Sampling and logprobs"."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

# Columns per partial program: at batch 1 the 152k vocabulary of Qwen2.5 still gives 38 programs.
CHUNK = 4096
BLOCK = 1024
# Triton's interpreter (the CPU tests) has no libdevice: there the noise takes tl.log (numpy's).
_LIBDEVICE = os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _hash32(x):
    # sampling.hash32 on uint32: the products wrap modulo 2**32, which is the reference's "& _M32".
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    return tl.log(x)


@triton.jit
def _scaled(logits, inv_temperature, SCALE: tl.constexpr, LIBDEVICE: tl.constexpr):
    z = logits.to(tl.float32)
    if SCALE:
        if LIBDEVICE:
            z = libdevice.mul_rn(z, inv_temperature)
        else:
            z = z * inv_temperature
    return z


@triton.jit
def _sample_partial(logit_ptr, key_ptr, step_ptr, part_ptr, idx_ptr, V, s_logit, inv_temperature,
                    GREEDY: tl.constexpr, SCALE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                    LIBDEVICE: tl.constexpr):
    b = tl.program_id(0)
    c = tl.program_id(1)
    chunks = tl.num_programs(1)
    row_hash = _hash32(((tl.load(key_ptr + b) ^ tl.load(step_ptr + b)) & 0xFFFFFFFF).to(tl.uint32))
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int32)
    for start in tl.range(c * CHUNK, tl.minimum((c + 1) * CHUNK, V), BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < V
        z = _scaled(tl.load(logit_ptr + b * s_logit + cols, mask=ok, other=float("-inf")), inv_temperature, SCALE,
                    LIBDEVICE)
        if GREEDY:
            val = z
        else:
            bits = _hash32(row_hash ^ cols.to(tl.uint32))
            u = ((bits >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2**-24: exact
            val = tl.where(ok, -_log(-_log(u, LIBDEVICE), LIBDEVICE) + z, float("-inf"))
        tile_best, tile_idx = tl.max(val, axis=0, return_indices=True, return_indices_tie_break_left=True)
        if tile_best > best:  # strictly: an equal value further right loses, as in torch.argmax
            best = tile_best
            best_idx = start + tile_idx
        tile_m = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - tile_m) + tl.sum(tl.exp(z - tile_m), axis=0)
        m = tile_m
    slot = (b * chunks + c) * 3
    tl.store(part_ptr + slot, m)
    tl.store(part_ptr + slot + 1, s)
    tl.store(part_ptr + slot + 2, best)
    tl.store(idx_ptr + b * chunks + c, best_idx)


@triton.jit
def _sample_merge(logit_ptr, part_ptr, idx_ptr, next_ptr, pos_ptr, live_ptr, step_ptr, rec_ptr, chunks, B,
                  s_logit, inv_temperature, SCALE: tl.constexpr, CP: tl.constexpr, LIBDEVICE: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.arange(0, CP)
    ok = offs < chunks
    base = (b * chunks + offs) * 3
    m = tl.load(part_ptr + base, mask=ok, other=float("-inf"))
    s = tl.load(part_ptr + base + 1, mask=ok, other=0.0)
    best = tl.load(part_ptr + base + 2, mask=ok, other=float("-inf"))
    m_all = tl.max(m, axis=0)
    lse = m_all + tl.log(tl.sum(s * tl.exp(m - m_all), axis=0))
    _, c = tl.max(best, axis=0, return_indices=True, return_indices_tie_break_left=True)
    token = tl.load(idx_ptr + b * chunks + c)
    z = _scaled(tl.load(logit_ptr + b * s_logit + token), inv_temperature, SCALE, LIBDEVICE)
    tl.store(next_ptr + b, token.to(tl.int64))
    tl.store(pos_ptr + b, tl.load(pos_ptr + b) + tl.load(live_ptr + b))
    tl.store(step_ptr + b, tl.load(step_ptr + b) + 1)
    tl.store(rec_ptr + b, token.to(tl.float64))
    tl.store(rec_ptr + B + b, (z - lse).to(tl.float64))


@functools.lru_cache(maxsize=64)
def _reciprocal_f32(temperature: float) -> float:
    """torch's CUDA division by a Python scalar: 1 / float32(T) in float32, then a multiply.
    Cached: the decode loop asks every step for the same temperature."""
    return (torch.tensor(1.0) / torch.tensor(float(temperature))).item()


def launch_sample_step(logits: Tensor, keys: Tensor, steps: Tensor, positions: Tensor, live: Tensor,
                       next_tokens: Tensor, record: Tensor, temperature: float) -> None:
    """Sample one token per row of logits [B, V] (temperature 0: greedy) and update the slots' state:
    keys, steps, positions, live, next_tokens int64 [B]; record float64 [2, B] gets (tokens,
    logprobs). Step s's noise, then steps += 1. No top-k / top-p (the reference sampler has them)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1 or record.shape != (2, rows) or not record.is_contiguous():
        raise ValueError(f"logits must be contiguous in the vocabulary and record [2, {rows}] contiguous; got "
                         f"logits strides {logits.stride()} and record {tuple(record.shape)}")
    greedy = temperature == 0.0
    scale = not greedy and temperature != 1.0
    chunks = triton.cdiv(vocab, CHUNK)
    part = torch.empty(rows * chunks * 3, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows * chunks, dtype=torch.int32, device=logits.device)
    inv = _reciprocal_f32(temperature) if scale else 1.0
    _sample_partial[(rows, chunks)](logits, keys, steps, part, idx, vocab, logits.stride(0), inv, GREEDY=greedy,
                                    SCALE=scale, CHUNK=CHUNK, BLOCK=BLOCK, LIBDEVICE=_LIBDEVICE, num_warps=4)
    _sample_merge[(rows,)](logits, part, idx, next_tokens, positions, live, steps, record, chunks, rows,
                           logits.stride(0), inv, SCALE=scale, CP=triton.next_power_of_2(chunks), LIBDEVICE=_LIBDEVICE,
                           num_warps=1)
