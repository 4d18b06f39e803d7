"""Triton FP8 (E4M3) kernels of the rollout's linears: the GEMM y = (x8 * sx) @ (w8 * sw)^T (+ bias,
+ the LoRA expand u @ B^T) over a per-channel E4M3 copy of a base, and the per-token E4M3 rows of
down's input (the gate fused in) and of o's. docs/kernels.md#fp8-rollouts: where each runs."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from qerl_pipe.kernels.fp8 import FP8, Fp8Rows, Fp8Weight
from qerl_pipe.kernels.triton_decode import INV_FP8_MAX, _code_scale
from qerl_pipe.kernels.triton_pdl import launch_dependents, pdl_options, wait_previous

SMS_TO_FILL = 132  # an H100's SMs: split K until the grid has about this many programs


@triton.jit
def _epilogue(acc, offs_n, offs_m, n_ok, m_ok, xs_ptr, ws_ptr, bias_ptr, u_ptr, b_ptr, out_ptr, R, su, so,
              HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (weight rows x tokens) scaled, + bias, + LoRA, rounded once into out [M, N]."""
    y = acc * tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)[:, None] * tl.load(xs_ptr + offs_m, mask=m_ok,
                                                                             other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_LORA:
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_ok = offs_r < R
            b = tl.load(b_ptr + offs_n[:, None] * R + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0)
            u = tl.load(u_ptr + offs_m[:, None] * su + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0)
            # tf32 holds bf16 exactly (a bf16 MMA's products); the interpreter's bf16 dots are wrong.
            y = tl.dot(b.to(tl.float32), tl.trans(u.to(tl.float32)), y, input_precision="tf32")
    tl.store(out_ptr + offs_m[None, :] * so + offs_n[:, None], y.to(out_ptr.dtype.element_ty),
             mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _fp8_gemm(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, u_ptr, b_ptr, part_ptr, ticket_ptr, out_ptr, M, N, K, R, sx,
              su, so, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
              STAGES: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr,
              USE_PDL: tl.constexpr):
    # Weights are the MMA's M side (BLOCK_N rows, 64+) and tokens its N side (BLOCK_M, 16-256), so a
    # decode batch wastes no MMA rows. The token tiles of one weight tile are neighbours in launch
    # order (program_id 0) and share its bytes through L2: the weight is read from HBM once.
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    launch_dependents(USE_PDL)
    offs_n, offs_m = pid_n * BLOCK_N + tl.arange(0, BLOCK_N), pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    start, end = pid_k * per_split, tl.minimum((pid_k + 1) * per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    wait_previous(USE_PDL)  # x is the previous kernel's output
    for t in tl.range(start, end, num_stages=STAGES):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0,
                    eviction_policy="evict_first")  # streamed once: keep L2 for x and the neighbours' tiles
        x = tl.load(x_ptr + offs_m[:, None] * sx + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
    if SPLIT_K == 1:
        _epilogue(acc, offs_n, offs_m, n_ok, m_ok, xs_ptr, ws_ptr, bias_ptr, u_ptr, b_ptr, out_ptr, R, su, so,
                  HAS_BIAS, HAS_LORA, BLOCK_R)
    else:
        # Each split parks its sums; the last of a tile to take the ticket adds them in split order
        # (a given config gives bit-identical results), finishes the tile and re-arms the ticket.
        tile = pid_n * tl.num_programs(0) + pid_m
        local = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        parts = part_ptr + tile * SPLIT_K * BLOCK_N * BLOCK_M
        tl.store(parts + pid_k * BLOCK_N * BLOCK_M + local, acc)
        tl.debug_barrier()  # every thread's partial is written before the ticket (release) is taken
        ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(parts + s * BLOCK_N * BLOCK_M + local, cache_modifier=".cg")
            _epilogue(total, offs_n, offs_m, n_ok, m_ok, xs_ptr, ws_ptr, bias_ptr, u_ptr, b_ptr, out_ptr, R, su, so,
                      HAS_BIAS, HAS_LORA, BLOCK_R)
            tl.atomic_xchg(ticket_ptr + tile, 0)


@functools.lru_cache(maxsize=None)
def _tickets(device: torch.device) -> Tensor:
    """A ticket per output tile of a split-K launch (gemm_config splits grids of at most SMS_TO_FILL
    tiles), each left at zero; made eagerly, before graph capture."""
    return torch.zeros(4096, dtype=torch.int32, device=device)


def gemm_config(m: int, n: int, k: int) -> dict[str, int]:
    """Tile sizes and K splits for M tokens over an [N, K] weight: token tiles of up to 128, 64 weight
    rows a tile, K split until the grid fills the GPU (each split keeping 8+ K tiles)."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    block_k = 128
    tiles, split = triton.cdiv(n, 64) * triton.cdiv(m, block_m), 1
    while tiles * split * 2 <= SMS_TO_FILL * 2 and k // (block_k * split * 2) >= 8 and split < 8:
        split *= 2
    return {"BLOCK_N": 64, "BLOCK_M": block_m, "BLOCK_K": block_k, "SPLIT_K": split, "STAGES": 4, "num_warps": 4}


def fp8_gemm(x: Fp8Rows, w: Fp8Weight, bias: Tensor | None = None, lora: tuple[Tensor, Tensor] | None = None,
             config: dict[str, int] | None = None) -> Tensor:
    """x [M, K] @ W^T (+ bias [N]) (+ u @ B^T for lora = (u [M, R], B [N, R])) -> bf16 [M, N], each output
    rounded once. Launches run one at a time per device (the tickets), as a stream's kernels do."""
    (m, k), n = x.codes.shape, w.codes.shape[0]
    if x.codes.stride(1) != 1 or w.codes.shape[1] != k or not w.codes.is_contiguous():
        raise ValueError(f"fp8_gemm needs x [M, K] contiguous in K and a contiguous [N, {k}] weight; got "
                         f"x {tuple(x.codes.shape)}, weight {tuple(w.codes.shape)}")
    cfg = dict(config or gemm_config(m, n, k))
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"])
    assert cfg["SPLIT_K"] == 1 or grid[0] * grid[1] <= _tickets(x.codes.device).numel(), "more tiles than tickets"
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.codes.device)
    part = out if cfg["SPLIT_K"] == 1 else torch.empty(
        grid[0] * grid[1] * cfg["SPLIT_K"] * cfg["BLOCK_N"] * cfg["BLOCK_M"], dtype=torch.float32, device=out.device)
    (u, b), r = (lora, lora[1].shape[1]) if lora is not None else ((out, out), 0)
    _fp8_gemm[grid](x.codes, x.scale, w.codes, w.scale, out if bias is None else bias, u, b, part,
                    _tickets(out.device), out, m, n, k, r, x.codes.stride(0), u.stride(0), out.stride(0),
                    HAS_BIAS=bias is not None, HAS_LORA=lora is not None,
                    BLOCK_R=max(16, min(64, triton.next_power_of_2(max(r, 1)))), **cfg, **pdl_options(out.device))
    return out


@triton.jit
def _gate_value(g_ptr, offs, ok, H, GATE: tl.constexpr):
    """Row values at offs: x (GATE 0), or SiLU (1) / GELU-tanh (2) of gate times up from a gate_up row [2H]."""
    if GATE == 0:
        v = tl.load(g_ptr + offs, mask=ok, other=0.0)
    else:
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(g_ptr + H + offs, mask=ok, other=0.0).to(tl.float32)
        # SiLU(g) = g * sigmoid(g); GELU-tanh(g) = g * (1 + tanh(c)) / 2 = g * sigmoid(2c), c = sqrt(2/pi)(g + 0.044715 g^3)
        z = g if GATE == 1 else 1.5957691216057308 * (g + 0.044715 * g * g * g)
        act = g / (1.0 + tl.exp(-z))
        v = (act * up).to(g_ptr.dtype.element_ty)
    return v


@triton.jit
def _gated_rows(x_ptr, y_ptr, q_ptr, s_ptr, H, sx, sy, sq, GATE: tl.constexpr, BLOCK: tl.constexpr,
                   USE_PDL: tl.constexpr):
    # One program per row: its values (the gate's written to y) and their amax over H in BLOCK-wide
    # steps, then the codes from the values read back (y: half the bytes of the gate's input).
    row = tl.program_id(0)
    launch_dependents(USE_PDL)
    wait_previous(USE_PDL)
    amax = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, H, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        ok = offs < H
        v = _gate_value(x_ptr + row * sx, offs, ok, H, GATE)
        if GATE != 0:
            tl.store(y_ptr + row * sy + offs, v, mask=ok)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    scale = _code_scale(tl.max(amax, 0), INV_FP8_MAX)  # as `fp8.row_codes`
    tl.debug_barrier()  # the gate's values written above are visible to every thread of the row
    src = x_ptr + row * sx if GATE == 0 else y_ptr + row * sy
    for k0 in range(0, H, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        ok = offs < H
        v = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * sq + offs, tl.math.div_rn(v, scale).to(tl.float8e4nv), mask=ok)
    tl.store(s_ptr + row, scale)


GATES = {"silu": 1, "gelu_pytorch_tanh": 2}  # _gate_value's GATE per model.decoder.GATES key


def gated_rows(x: Tensor, gate: str | None = None) -> tuple[Tensor, Fp8Rows]:
    """E4M3 rows (as `fp8.row_codes`) of x [M, H], or with `gate` (a model.decoder.GATES key) of the
    gate's output from x = a fused gate_up [M, 2H]; returns (the bf16 rows, their codes)."""
    m, width = x.shape
    h = width if gate is None else width // 2
    if x.stride(1) != 1 or (gate is not None and (gate not in GATES or width % 2)):
        raise ValueError(f"gated_rows needs rows contiguous in their last dimension and a gate among "
                         f"{sorted(GATES)} over an even width; got {tuple(x.shape)}, gate {gate!r}")
    y = x if gate is None else torch.empty(m, h, dtype=x.dtype, device=x.device)
    q, scale = torch.empty(m, h, dtype=FP8, device=x.device), torch.empty(m, 1, dtype=torch.float32, device=x.device)
    _gated_rows[(m,)](x, y, q, scale, h, x.stride(0), y.stride(0), q.stride(0), GATE=0 if gate is None else GATES[gate],
                      BLOCK=min(4096, triton.next_power_of_2(h)), num_warps=8, **pdl_options(x.device))
    return y, Fp8Rows(q, scale)
