"""FP8 rollouts on a GPU with FP8 tensor cores (`pytest -m gpu tests/kernels/test_fp8_gpu.py -s`).

The fused producers' E4M3 rows (the norm's, the row kernel's with and without the gate) against
`kernels.fp8.quantize_rows` on their own outputs, our FP8 GEMM against its fp32 reference, and the engine with `activations="fp8"`: CUDA graphs against
eager decoding, and greedy decoding against the bf16-activation engine on a stated share of tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import adapted_model
from qerl_pipe.engine import Engine, SamplingParams, plan_limits
from qerl_pipe.engine import fp8 as engine_fp8
from qerl_pipe.kernels.fp8 import FP8_MAX, fp8_linear, fp8_linear_reference, quantize_rows, quantize_weight, runs_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not runs_fp8(torch.device("cuda")),
                       reason="needs a CUDA GPU with FP8 tensor cores"),
]

PROMPTS = [[1, 45, 67, 89, 10], [1, 200, 13], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [1, 99, 98, 97, 250]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=16, seed=7)


def _codes_equal(a, b) -> bool:
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


@pytest.mark.parametrize("hidden", [64, 3584, 5120])
def test_norm_kernel_fp8_rows_are_quantize_rows_of_its_output(hidden):
    from qerl_pipe.kernels.decode_ops import add_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(hidden)
    x, r = (torch.randn(12, hidden, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    weight = torch.rand(hidden, generator=gen, device="cuda").to(torch.bfloat16)
    noise = torch.randn(hidden, generator=gen, device="cuda") * 1e-3
    x[5] = 0  # an idle slot's zero row: codes 0, no NaN
    normed, h, _, q = add_rms_norm(x, None, weight, noise, 1e-6, quantize=True)
    plain, _, _, none = add_rms_norm(x, None, weight, noise, 1e-6)
    assert none is None and torch.equal(normed, plain), "the FP8 output must leave the bf16 one as it was"
    want = quantize_rows(normed)
    assert torch.equal(q.scale, want.scale) and _codes_equal(q.codes, want.codes)
    assert float(q.codes[5].float().abs().max()) == 0 and bool(torch.isfinite(q.codes.float()).all())
    _, _, _, q_res = add_rms_norm(x, r, weight, noise, 1e-6, quantize=True)
    alone = add_rms_norm(x[3:4], r[3:4], weight, noise, 1e-6, quantize=True)[3]
    assert _codes_equal(alone.codes, q_res.codes[3:4]) and torch.equal(alone.scale, q_res.scale[3:4]), \
        "a row's codes must not depend on its batch"


@pytest.mark.parametrize(("m", "n", "k"), [(1, 4608, 3584), (64, 3584, 18944), (200, 512, 1024), (17, 256, 64)])
@pytest.mark.parametrize("split", [1, 4])
def test_triton_fp8_gemm_matches_its_reference_with_bias_and_lora(m, n, k, split):
    """Our Triton GEMM: the same products as the reference, + bias + u @ B^T before the one rounding,
    K split or not; a split-K launch gives the same bits every time (the tickets add in order)."""
    from qerl_pipe.kernels.triton_fp8 import fp8_gemm, gemm_config

    gen = torch.Generator(device="cuda").manual_seed(m + n + k + split)
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
    u = torch.randn(m, 48, generator=gen, device="cuda").to(torch.bfloat16)
    b = (torch.randn(n, 48, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    q, wq = quantize_rows(x), quantize_weight(w)
    config = {**gemm_config(m, n, k), "SPLIT_K": split}
    got = fp8_gemm(q, wq, bias, (u, b), config)
    ref = fp8_linear_reference(q, wq, torch.float32) + bias.float() + u.float() @ b.float().T
    # The same dequantized operands: the GEMM differs by its fp32 sums' order and the bf16 output.
    assert float((got.float() - ref).norm() / ref.norm()) < 4e-3
    plain = fp8_linear(q, wq)  # the engine's entry: bias and adapter left out
    assert float((plain.float() - fp8_linear_reference(q, wq, torch.float32)).norm()
                 / fp8_linear_reference(q, wq, torch.float32).norm()) < 4e-3
    exact = x.float() @ w.float().T  # and the E4M3 rounding of both operands, stated
    err = float((plain.float() - exact).norm() / exact.norm())
    print(f"FP8 GEMM [{m}, {k}] x [{n}, {k}]^T: {err:.4f} relative to the bf16 operands' fp32 product")
    assert err < 0.06 and float(q.codes.float().abs().max()) == FP8_MAX
    assert all(torch.equal(fp8_gemm(q, wq, bias, (u, b), config), got) for _ in range(3))


@pytest.mark.parametrize("m", [1, 64, 300])
@pytest.mark.parametrize("gate", [None, "silu", "gelu_pytorch_tanh"])
def test_row_kernel_codes_are_quantize_rows_of_its_values(m, gate):
    """o's and down's input rows: the row kernel's bf16 values are the model's gate (computed in fp32,
    rounded once, as the compiled gate does), and its codes and scales are `quantize_rows` of them."""
    from qerl_pipe.kernels.triton_fp8 import gated_rows as row_kernel
    from qerl_pipe.model.decoder import GATES

    gen = torch.Generator(device="cuda").manual_seed(m)
    width = 2 * 18944 if gate else 3584
    x = torch.randn(m, width, generator=gen, device="cuda").to(torch.bfloat16)
    x[0] = 0  # an idle slot's zero row: codes 0, no NaN
    values, q = row_kernel(x, gate)
    if gate is None:
        assert values is x
    else:
        want_values = GATES[gate](x)
        close = float((values == want_values).float().mean())
        assert close >= 0.999, f"only {close:.4f} of the gate's values equal the model's"
    want = quantize_rows(values)
    assert torch.equal(q.scale, want.scale) and _codes_equal(q.codes, want.codes)
    assert float(q.codes[0].float().abs().max()) == 0


def _model(path: Path, base: str):
    return adapted_model(path, base, torch.bfloat16, "cuda", rank=8)


@pytest.fixture
def every_row_fp8(monkeypatch):
    """Decode batches of a few rows run FP8 on an NVFP4 base too (by default from 17 rows)."""
    monkeypatch.setattr(engine_fp8, "NVFP4_MIN_ROWS", 1)


@pytest.mark.parametrize("base", ["bf16", "nvfp4"])
def test_fp8_graph_replay_equals_eager(tiny_qwen2, base, every_row_fp8):
    model = _model(tiny_qwen2, base)
    limits = plan_limits(model.config, max_seq_len=64, max_batch=8, cuda_graphs=True)
    graphed = Engine(model, limits, activations="fp8")
    eager = Engine(model, limits, cuda_graphs=False, activations="fp8")
    eager.runner.graphs.sizes = graphed.runner.graphs.sizes  # the same batch buckets: the same kernels
    assert graphed.activations == eager.activations == "fp8" and graphed.uses_cuda_graphs
    for params in (GREEDY, SAMPLED):
        g, e = graphed.generate(PROMPTS, n=2, sampling=params), eager.generate(PROMPTS, n=2, sampling=params)
        assert g.tokens == e.tokens
        for a, b in zip(g.logprobs, e.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("base", ["bf16", "nvfp4"])
def test_fp8_greedy_agrees_with_bf16_activations(tiny_qwen2, base, every_row_fp8):
    """Greedy decoding with FP8 activations against bf16 activations. A random tiny model's logits are
    near ties, so where the first difference falls is chance (measured 54/96 and 44/96 on an NVFP4
    base, 79/96 on bf16); the stated floor is a third of the tokens, and the first decode step's
    log-probs (FP8 in every projection from the same context) must agree within 0.1."""
    model = _model(tiny_qwen2, base)
    limits = plan_limits(model.config, max_seq_len=64, max_batch=8, cuda_graphs=True)
    ref = Engine(model, limits).generate(PROMPTS, n=1, sampling=GREEDY)
    got = Engine(model, limits, activations="fp8").generate(PROMPTS, n=1, sampling=GREEDY)
    # Position by position up to each sequence's first difference (after it the contexts differ).
    agreed = total = 0
    for a, b in zip(ref.tokens, got.tokens):
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agreed, total = agreed + prefix, total + len(a)
    first = [abs(a[0] - b[0]) for a, b in zip(ref.logprobs, got.logprobs)]
    second = [abs(a[1] - b[1]) for a, b, x, y in zip(ref.logprobs, got.logprobs, ref.tokens, got.tokens)
              if x[:2] == y[:2]]
    print(f"{base}: greedy tokens equal before the first difference: {agreed}/{total}; first-token logprob "
          f"difference max {max(first):.4f}; first decode step's {max(second):.4f} over {len(second)} sequences")
    assert agreed / total >= 1 / 3 and max(first) < 0.1
    assert len(second) >= len(PROMPTS) // 2 and max(second) < 0.1


@pytest.mark.parametrize("codes", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize(("d", "window", "softcap", "tiles"),
                         [(128, 0, 0.0, {}), (64, 40, 0.0, {}), (256, 0, 30.0, {}), (128, 40, 0.0, dict(split=128, block=64)),
                          (256, 0, 30.0, dict(split=1024, block=128)), (64, 40, 0.0, dict(split=256, block=32))])
def test_coded_kv_attention_kernel_matches_its_reference(d, window, softcap, tiles, codes):
    from qerl_pipe.kernels.decode_ops import decode_attention_reference
    from qerl_pipe.kernels.fp8 import row_codes
    from qerl_pipe.kernels.triton_decode import launch_decode_attention

    gen = torch.Generator(device="cuda").manual_seed(d + window)
    b, hq, hkv, length = 3, 8, 2, 300
    q, k, v = (torch.randn(b, h, d, generator=gen, device="cuda").to(torch.bfloat16) for h in (hq, hkv, hkv))
    angle = torch.rand(b, d // 2, generator=gen, device="cuda")
    cos = torch.cat([angle.cos()] * 2, -1).to(torch.bfloat16)
    sin = torch.cat([angle.sin()] * 2, -1).to(torch.bfloat16)
    positions = torch.tensor([0, 130, 299], device="cuda")
    k8, ks = row_codes(torch.randn(b, hkv, length, d, generator=gen, device="cuda"), codes)
    v8, vs = row_codes(torch.randn(b, hkv, length, d, generator=gen, device="cuda"), codes)
    caches = [(k8.clone(), v8.clone(), ks[..., 0].clone(), vs[..., 0].clone()) for _ in range(2)]
    got = launch_decode_attention(q, k, v, cos, sin, caches[0][0], caches[0][1], positions, d ** -0.5, window,
                                  softcap, caches[0][2], caches[0][3], **tiles)
    ref = decode_attention_reference(q, k, v, cos, sin, caches[1][0], caches[1][1], positions, d ** -0.5, window,
                                     softcap, caches[1][2], caches[1][3])
    # The same dequantized keys and values (rounded to bf16 for the kernel's dot products).
    err = float((got.float() - ref.float()).norm() / ref.float().norm())
    print(f"coded attention {codes} d{d} {tiles}: relative error {err:.2e}")
    assert err < 1e-2, f"relative error {err:.2e}"
    for mine, theirs in zip(caches[0], caches[1]):
        if mine.dtype == torch.float32:
            torch.testing.assert_close(mine, theirs, atol=0, rtol=1e-6)
        else:
            same = float((mine.view(torch.uint8) == theirs.view(torch.uint8)).float().mean())
            assert same >= 0.9999, f"the kernel wrote {1 - same:.2e} of the codes differently"


@pytest.mark.parametrize(("base", "kv"), [("bf16", "fp8"), ("nvfp4", "fp8"), ("nvfp4", "int8")])
def test_coded_kv_cache_engine_graphs_and_greedy(tiny_qwen2, base, kv):
    model = _model(tiny_qwen2, base)
    limits = plan_limits(model.config, max_seq_len=64, max_batch=8, cuda_graphs=True, kv_cache=kv)
    graphed = Engine(model, limits)
    eager = Engine(model, limits, cuda_graphs=False)
    eager.runner.graphs.sizes = graphed.runner.graphs.sizes
    assert graphed.uses_cuda_graphs and graphed.runner.cache.k.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv]
    g, e = graphed.generate(PROMPTS, n=2, sampling=SAMPLED), eager.generate(PROMPTS, n=2, sampling=SAMPLED)
    assert g.tokens == e.tokens
    ref = Engine(model, plan_limits(model.config, max_seq_len=64, max_batch=8, cuda_graphs=True)).generate(
        PROMPTS, n=1, sampling=GREEDY)
    got = graphed.generate(PROMPTS, n=1, sampling=GREEDY)
    agreed = total = 0
    for a, b in zip(ref.tokens, got.tokens):
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agreed, total = agreed + prefix, total + len(a)
    # The first token comes from the prefill (bf16 K and V); the second is the first decode step
    # over the coded cache, from the same context wherever the first tokens agree.
    second = [abs(a[1] - b[1]) for a, b, x, y in zip(ref.logprobs, got.logprobs, ref.tokens, got.tokens)
              if x[0] == y[0] and x[1] == y[1]]
    print(f"{base}, {kv} KV cache: greedy tokens equal before the first difference: {agreed}/{total} "
          f"(a random tiny model's logits are near ties); first decode step's logprob difference max "
          f"{max(second):.4f} over {len(second)} sequences")
    assert len(second) >= len(PROMPTS) // 2 and max(second) < 0.1
