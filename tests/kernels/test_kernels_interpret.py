"""The Triton kernels under TRITON_INTERPRET=1 on CPU tensors, against the torch reference.

The decode step's kernels (decode attention, add + RMSNorm) run in fp32 here: the interpreter rounds fp32 -> bf16 toward zero and its tl.dot on bf16 inputs
returns garbage (seen with triton 3.9), so their bf16 path is tested on the GPU
(tests/kernels/test_decode_kernels_gpu.py).

Triton decides at import time whether `@triton.jit` functions (its own `tl.cdiv`, `tl.sum` too)
run in the interpreter, and a test session may have imported Triton already. So one subprocess
with the variable set runs every case (this file run as a script) and prints each case's relative
error as JSON; the tests below check them. Shapes are tiny: the interpreter executes every program
of the grid in Python. Outputs start as NaN, so an element the kernel never writes fails the test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Decode attention: (batch, q heads, kv heads, head_dim, attention length, sliding window,
# score cap, rotary dim); a length past one split, GQA groups of 1, 2 and 7, the smallest
# head_dim; windows inside one block, across blocks and splits (Mistral, Gemma's local layers),
# Gemma2's soft cap, Phi3's partial rotary.
ATTENTION_CASES = [(3, 4, 2, 16, 300, 0, 0.0, 16), (2, 5, 1, 32, 64, 0, 0.0, 32), (1, 7, 1, 64, 200, 0, 0.0, 64),
                   (2, 2, 2, 16, 129, 0, 0.0, 16), (3, 4, 2, 16, 300, 7, 0.0, 16), (3, 4, 2, 16, 300, 150, 0.0, 16),
                   (2, 4, 2, 32, 200, 70, 1.5, 32), (3, 4, 1, 32, 150, 0, 0.0, 16)]


def _attention_id(case: tuple) -> str:
    return "attention-b{}-hq{}-hkv{}-d{}-len{}-w{}-cap{}-rot{}".format(*case)


def _run_attention_case(case: tuple, seed: int) -> dict:
    """Max abs error vs the reference, whether both wrote the same cache, and whether row 1 alone
    gives row 1's bits of the batch (batch independence)."""
    from qerl_pipe.kernels import decode_ops, triton_decode

    b, hq, hkv, d, length, window, cap, rot = case
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=gen)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d)
    # A cache with more slots and positions than the view the step attends over (strided view).
    k_cache = torch.randn(2, b + 1, hkv, length + 5, d, generator=gen)
    v_cache = torch.randn(k_cache.shape, generator=gen)
    positions = torch.randint(0, length, (b,), generator=gen)
    positions[0] = length - 1
    angles = positions[:, None].float() * torch.rand(rot // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(3)]
    # Scores large enough for the cap to bend them (q scaled up).
    scale = d ** -0.5 * (4.0 if cap else 1.0)

    def view(c: torch.Tensor, rows: slice) -> torch.Tensor:
        return c[1, rows, :, :length]

    ref = decode_ops.decode_attention_reference(q, k, v, cos, sin, view(caches[0][0], slice(0, b)),
                                                view(caches[0][1], slice(0, b)), positions, scale, window, cap)
    out = triton_decode.launch_decode_attention(q, k, v, cos, sin, view(caches[1][0], slice(0, b)),
                                                view(caches[1][1], slice(0, b)), positions, scale, window, cap)
    row = slice(1, 2) if b > 1 else slice(0, 1)
    alone = triton_decode.launch_decode_attention(q[row], k[row], v[row], cos[row], sin[row], view(caches[2][0], row),
                                                  view(caches[2][1], row), positions[row], scale, window, cap)
    return {"max_err": float((out - ref).abs().max()),
            "same_cache": bool(torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])),
            "batch_independent": bool(torch.equal(alone, out[row]))}


def _run_norm_case(seed: int) -> dict:
    from qerl_pipe.kernels import decode_ops, triton_decode

    gen = torch.Generator().manual_seed(seed)
    x, r = torch.randn(3, 600, generator=gen), torch.randn(3, 600, generator=gen)
    weight, noise = torch.rand(600, generator=gen), torch.randn(600, generator=gen) * 1e-2
    shrink = torch.randn(37, 600, generator=gen) * 0.05  # R off the block, H over two K steps
    out = {}
    for name, residual, offset in (("no-residual", None, 0.0), ("residual", r, 0.0), ("offset", r, 1.0)):
        ref, ref_h = decode_ops.add_rms_norm_reference(x, residual, weight, noise, 1e-6, offset)
        got, got_h, none, _ = triton_decode.launch_add_rms_norm(x, residual, weight, noise, 1e-6, None, offset)
        fused, fused_h, u, _ = triton_decode.launch_add_rms_norm(x, residual, weight, noise, 1e-6, shrink, offset)
        alone = triton_decode.launch_add_rms_norm(x[1:2], None if residual is None else r[1:2], weight, noise, 1e-6,
                                                  shrink, offset)[2]
        out[name] = {"max_err": float((got - ref).abs().max()), "same_h": bool(torch.equal(got_h, ref_h)),
                     "no_u": none is None, "same_with_shrink": bool(torch.equal(fused, got) and torch.equal(fused_h, got_h)),
                     "u_max_err": float((u - ref @ shrink.t()).abs().max()),
                     "u_batch_independent": bool(torch.equal(alone, u[1:2]))}
    return out


def _run_shrink_case(seed: int) -> dict:
    """The LoRA shrink (o_proj's) with H over three programs (the last one partial), R off the
    block and strided rows, against plain torch; a row alone against the batch."""
    from qerl_pipe.kernels import triton_decode

    gen = torch.Generator().manual_seed(seed)
    hidden = 2 * triton_decode.SHRINK_COLUMNS + 100
    x = torch.randn(3, 2 * hidden, generator=gen)[:, :hidden]
    shrink = torch.randn(37, hidden, generator=gen) * 0.02
    u = triton_decode.launch_lora_shrink(x, shrink)
    alone = triton_decode.launch_lora_shrink(x[1:2], shrink)
    return {"u_max_err": float((u - x @ shrink.t()).abs().max()), "u_batch_independent": bool(torch.equal(alone, u[1:2]))}


# The sampling step: (rows, vocabulary, temperature); 0 is greedy, 1 needs no division. The
# vocabularies end mid-block and span several partial programs.
SAMPLE_CASES = [(3, 9000, 1.0), (2, 5000, 0.7), (3, 5000, 0.0), (1, 4096, 1.3)]


def _sample_id(case: tuple) -> str:
    return "sample-b{}-v{}-t{}".format(*case)


def _run_sample_case(case: tuple, seed: int) -> dict:
    """The two sampling kernels against `engine.sampling.sample`, and the slot-state updates."""
    from qerl_pipe.engine.sampling import SamplingParams, sample
    from qerl_pipe.kernels.triton_sample import launch_sample_step

    rows, vocab, temperature = case
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    keys = torch.randint(0, 2**32, (rows,), generator=gen)
    steps = torch.randint(0, 1000, (rows,), generator=gen)
    positions = torch.randint(0, 50, (rows,), generator=gen)
    live = torch.randint(0, 2, (rows,), generator=gen)
    tokens, logprobs = sample(logits, keys, steps, torch.arange(vocab), SamplingParams(temperature=temperature))
    next_tokens = torch.full((rows,), -1)
    record = torch.full((2, rows), float("nan"), dtype=torch.float64)
    before_pos, before_steps = positions.clone(), steps.clone()
    launch_sample_step(logits, keys, steps, positions, live, next_tokens, record, temperature)
    return {"same_tokens": tokens.tolist() == next_tokens.tolist() == record[0].long().tolist(),
            "logprob_err": float((record[1] - logprobs.double()).abs().max()),
            "state": bool(torch.equal(positions, before_pos + live) and torch.equal(steps, before_steps + 1))}


# MoE routing: (tokens, experts, top-k, renormalise); experts off a power of two, tokens across the
# routing program's blocks of 16, k equal to the experts.
ROUTE_CASES = [(1, 128, 8, True), (5, 12, 3, False), (37, 16, 4, True), (3, 8, 8, True), (1, 64, 2, False)]


def _route_id(case: tuple) -> str:
    return "route-t{}-e{}-k{}-renorm{}".format(*case)


def _run_route_case(case: tuple, seed: int) -> dict:
    """The routing kernel against `model.moe.sort_by_expert` over the reference router's choice,
    and the combine kernel against the reference's gather + batched matmul (float32 here)."""
    from qerl_pipe.kernels import triton_moe
    from qerl_pipe.model.moe import Routing, _combine, sort_by_expert

    tokens, experts, k, renorm = case
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(k, dim=-1)
    if renorm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ref = sort_by_expert(weights, ids, experts)
    got_w, got_ids, source, inverse, offsets, active = triton_moe.launch_route(logits, k, renorm, torch.float32)
    counts = ref.offsets.diff()
    with_rows = torch.nonzero(counts).flatten()
    expected_active = torch.cat([with_rows, torch.full((experts - len(with_rows),), -1)])
    out = torch.randn(tokens * k, 40, generator=gen)
    combined = triton_moe.launch_combine(out, got_w, inverse)
    with torch.no_grad():
        expected = _combine(out, Routing(weights, ref.source, ref.inverse, ref.offsets))
    return {"same_ids": bool(torch.equal(got_ids.long(), ids)),
            "weight_err": float((got_w - weights).abs().max()),
            "same_order": bool(torch.equal(source, ref.source) and torch.equal(inverse, ref.inverse)),
            "same_offsets": bool(torch.equal(offsets, ref.offsets)),
            "same_active": bool(torch.equal(active.long(), expected_active)),
            "combine_err": float((combined - expected).abs().max())}


def _run_fp8_case(seed: int) -> dict:
    """The FP8 outputs of the norm kernel and the FP8 KV path of the attention kernel against
    their references. The interpreter's own float -> E4M3 conversion rounds wrongly across binades
    (31.6 -> 16; the GPU test checks the rounding), so the new k and v here lie on the E4M3 grid
    times a power of two: their codes need no rounding, and the rest must match closely."""
    from qerl_pipe.kernels import decode_ops, fp8, triton_decode

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 600, generator=gen)
    weight, noise = torch.rand(600, generator=gen), torch.zeros(600)
    normed, _, _, q = triton_decode.launch_add_rms_norm(x, None, weight, noise, 1e-6, None, 0.0, True)
    b, hq, hkv, d, length = 2, 4, 2, 32, 150
    qq = torch.randn(b, hq, d, generator=gen)
    k, v = (fp8.row_codes(torch.randn(b, hkv, d, generator=gen))[0].float() * 2.0 ** -5 for _ in range(2))
    cos, sin = torch.ones(b, d), torch.zeros(b, d)  # no rotation: k stays on the grid
    positions = torch.tensor([3, 140])
    k8, ks = fp8.row_codes(torch.randn(b, hkv, length, d, generator=gen))
    v8, vs = fp8.row_codes(torch.randn(b, hkv, length, d, generator=gen))
    caches = [(k8.clone(), v8.clone(), ks[..., 0].clone(), vs[..., 0].clone()) for _ in range(2)]
    got = triton_decode.launch_decode_attention(qq, k, v, cos, sin, caches[0][0], caches[0][1], positions,
                                                d ** -0.5, 0, 0.0, caches[0][2], caches[0][3])
    ref = decode_ops.decode_attention_reference(qq, k, v, cos, sin, caches[1][0], caches[1][1], positions,
                                                d ** -0.5, 0, 0.0, caches[1][2], caches[1][3])
    return {"norm_scale_exact": bool(torch.equal(q.scale, fp8.quantize_rows(normed).scale)),
            "attention_rel_err": float((got - ref).norm() / ref.norm()),
            "kv_scales_close": bool(torch.allclose(caches[0][2], caches[1][2], rtol=1e-6, atol=0)
                                    and torch.allclose(caches[0][3], caches[1][3], rtol=1e-6, atol=0))}


def _run_int8_kv_case(seed: int) -> dict:
    """The INT8 KV path of the attention kernel (fp32 with a rotated new k, head sizes 32 and 16; bf16 unrotated: the
    interpreter's fp32 -> bf16 conversion does not round to nearest) against its reference: the
    codes it writes, their scales and the output (q meets the keys as its INT8 row codes in both)."""
    return {**_int8_kv(seed, torch.float32), **{f"bf16_{k}": v for k, v in _int8_kv(seed, torch.bfloat16).items()},
            **{f"d16_{k}": v for k, v in _int8_kv(seed, torch.float32, 16).items()}}


def _int8_kv(seed: int, dtype: torch.dtype, d: int = 32) -> dict:
    from qerl_pipe.kernels import decode_ops, fp8, triton_decode

    gen = torch.Generator().manual_seed(seed)
    b, hq, hkv, length = 2, 4, 2, 150
    qq, k, v = (torch.randn(b, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    angle = torch.rand(b, d // 2, generator=gen) * (dtype == torch.float32)
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
    positions = torch.tensor([3, 140])
    k8, ks = fp8.row_codes(torch.randn(b, hkv, length, d, generator=gen), torch.int8)
    v8, vs = fp8.row_codes(torch.randn(b, hkv, length, d, generator=gen), torch.int8)
    caches = [(k8.clone(), v8.clone(), ks[..., 0].clone(), vs[..., 0].clone()) for _ in range(2)]
    got = triton_decode.launch_decode_attention(qq, k, v, cos, sin, *caches[0][:2], positions, d ** -0.5, 0, 0.0,
                                                *caches[0][2:])
    ref = decode_ops.decode_attention_reference(qq, k, v, cos, sin, *caches[1][:2], positions, d ** -0.5, 0, 0.0,
                                                *caches[1][2:])
    codes_differ = sum(int((mine != theirs).sum()) for mine, theirs in zip(caches[0][:2], caches[1][:2]))
    return {"attention_rel_err": float((got.float() - ref.float()).norm() / ref.float().norm()), "codes_differ": codes_differ,
            "kv_scales_close": bool(torch.allclose(caches[0][2], caches[1][2], rtol=1e-6, atol=0)
                                    and torch.allclose(caches[0][3], caches[1][3], rtol=1e-6, atol=0))}


def _run_fp8_gemm_case(seed: int) -> dict:
    """Our FP8 GEMM (bias and LoRA in its epilogue; one split and three over uneven K tiles) against the
    fp32 reference, and the row kernel's gate values and scales (fp32 rows; codes: the GPU test)."""
    from qerl_pipe.kernels import fp8, triton_fp8
    from qerl_pipe.model.decoder import GATES

    gen = torch.Generator().manual_seed(seed)
    m, n, k, r = 5, 128, 640, 24
    q, w = fp8.quantize_rows(torch.randn(m, k, generator=gen)), fp8.quantize_weight(torch.randn(n, k, generator=gen))
    bias, u, b = torch.randn(n, generator=gen), torch.randn(m, r, generator=gen), torch.randn(n, r, generator=gen)
    out: dict = {}
    for split in (1, 3):
        config = {"BLOCK_N": 64, "BLOCK_M": 16, "BLOCK_K": 128, "SPLIT_K": split, "STAGES": 2, "num_warps": 4}
        got = triton_fp8.fp8_gemm(q, w, bias.bfloat16(), (u.bfloat16(), b.bfloat16()), config).float()
        exact = fp8.fp8_linear_reference(q, w, torch.float32) + bias.bfloat16().float() + (
            u.bfloat16().float() @ b.bfloat16().float().T)
        out[f"split{split}_rel_err"] = float((got - exact).norm() / exact.norm())
    for gate in ("silu", "gelu_pytorch_tanh"):
        gate_up = torch.randn(3, 2 * 300, generator=gen) * 3
        values, rows = triton_fp8.gated_rows(gate_up, gate)
        out[f"{gate}_value_err"] = float((values - GATES[gate](gate_up)).abs().max())
        out[f"{gate}_scale_exact"] = bool(torch.equal(rows.scale, fp8.row_codes(values)[1]))
    return out


def test_fp8_gemm_and_row_kernel_match_their_references(results: dict[str, dict]) -> None:
    r = results["fp8-gemm"]
    assert "error" not in r, f"seed {r['seed']}: {r.get('error')}"
    # The interpreter rounds the bf16 output toward zero: up to one bf16 step per element.
    assert r["split1_rel_err"] < 1e-2 and r["split3_rel_err"] < 1e-2, r
    assert r["silu_value_err"] < 1e-5 and r["gelu_pytorch_tanh_value_err"] < 1e-5, r
    assert r["silu_scale_exact"] and r["gelu_pytorch_tanh_scale_exact"], r


def test_int8_kv_attention_matches_its_reference(results: dict[str, dict]) -> None:
    r = results["int8kv"]
    assert "error" not in r, f"seed {r['seed']}: {r.get('error')}"
    # A code may differ by one where the rotation's fp32 rounding lands x / scale on a half.
    assert r["kv_scales_close"] and r["codes_differ"] <= 2, f"seed {r['seed']}: {r}"
    assert r["attention_rel_err"] < 1e-4, f"seed {r['seed']}: {r}"
    # bf16 q, k, v: the kernel's value dot in fp16 over the codes, the reference's in fp32.
    assert r["bf16_kv_scales_close"] and r["bf16_codes_differ"] <= 2 and r["bf16_attention_rel_err"] < 1e-2, r
    # Head size 16 (under an INT8 MMA's k): the same exact sums over codes in fp32 dots.
    assert r["d16_kv_scales_close"] and r["d16_codes_differ"] <= 2 and r["d16_attention_rel_err"] < 1e-4, r


def test_fp8_norm_output_and_fp8_kv_attention_match_their_references(results: dict[str, dict]) -> None:
    r = results["fp8"]
    assert "error" not in r, f"seed {r['seed']}: {r.get('error')}"
    assert r["norm_scale_exact"] and r["kv_scales_close"], f"seed {r['seed']}: {r}"
    assert r["attention_rel_err"] < 1e-4, f"seed {r['seed']}: {r}"


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        raise AssertionError(f"interpreter worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_attention_id)
def test_decode_attention_matches_reference(results: dict[str, dict], case: tuple) -> None:
    r = results[_attention_id(case)]
    assert "error" not in r, f"seed {r['seed']}: {r.get('error')}"
    assert r["max_err"] < 1e-5, f"seed {r['seed']}: max error {r['max_err']:.3g}"
    assert r["same_cache"], f"seed {r['seed']}: the kernel wrote the KV cache differently from the reference"
    assert r["batch_independent"], f"seed {r['seed']}: a row alone differs from the same row in the batch"


@pytest.mark.parametrize("residual", ["no-residual", "residual", "offset"])
def test_add_rms_norm_matches_reference(results: dict[str, dict], residual: str) -> None:
    r = results["add-rms-norm"]
    assert "error" not in r, f"seed {r['seed']}: {r.get('error')}"
    assert r[residual]["max_err"] < 1e-5 and r[residual]["same_h"], f"seed {r['seed']}: {r[residual]}"
    # The LoRA shrink in the same kernel: the norm's outputs unchanged, u = normed @ A^T, per row.
    assert r[residual]["no_u"] and r[residual]["same_with_shrink"], f"seed {r['seed']}: {r[residual]}"
    assert r[residual]["u_max_err"] < 1e-4 and r[residual]["u_batch_independent"], f"seed {r['seed']}: {r[residual]}"


def test_lora_shrink_matches_reference(results: dict[str, dict]) -> None:
    r = results["lora-shrink"]
    assert "error" not in r, f"seed {r['seed']}: {r.get('error')}"
    assert r["u_max_err"] < 1e-4 and r["u_batch_independent"], f"seed {r['seed']}: {r}"


@pytest.mark.parametrize("case", ROUTE_CASES, ids=_route_id)
def test_moe_route_and_combine_match_reference(results: dict[str, dict], case: tuple) -> None:
    r = results[_route_id(case)]
    assert "error" not in r, f"seed {r['seed']}: {r.get('error')}"
    assert r["same_ids"] and r["same_order"] and r["same_offsets"] and r["same_active"], f"seed {r['seed']}: {r}"
    assert r["weight_err"] < 1e-6 and r["combine_err"] < 1e-5, f"seed {r['seed']}: {r}"


@pytest.mark.parametrize("case", SAMPLE_CASES, ids=_sample_id)
def test_sample_step_matches_reference(results: dict[str, dict], case: tuple) -> None:
    r = results[_sample_id(case)]
    assert "error" not in r, f"seed {r['seed']}: {r.get('error')}"
    assert r["same_tokens"] and r["state"], f"seed {r['seed']}: {r}"
    assert r["logprob_err"] < 1e-5, f"seed {r['seed']}: {r}"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through the tests (sets TRITON_INTERPRET)"
    out: dict[str, dict] = {}
    for attention in ATTENTION_CASES:
        seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh data every run; printed on failure
        try:
            out[_attention_id(attention)] = {"seed": seed, **_run_attention_case(attention, seed)}
        except Exception as e:  # noqa: BLE001 - reported per case by the test
            out[_attention_id(attention)] = {"seed": seed, "error": repr(e)}
    seed = int(torch.randint(0, 2**31 - 1, ()))
    try:
        out["add-rms-norm"] = {"seed": seed, **_run_norm_case(seed)}
    except Exception as e:  # noqa: BLE001
        out["add-rms-norm"] = {"seed": seed, "error": repr(e)}
    seed = int(torch.randint(0, 2**31 - 1, ()))
    try:
        out["lora-shrink"] = {"seed": seed, **_run_shrink_case(seed)}
    except Exception as e:  # noqa: BLE001
        out["lora-shrink"] = {"seed": seed, "error": repr(e)}
    for sample_case in SAMPLE_CASES:
        seed = int(torch.randint(0, 2**31 - 1, ()))
        try:
            out[_sample_id(sample_case)] = {"seed": seed, **_run_sample_case(sample_case, seed)}
        except Exception as e:  # noqa: BLE001
            out[_sample_id(sample_case)] = {"seed": seed, "error": repr(e)}
    for route_case in ROUTE_CASES:
        seed = int(torch.randint(0, 2**31 - 1, ()))
        try:
            out[_route_id(route_case)] = {"seed": seed, **_run_route_case(route_case, seed)}
        except Exception as e:  # noqa: BLE001
            out[_route_id(route_case)] = {"seed": seed, "error": repr(e)}
    seed = int(torch.randint(0, 2**31 - 1, ()))
    try:
        out["fp8"] = {"seed": seed, **_run_fp8_case(seed)}
    except Exception as e:  # noqa: BLE001
        out["fp8"] = {"seed": seed, "error": repr(e)}
    try:
        out["int8kv"] = {"seed": seed, **_run_int8_kv_case(seed)}
    except Exception as e:  # noqa: BLE001
        out["int8kv"] = {"seed": seed, "error": repr(e)}
    try:
        out["fp8-gemm"] = {"seed": seed, **_run_fp8_gemm_case(seed)}
    except Exception as e:  # noqa: BLE001
        out["fp8-gemm"] = {"seed": seed, "error": repr(e)}
    print(json.dumps(out))
