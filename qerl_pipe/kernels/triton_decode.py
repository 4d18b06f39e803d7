"""Triton kernels of the decode step (`decode_ops`: what they compute, the references). A row's results
depend on that row alone; under PDL a kernel reads what the running step wrote only after
`wait_previous`. docs/kernels.md, "The decode step's kernels"."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from qerl_pipe.kernels.fp8 import FP8, FP8_MAX as _FP8_MAX, MIN_AMAX as _MIN_AMAX, Fp8Rows
from qerl_pipe.kernels.triton_pdl import launch_dependents, pdl_options, wait_previous

MIN_AMAX: tl.constexpr = tl.constexpr(_MIN_AMAX)
INV_FP8_MAX: tl.constexpr = tl.constexpr(1.0 / _FP8_MAX)
INV_INT8_MAX: tl.constexpr = tl.constexpr(1.0 / 127.0)

SPLIT, CODED_SPLIT = 128, 512  # cache positions per program (bf16, coded): fixed, never per batch
FULL_WINDOW = 1 << 30  # the window of a layer with full attention: wider than any cache


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """Head sizes the attention kernels take: a power of two from 16 (a tl.dot side) to 256."""
    d = q.shape[-1]
    return (16 <= d <= 256 and d & (d - 1) == 0 and k_cache.stride(-1) == 1
            and k_cache.dtype in (q.dtype, FP8, torch.int8))


@triton.jit
def _rope_rows(ptr, rows, row_stride, row_mask, c, s, offs_d, ROT: tl.constexpr, HALF: tl.constexpr):
    """RoPE of rows [R, D] at ptr + rows * row_stride, in fp32: x * cos + rotate_half(x) * sin over
    the leading ROT dims (c = 1, s = 0 past them: partial rotary passes those through)."""
    base = ptr + rows[:, None] * row_stride
    x = tl.load(base + offs_d[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    mate = tl.where(offs_d < ROT, (offs_d + HALF) % ROT, offs_d)
    partner = tl.load(base + mate[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
    rot = tl.where(offs_d[None, :] < HALF, -partner, partner)
    return x * c[None, :] + rot * s[None, :]


@triton.jit
def _soft_cap(scores, cap, CAPPED: tl.constexpr):
    """cap * tanh(scores / cap) (Gemma2) from exp, for the interpreter too (saturates, never inf / inf)."""
    if CAPPED:
        e = tl.exp(-2.0 * tl.abs(scores / cap))
        t = (1.0 - e) / (1.0 + e)
        scores = cap * tl.where(scores < 0, -t, t)
    return scores


@triton.jit
def _code_scale(amax, INV_MAX: tl.constexpr):  # as `fp8.row_codes`: times 1 / CODE_MAX, not divided
    return tl.maximum(amax, MIN_AMAX) * INV_MAX


@triton.jit
def _row_codes(x, CODE_T: tl.constexpr):
    """Rows [R, D] coded as `fp8.row_codes` codes them (E4M3 or INT8), and their scales [R]."""
    x32 = x.to(tl.float32)
    row_scale = _code_scale(tl.max(tl.abs(x32), 1), INV_INT8_MAX if CODE_T == tl.int8 else INV_FP8_MAX)
    v = tl.math.div_rn(x32, row_scale[:, None])
    int8 = tl.minimum(tl.maximum(tl.floor(v + 0.5), -127.0), 127.0).to(tl.int8)  # x / scale rounded half up
    return (int8 if CODE_T == tl.int8 else v.to(tl.float8e4nv)), row_scale  # (the other compiled away)


@triton.jit
def _stored(x, scale_ptr, CODED: tl.constexpr, CODE_T: tl.constexpr):
    """A new k or v row [1, D] as the cache stores it (CODED: `_row_codes`, the scale written to
    `scale_ptr`) and as attention reads it back (dequantized)."""
    stored, read = x, x  # Triton returns only from the function's own body: one return, at its end
    if CODED:
        codes, row_scale = _row_codes(x, CODE_T)
        tl.store(scale_ptr + tl.arange(0, 1), row_scale)
        stored, read = codes, (codes.to(tl.float32) * row_scale[:, None]).to(x.dtype)
    return stored, read


@triton.jit
def _partial(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
             sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, s_cos, skc_b, skc_h, skc_t, svc_b, svc_h, svc_t,
             sks_b, sks_h, svs_b, svs_h, Hq, S, scale, window, cap,
             G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, SPLIT_LEN: tl.constexpr,
             BLOCK: tl.constexpr, CAPPED: tl.constexpr, PRECISION: tl.constexpr, CODED: tl.constexpr,
             F16_DOTS: tl.constexpr, USE_PDL: tl.constexpr):
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    launch_dependents(USE_PDL)
    dtype = q_ptr.dtype.element_ty  # the model dtype (a coded cache is read back into it)
    pos = tl.load(pos_ptr + b).to(tl.int32)
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, GP)
    g_ok = offs_g < G
    wait_previous(USE_PDL)  # q, k, v, cos and sin are this step's
    rotates = offs_d < ROT
    c = tl.load(cos_ptr + b * s_cos + offs_d, mask=rotates, other=1.0).to(tl.float32)
    sn = tl.load(sin_ptr + b * s_cos + offs_d, mask=rotates, other=0.0).to(tl.float32)
    # The G query heads of kv head h, rotated and rounded to the cache dtype (as q is stored).
    q = _rope_rows(q_ptr + b * sq_b, h * G + offs_g, sq_h, g_ok, c, sn, offs_d, ROT, ROT // 2).to(dtype)
    # F16_DOTS (a coded cache, bf16 / fp16 model): codes are exact in fp16; q over its row amax fits its range.
    # INT8 keys meet q as two INT8 row codes, hi + lo (within amax / 64516 of q: finer than its bf16
    # rounding): exact integer sums in INT8 dots (codes in dot_t under an INT8 MMA's k of 32).
    code_t = kc_ptr.dtype.element_ty
    dot_t = tl.float16 if F16_DOTS else dtype
    key_t = dot_t
    if code_t == tl.int8 and D >= 32:
        key_t = tl.int8
    q_scale = tl.full((GP,), 1.0, tl.float32)
    q_dot = q
    if F16_DOTS:
        q_scale = tl.maximum(tl.max(tl.abs(q.to(tl.float32)), 1), MIN_AMAX)
        q_dot = (q.to(tl.float32) / q_scale[:, None]).to(tl.float16)
    if code_t == tl.int8:
        q_dot, q_scale = _row_codes(q, tl.int8)
        q_lo, lo_scale = _row_codes(q.to(tl.float32) - q_dot.to(tl.float32) * q_scale[:, None], tl.int8)
        q_dot, q_lo, lo_scale = q_dot.to(key_t), q_lo.to(key_t), lo_scale / q_scale  # (lo's sums in hi's units)

    m_i = tl.full((GP,), float("-inf"), tl.float32)
    l_i = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, D), tl.float32)
    lo = s * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, pos)  # cached positions before the new token
    # A window hides positions <= pos - window: blocks wholly before `first` are skipped, the edge
    # one masked; a split with no visible position runs no block (its zeros weigh nothing in the merge).
    first = tl.maximum(pos - window + 1, 0)
    lo_w = tl.maximum(lo, first)
    hi_w = tl.where(lo_w < hi, hi, lo)
    kc, vc = kc_ptr + b * skc_b + h * skc_h, vc_ptr + b * svc_b + h * svc_h
    ks = ks_ptr + b * sks_b + h * sks_h  # scales: one per position (CODED only)
    vs = vs_ptr + b * svs_b + h * svs_h
    for start in range(lo + ((lo_w - lo) // BLOCK) * BLOCK, hi_w, BLOCK):
        offs_n = start + tl.arange(0, BLOCK)
        n_ok = (offs_n < hi) & (offs_n >= first)
        keys = tl.load(kc + offs_n[:, None] * skc_t + offs_d[None, :], mask=n_ok[:, None], other=0.0).to(key_t)
        if code_t == tl.int8:  # exact sums: in int32, or in fp32 over codes in dot_t
            hi_sums = tl.dot(q_dot, tl.trans(keys), out_dtype=tl.int32 if key_t == tl.int8 else tl.float32)
            lo_sums = tl.dot(q_lo, tl.trans(keys), out_dtype=tl.int32 if key_t == tl.int8 else tl.float32)
            scores = (hi_sums.to(tl.float32) + lo_sums.to(tl.float32) * lo_scale[:, None]) * scale
        else:
            scores = tl.dot(q_dot, tl.trans(keys), input_precision=PRECISION) * scale
        if CODED:  # (q / q_scale) . codes x q_scale x the codes' scale
            scores = scores * q_scale[:, None] * tl.load(ks + offs_n, mask=n_ok, other=0.0)[None, :]
        scores = tl.where(n_ok[None, :], _soft_cap(scores, cap, CAPPED), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vals = tl.load(vc + offs_n[:, None] * svc_t + offs_d[None, :], mask=n_ok[:, None], other=0.0).to(dot_t)
        v_max = 1.0
        if CODED:  # p @ (codes x scale) = (p x scale) @ codes; in fp16 over the block's largest scale
            v_scale = tl.load(vs + offs_n, mask=n_ok, other=0.0)
            if F16_DOTS:
                v_max = tl.maximum(tl.max(v_scale, 0), MIN_AMAX)
                v_scale = v_scale / v_max
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_t), vals, input_precision=PRECISION) * v_max
        m_i = m_new

    if (pos >= lo) & (pos < lo + SPLIT_LEN):
        # The new token: rotate k, write k and v at pos, add its score from registers.
        one = tl.arange(0, 1)
        k_new = _rope_rows(k_ptr + b * sk_b, h + one, sk_h, one < 1, c, sn, offs_d, ROT, ROT // 2).to(dtype)
        v_new = tl.load(v_ptr + b * sv_b + h * sv_h + offs_d[None, :] + one[:, None] * 0).to(dtype)
        k_code, k_new = _stored(k_new, ks + pos, CODED, kc_ptr.dtype.element_ty)  # as later steps read it
        v_code, v_new = _stored(v_new, vs + pos, CODED, vc_ptr.dtype.element_ty)
        tl.store(kc + pos * skc_t + offs_d[None, :] + one[:, None] * 0, k_code.to(kc_ptr.dtype.element_ty))
        tl.store(vc + pos * svc_t + offs_d[None, :] + one[:, None] * 0, v_code.to(vc_ptr.dtype.element_ty))
        score = _soft_cap(tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale, cap, CAPPED)
        m_new = tl.maximum(m_i, score)
        p_new = tl.exp(score - m_new)
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)
        l_i = l_i * alpha + p_new
        m_i = m_new

    row = (b * Hq + h * G + offs_g) * S + s
    tl.store(m_ptr + row, m_i, mask=g_ok)
    tl.store(l_ptr + row, l_i, mask=g_ok)
    tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _merge(m_ptr, l_ptr, acc_ptr, out_ptr, S, D: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)  # b * Hq + head
    launch_dependents(USE_PDL)
    wait_previous(USE_PDL)
    offs_d = tl.arange(0, D)
    top = tl.load(m_ptr + row * S)
    for s in range(1, S):
        top = tl.maximum(top, tl.load(m_ptr + row * S + s))
    total = tl.zeros((D,), tl.float32)
    norm = top * 0.0  # a float32 scalar (top is finite: the split holding the new token has it)
    for s in range(0, S):  # in split order: the same sum whatever the batch or attention length
        w = tl.exp(tl.load(m_ptr + row * S + s) - top)
        total += w * tl.load(acc_ptr + (row * S + s) * D + offs_d)
        norm += w * tl.load(l_ptr + row * S + s)
    tl.store(out_ptr + row * D + offs_d, (total / norm).to(out_ptr.dtype.element_ty))


def launch_decode_attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                            v_cache: Tensor, positions: Tensor, scale: float, window: int = 0, softcap: float = 0.0,
                            k_scale: Tensor | None = None, v_scale: Tensor | None = None, split: int | None = None,
                            block: int | None = None) -> Tensor:
    """The two Triton kernels (the interpreter too); a coded cache comes with its scales [B, Hkv, L]
    (contiguous in L). `split` / `block`: positions per program / inner step (default: the measured rules)."""
    b, hq, d = q.shape
    hkv, length = k_cache.shape[1], k_cache.shape[2]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("decode_attention needs q, k, v, cos and sin contiguous in their last dimension")
    coded = k_scale is not None
    # A code tile of 128 is the bytes of a bf16 one of 64; fp32 ones of head_dim 256 at 64 need 276 KB of smem.
    block = block or ((128 if d <= 128 else 64) if coded else 32 if d * q.element_size() > 512 else 64)
    split = split or (CODED_SPLIT if coded else SPLIT)
    splits = triton.cdiv(length, split)
    m = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
    g = hq // hkv
    if coded and (k_scale.stride(-1) != 1 or v_scale.stride(-1) != 1):
        raise ValueError("a coded cache's scales must be contiguous in their position dimension")
    ks, vs = (k_scale, v_scale) if coded else (m, m)  # unread in the model dtype
    _partial[(b, hkv, splits)](
        q, k, v, cos, sin, k_cache, v_cache, ks, vs, positions, m, l_sum, acc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
        hq, splits, scale, window if window > 0 else FULL_WINDOW, softcap or 1.0,
        G=g, GP=max(16, triton.next_power_of_2(g)), D=d, ROT=cos.shape[-1], SPLIT_LEN=split,
        BLOCK=block, CAPPED=bool(softcap), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        CODED=coded, F16_DOTS=coded and q.dtype != torch.float32, num_warps=4,
        **pdl_options(q.device))
    out = torch.empty(b, hq * d, dtype=q.dtype, device=q.device)
    _merge[(b * hq,)](m, l_sum, acc, out, splits, D=d, num_warps=1, **pdl_options(q.device))
    return out


@triton.jit
def _add_rms_norm(x_ptr, r_ptr, w_ptr, z_ptr, out_ptr, h_ptr, a_ptr, u_ptr, q_ptr, s_ptr, H, R, sx, sr, so, sh, sa, su,
                  sq, eps, offset, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr):
    # Program (row, 0) writes the normed row (and h); (row, j > 0) u's columns [(j - 1) * BLOCK_R,
    # j * BLOCK_R) from the same rounded values (the same 1 / rms bit for bit); loads in one go.
    row, j = tl.program_id(0), tl.program_id(1)
    launch_dependents(USE_PDL)
    offs = tl.arange(0, BLOCK)
    ok = offs < H
    # The weights first (no kernel of the step writes them), then the wait for x and the residual.
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32) + offset  # Gemma's (1 + w): offset 1
    w += tl.load(z_ptr + offs, mask=ok, other=0.0)
    offs_r = (j - 1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = (offs_r >= 0) & (offs_r < R)  # program 0 (the norm) has offs_r < 0: loads nothing
    a = tl.load(a_ptr + offs_r[:, None] * sa + offs[None, :], mask=r_ok[:, None] & ok[None, :], other=0.0)
    wait_previous(USE_PDL)
    x = tl.load(x_ptr + row * sx + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * sr + offs, mask=ok, other=0.0)
        h = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    else:
        h = x
    h32 = h.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h32 * h32, 0) / H + eps)
    normed = (h32 * inv_rms * w).to(out_ptr.dtype.element_ty)
    if j == 0:
        if HAS_RESIDUAL:
            tl.store(h_ptr + row * sh + offs, h, mask=ok)
        tl.store(out_ptr + row * so + offs, normed, mask=ok)
        if QUANT:  # the row's E4M3 codes and scale, from the rounded values (as `fp8.quantize_rows`)
            n32 = normed.to(tl.float32)
            scale = _code_scale(tl.max(tl.abs(n32), 0), INV_FP8_MAX)
            tl.store(q_ptr + row * sq + offs, tl.math.div_rn(n32, scale).to(q_ptr.dtype.element_ty), mask=ok)
            tl.store(s_ptr + row, scale)
    else:
        u = tl.sum(a.to(tl.float32) * normed.to(tl.float32)[None, :], 1)
        tl.store(u_ptr + row * su + offs_r, u.to(u_ptr.dtype.element_ty), mask=r_ok)


SHRINK_TILE = 16384  # elements of A per shrink program (BLOCK_R rows of the padded hidden size)


def launch_add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, noise: Tensor, eps: float,
                        shrink: Tensor | None = None, offset: float = 0.0,
                        quantize: bool = False) -> tuple[Tensor, Tensor, Tensor | None, Fp8Rows | None]:
    """The Triton kernel (the interpreter too); x [rows, H], shrink (a LoRA A, [R, H]) or None;
    `quantize`: the normed rows' E4M3 codes too. Each row's results depend on that row alone."""
    rows, hidden = x.shape
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("add_rms_norm needs rows contiguous in their last dimension")
    if shrink is not None and (shrink.shape[1] != hidden or shrink.stride(1) != 1):
        raise ValueError(f"the shrink matrix must be [R, {hidden}] and contiguous in its last dimension; got "
                         f"{tuple(shrink.shape)}")
    out = torch.empty_like(x)
    h = x if residual is None else torch.empty_like(x)
    r = x if residual is None else residual
    a = x if shrink is None else shrink
    n_u = 0 if shrink is None else shrink.shape[0]
    u = None if shrink is None else torch.empty(rows, n_u, dtype=x.dtype, device=x.device)
    u_arg = out if u is None else u
    q = torch.empty(rows, hidden, dtype=FP8, device=x.device) if quantize else None
    q_scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device) if quantize else None
    block = triton.next_power_of_2(hidden)
    block_r = max(1, SHRINK_TILE // block)
    _add_rms_norm[(rows, 1 + triton.cdiv(n_u, block_r))](
        x, r, weight, noise, out, h, a, u_arg, out if q is None else q, out if q_scale is None else q_scale,
        hidden, n_u, x.stride(0), r.stride(0), out.stride(0), h.stride(0), a.stride(0), u_arg.stride(0),
        hidden, eps, float(offset), HAS_RESIDUAL=residual is not None, QUANT=quantize, BLOCK=block, BLOCK_R=block_r,
        num_warps=max(1, min(16, block // 256)), **pdl_options(x.device))
    return out, h, u, None if q is None else Fp8Rows(q, q_scale)


@triton.jit
def _lora_shrink(x_ptr, a_ptr, part_ptr, ticket_ptr, u_ptr, rows, H, R, sx, sa, su,
                 KB: tl.constexpr, MP: tl.constexpr, RP: tl.constexpr, PRECISION: tl.constexpr,
                 USE_PDL: tl.constexpr):
    # Program s parks the [rows, R] partials of columns [s * KB, (s + 1) * KB) (A read once); the last
    # to take the ticket adds them in program order, writes u and re-arms the ticket.
    s = tl.program_id(0)
    launch_dependents(USE_PDL)
    offs_m = tl.arange(0, MP)
    m_ok = offs_m < rows
    offs_k = s * KB + tl.arange(0, KB)
    k_ok = offs_k < H
    offs_r = tl.arange(0, RP)
    r_ok = offs_r < R
    a = tl.load(a_ptr + offs_r[:, None] * sa + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
    wait_previous(USE_PDL)  # x, the workspace and the ticket: after the kernels before
    x = tl.load(x_ptr + offs_m[:, None] * sx + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    tile = offs_m[:, None] * RP + offs_r[None, :]
    tl.store(part_ptr + s * MP * RP + tile, tl.dot(x, tl.trans(a), input_precision=PRECISION))
    tl.debug_barrier()  # every thread's partial is written before the ticket (release) is taken
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        # Sixteen partials' loads in flight at a time, still added in program order.
        total = tl.zeros((MP, RP), tl.float32)
        last = tl.num_programs(0) - 1
        for j0 in range(0, tl.num_programs(0), 16):
            for i in tl.static_range(16):
                j = tl.minimum(j0 + i, last)  # past the end: reload the last one, added as 0
                part = tl.load(part_ptr + j * MP * RP + tile, cache_modifier=".cg")
                total += tl.where(j0 + i <= last, part, 0.0)
        tl.store(u_ptr + offs_m[:, None] * su + offs_r[None, :], total.to(u_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & r_ok[None, :])
        tl.atomic_xchg(ticket_ptr, 0)


SHRINK_COLUMNS = 256  # columns of x (and of A) per program


@functools.lru_cache(maxsize=None)
def _ticket(device: torch.device) -> Tensor:
    """One int32 per device that every shrink launch leaves at zero (made eagerly before graph capture)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def launch_lora_shrink(x: Tensor, shrink: Tensor) -> Tensor:
    """u = x @ shrink^T for x [rows <= 16, H] and shrink [R, H] (a LoRA A). Launches run one at a
    time per device (the ticket), as a stream's kernels do."""
    rows, hidden = x.shape
    if x.stride(1) != 1 or shrink.shape[1] != hidden or shrink.stride(1) != 1 or rows > 16:
        raise ValueError(f"the shrink needs at most 16 rows contiguous in their last dimension and an [R, {hidden}] "
                         f"matrix contiguous in its last dimension; got x {tuple(x.shape)}, {tuple(shrink.shape)}")
    n_u = shrink.shape[0]
    u = torch.empty(rows, n_u, dtype=x.dtype, device=x.device)
    programs = triton.cdiv(hidden, SHRINK_COLUMNS)
    rp = max(16, triton.next_power_of_2(n_u))
    part = torch.empty(programs * 16 * rp, dtype=torch.float32, device=x.device)
    _lora_shrink[(programs,)](
        x, shrink, part, _ticket(x.device), u, rows, hidden, n_u, x.stride(0), shrink.stride(0), u.stride(0),
        KB=SHRINK_COLUMNS, MP=16, RP=rp, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, **pdl_options(x.device))
    return u
