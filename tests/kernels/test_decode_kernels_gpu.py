"""The decode step's Triton kernels on a CUDA GPU in bf16 and fp32 (the interpreter tests cover fp32
on CPU only): against the torch references, bit-identical rows whatever the batch, and CUDA-graph
replay equal to eager. Run: `pytest -m gpu tests/kernels/test_decode_kernels_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from qerl_pipe.kernels import decode_ops, triton_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (q heads, kv heads, head_dim): Qwen2.5-7B, Qwen2.5-32B, SmolLM2-135M, a tiny test model.
HEADS = [(28, 4, 128), (40, 8, 128), (9, 3, 64), (4, 2, 16)]


def _inputs(b: int, hq: int, hkv: int, d: int, length: int, dtype: torch.dtype, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=gen, device="cuda").to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    cache_shape = (2, b + 3, hkv, length + 64, d)  # [layers, slots, heads, max_len, d]: a strided view
    positions = torch.randint(0, length, (b,), generator=gen, device="cuda")
    positions[0] = length - 1
    angles = positions[:, None].float() * torch.rand(d // 2, generator=gen, device="cuda")
    return dict(q=q.view(b, hq, d), k=k.view(b, hkv, d), v=v.view(b, hkv, d),
                cos=torch.cat([angles.cos()] * 2, -1).to(dtype), sin=torch.cat([angles.sin()] * 2, -1).to(dtype),
                k_full=torch.randn(cache_shape, generator=gen, device="cuda").to(dtype),
                v_full=torch.randn(cache_shape, generator=gen, device="cuda").to(dtype), positions=positions)


def _attend(fn, x: dict, rows: slice, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k_full, v_full = x["k_full"].clone(), x["v_full"].clone()
    d = x["q"].shape[-1]
    out = fn(x["q"][rows], x["k"][rows], x["v"][rows], x["cos"][rows], x["sin"][rows],
             k_full[1, rows, :, :length], v_full[1, rows, :, :length], x["positions"][rows], d ** -0.5)
    return out, k_full, v_full


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}-hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("b,length", [(1, 1280), (8, 300), (64, 256)])
def test_decode_attention_matches_reference_and_is_batch_independent(heads, dtype, b, length):
    hq, hkv, d = heads
    x = _inputs(b, hq, hkv, d, length, dtype, seed=b * 1000 + hq)
    ref, ref_k, ref_v = _attend(decode_ops.decode_attention_reference, x, slice(0, b), length)
    out, got_k, got_v = _attend(triton_decode.launch_decode_attention, x, slice(0, b), length)
    assert bool(torch.isfinite(out).all())
    # bf16: the kernel multiplies P by V in bf16 (as flash attention does); the reference in fp32.
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, ref, **tol)
    # The new k (rotated) and v land at the positions, nothing else moves; k within one rounding.
    torch.testing.assert_close(got_k, ref_k, atol=1e-6, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6)
    assert torch.equal(got_v, ref_v)
    changed = (got_k != x["k_full"]).any(-1)  # [layers, slots, heads, positions]
    expect = torch.zeros_like(changed)
    expect[1, torch.arange(b), :, x["positions"]] = True
    assert not bool((changed & ~expect).any()), "the kernel wrote outside the new tokens' positions"
    # A row alone, and the batch in a longer attention window, give the same bits.
    last = slice(b - 1, b)
    alone, _, _ = _attend(triton_decode.launch_decode_attention, x, last, length)
    assert torch.equal(alone, out[last])
    longer, _, _ = _attend(triton_decode.launch_decode_attention, x, slice(0, b), length + 64)
    assert torch.equal(longer, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window, cap, rot", [(4096, 0.0, 256), (512, 50.0, 256), (100, 0.0, 64), (0, 0.0, 96)],
                         ids=["gemma-local", "gemma2-capped", "window-100-partial", "phi4-partial"])
def test_decode_attention_families(dtype, window, cap, rot):
    """Gemma's head_dim 256 with a window over splits and its cap, a window inside one split with
    partial rotary, Phi-4-mini's rotary 96 of 128: against the reference, batch-independent."""
    b, length = 8, 1280
    d = 256 if rot == 256 else 128
    x = _inputs(b, 8, 4, d, length, dtype, seed=rot + window)
    x["cos"], x["sin"] = x["cos"][:, :rot // 2].repeat(1, 2), x["sin"][:, :rot // 2].repeat(1, 2)
    scale = d ** -0.5 * (8.0 if cap else 1.0)  # scores large enough for the cap to bend

    def run(fn, rows: slice) -> torch.Tensor:
        k_full, v_full = x["k_full"].clone(), x["v_full"].clone()
        return fn(x["q"][rows], x["k"][rows], x["v"][rows], x["cos"][rows], x["sin"][rows],
                  k_full[1, rows, :, :length], v_full[1, rows, :, :length], x["positions"][rows], scale, window, cap)

    ref = run(decode_ops.decode_attention_reference, slice(0, b))
    out = run(triton_decode.launch_decode_attention, slice(0, b))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, ref, **tol)
    assert torch.equal(run(triton_decode.launch_decode_attention, slice(b - 1, b)), out[b - 1:])


def test_decode_attention_replays_in_a_cuda_graph():
    x = _inputs(8, 28, 4, 128, 512, torch.bfloat16, seed=3)
    eager, _, _ = _attend(triton_decode.launch_decode_attention, x, slice(0, 8), 512)
    k_full, v_full = x["k_full"].clone(), x["v_full"].clone()
    args = (x["q"], x["k"], x["v"], x["cos"], x["sin"], k_full[1, :8, :, :512], v_full[1, :8, :, :512],
            x["positions"], 128 ** -0.5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_decode.launch_decode_attention(*args)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_decode.launch_decode_attention(*args)
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hidden", [64, 576, 3584, 5120, 8192])
def test_add_rms_norm_matches_reference(dtype, hidden):
    gen = torch.Generator(device="cuda").manual_seed(hidden)
    x, r = (torch.randn(8, hidden, generator=gen, device="cuda").to(dtype) for _ in range(2))
    weight = torch.rand(hidden, generator=gen, device="cuda").to(dtype)
    noise = torch.randn(hidden, generator=gen, device="cuda") * 1e-3
    shrink = (torch.randn(96, hidden, generator=gen, device="cuda") * hidden ** -0.5).to(dtype)
    for residual in (None, r):
        ref, ref_h = decode_ops.add_rms_norm_reference(x, residual, weight, noise, 1e-6)
        got, got_h, _, _ = triton_decode.launch_add_rms_norm(x, residual, weight, noise, 1e-6)
        assert torch.equal(got_h, ref_h)  # the residual add rounds once, as torch's does
        # One bf16 step at most (the mean's sum runs in another order).
        torch.testing.assert_close(got, ref, atol=0, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5)
        # With the LoRA shrink fused: the same normed bits, and u = normed @ A^T (fp32 sums of the
        # rounded normed values, one rounding) next to the matmul on the kernel's own output.
        fused, fused_h, u, _ = triton_decode.launch_add_rms_norm(x, residual, weight, noise, 1e-6, shrink)
        assert torch.equal(fused, got) and torch.equal(fused_h, got_h)
        exact = (got.double() @ shrink.double().t())
        tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
        assert float((u.double() - exact).abs().max()) <= tol * float(exact.abs().max()) + 1e-6
        # Row-wise: a row alone gives the same bits.
        alone, _, alone_u, _ = triton_decode.launch_add_rms_norm(
            x[3:4], None if residual is None else residual[3:4], weight, noise, 1e-6, shrink)
        assert torch.equal(alone, got[3:4]) and torch.equal(alone_u, u[3:4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("hidden", "rows"), [(64, 8), (3584, 1), (3584, 16), (5120, 8)])
def test_lora_shrink_matches_reference(dtype, hidden, rows):
    from qerl_pipe.kernels import decode_ops

    gen = torch.Generator(device="cuda").manual_seed(hidden + rows)
    x = torch.randn(rows, 2 * hidden, generator=gen, device="cuda").to(dtype)[:, :hidden]  # strided rows
    shrink = (torch.randn(32, hidden, generator=gen, device="cuda") * hidden ** -0.5).to(dtype)
    u = decode_ops.lora_shrink(x, shrink)
    exact = x.double() @ shrink.double().t()
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert float((u.double() - exact).abs().max()) <= tol * float(exact.abs().max()) + 1e-6
    assert torch.equal(decode_ops.lora_shrink(x, shrink), u), "the partials must add in one fixed order"
    assert torch.equal(decode_ops.lora_shrink(x[rows - 1:], shrink), u[rows - 1:]), "a row alone must give its bits"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode_ops.lora_shrink(x, shrink)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, u), "a graph replay must give the eager result (the ticket re-arms)"
    # Past the decode batches the shrink is left to the caller.
    assert decode_ops.lora_shrink(x.repeat(17, 1), shrink) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("vocab", [152064, 49152, 1000])
@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_sample_step_matches_reference(dtype, vocab, rows, temperature):
    """The two sampling kernels draw the reference sampler's tokens exactly (the same noise bits:
    libdevice's logf is torch's), its logprobs to float32 rounding, and update the slot state."""
    from qerl_pipe.engine.sampling import SamplingParams, sample
    from qerl_pipe.kernels.triton_sample import launch_sample_step

    gen = torch.Generator(device="cuda").manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=gen, device="cuda") * 4).to(dtype)
    keys = torch.randint(0, 2**32, (rows,), generator=gen, device="cuda")
    steps = torch.randint(0, 4096, (rows,), generator=gen, device="cuda")
    positions = torch.randint(0, 4096, (rows,), generator=gen, device="cuda")
    live = torch.randint(0, 2, (rows,), generator=gen, device="cuda")
    tokens, logprobs = sample(logits, keys, steps, torch.arange(vocab, device="cuda"),
                              SamplingParams(temperature=temperature))
    results = []
    for _ in range(2):  # twice from the same state: the same bits
        state = [t.clone() for t in (steps, positions)]
        next_tokens = torch.full((rows,), -1, device="cuda")
        record = torch.full((2, rows), float("nan"), dtype=torch.float64, device="cuda")
        launch_sample_step(logits, keys, state[0], state[1], live, next_tokens, record, temperature)
        assert torch.equal(next_tokens, tokens) and torch.equal(record[0].long(), tokens)
        torch.testing.assert_close(record[1], logprobs.double(), atol=2e-5, rtol=0)
        assert torch.equal(state[0], steps + 1) and torch.equal(state[1], positions + live)
        results.append(record)
    assert torch.equal(results[0], results[1])
