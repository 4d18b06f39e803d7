"""The rollout engine on a CUDA GPU (run on the H200: `pytest -m gpu tests/engine/test_engine_gpu.py -s`).

CUDA-graph replay against eager decoding on the same batch buckets (same kernels, so the same
numbers), against transformers' greedy generate in fp32, the graph schedule (refill, compaction,
several captured sizes), and in-place vs rebound LoRA/AQN tensors under captured graphs.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model, randomize_lora_b
from qerl_pipe.engine import Engine, SamplingParams, plan_limits
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.load import load_model
from qerl_pipe.model.lora import LoraSpec
from qerl_pipe.model.norm import RMSNorm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [[1, 45, 67, 89, 10], [1, 200, 13], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [1, 99, 98, 97, 250, 3, 4]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=16)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=16, seed=7)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-gpu"), "qwen3", head_dim=32)


def _engine(model: Decoder, max_batch: int, graphs: bool, buckets_of: Engine | None = None) -> Engine:
    limits = plan_limits(model.config, max_seq_len=64, max_batch=max_batch, cuda_graphs=True)
    engine = Engine(model, limits, cuda_graphs=graphs)
    if buckets_of is not None:  # eager on the graphs' batch sizes: the same kernels run
        engine.runner.graphs.sizes = buckets_of.runner.graphs.sizes
    return engine


def _with_adapter(path: Path, base: str, dtype: torch.dtype) -> Decoder:
    model = load_model(path, base, dtype=dtype, device="cuda", lora=LoraSpec(rank=4, alpha=8))
    randomize_lora_b(model, 0.3)
    return model


def _assert_same(a, b, atol: float) -> None:
    assert a.tokens == b.tokens and a.finish_reasons == b.finish_reasons
    for x, y in zip(a.logprobs, b.logprobs):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("base", ["bf16", "nvfp4"])
def test_graph_replay_equals_eager(tiny_llama, base, dtype):
    if base == "nvfp4" and dtype == torch.float32:
        pytest.skip("the NVFP4 kernels take bf16 activations")
    model = _with_adapter(tiny_llama, base, dtype)
    graphed = _engine(model, 8, graphs=True)
    eager = _engine(model, 8, graphs=False, buckets_of=graphed)
    assert graphed.uses_cuda_graphs and not eager.uses_cuda_graphs
    for params in (GREEDY, SAMPLED):
        g = graphed.generate(PROMPTS, n=3, sampling=params)
        e = eager.generate(PROMPTS, n=3, sampling=params)
        _assert_same(g, e, atol=1e-5)
    assert len(graphed.captured_graph_sizes) >= 1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graph_greedy_equals_transformers_fp32(tiny_llama, tiny_qwen3, arch):
    from transformers import AutoModelForCausalLM

    path = {"llama": tiny_llama, "qwen3": tiny_qwen3}[arch]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    hf.generation_config.eos_token_id = None
    ref = []
    for p in PROMPTS:
        ids = torch.tensor([p], device="cuda")
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=GREEDY.max_new_tokens, pad_token_id=0)
        ref.append(seq[0, len(p):].tolist())
    model = load_model(path, "bf16", dtype=torch.float32, device="cuda")
    out = _engine(model, 4, graphs=True).generate(PROMPTS, n=2, sampling=GREEDY)
    assert out.tokens == [ref[i] for i in out.prompt_index]


def test_graph_schedule_refills_compacts_and_matches_one_at_a_time(tiny_llama):
    model = load_model(tiny_llama, "bf16", dtype=torch.float32, device="cuda")
    params = SamplingParams(max_new_tokens=20, seed=4, stop_token_ids=tuple(range(0, 320, 9)))
    prompts = PROMPTS * 3
    engine = _engine(model, 8, graphs=True)
    engine.runner.graphs.lengths = (16, 32, 64)  # several attention lengths too
    out = engine.generate(prompts, n=2, sampling=params)
    single = _engine(model, 1, graphs=False).generate(prompts, n=2, sampling=params)
    assert out.tokens == single.tokens and out.finish_reasons == single.finish_reasons
    assert out.compactions > 0 and out.max_active == 8
    assert len(engine.captured_graph_sizes) >= 2, engine.captured_graph_sizes
    assert len({length for _, length in engine.runner.graphs._graphs}) >= 2
    print(f"captured (batch, length) {sorted(engine.runner.graphs._graphs)}, {out.decode_steps} steps, "
          f"{out.compactions} compactions")


def test_in_place_and_rebound_tensors_under_graphs(tiny_llama):
    model = _with_adapter(tiny_llama, "bf16", torch.float32)
    graphed = _engine(model, 4, graphs=True)
    eager = _engine(model, 4, graphs=False, buckets_of=graphed)
    before = graphed.generate(PROMPTS, sampling=GREEDY)
    # In place, as an optimizer step and an AQN draw do: the captured graphs see the new values.
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=gen, device="cuda") * 0.3)
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.noise.copy_(torch.randn(m.noise.shape, generator=gen, device="cuda") * 0.2)
    captured = dict(graphed.runner.graphs._graphs)
    after = graphed.generate(PROMPTS, sampling=GREEDY)
    assert after.tokens != before.tokens
    _assert_same(after, eager.generate(PROMPTS, sampling=GREEDY), atol=1e-5)
    assert captured and all(graphed.runner.graphs._graphs.get(b) is g for b, g in captured.items())  # not recaptured
    # Rebinding a buffer (new address) is noticed: the graphs are recaptured, results still right.
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.noise = torch.randn(m.noise.shape, generator=gen, device="cuda") * 0.2
    rebound = graphed.generate(PROMPTS, sampling=GREEDY)
    _assert_same(rebound, eager.generate(PROMPTS, sampling=GREEDY), atol=1e-5)
    assert all(graphed.runner.graphs._graphs.get(b) is not g for b, g in captured.items())  # recaptured
    graphed.reset_graphs()
    assert graphed.captured_graph_sizes == ()
    _assert_same(graphed.generate(PROMPTS, sampling=GREEDY), rebound, atol=1e-5)
    # Everything captured up front (idle slots: harmless warm-up writes), then the same results.
    graphed.reset_graphs()
    assert graphed.capture_graphs() == len(graphed.runner.graphs.sizes) * len(graphed.runner.graphs.lengths)
    _assert_same(graphed.generate(PROMPTS, sampling=GREEDY), rebound, atol=1e-5)


def test_env_var_disables_graphs(tiny_llama, monkeypatch):
    model = load_model(tiny_llama, "bf16", dtype=torch.float32, device="cuda")
    monkeypatch.setenv("QERL_ENGINE_CUDA_GRAPHS", "0")
    engine = _engine_default(model)
    assert not engine.uses_cuda_graphs
    monkeypatch.setenv("QERL_ENGINE_CUDA_GRAPHS", "1")
    assert _engine_default(model).uses_cuda_graphs


def _engine_default(model: Decoder) -> Engine:
    return Engine(model, plan_limits(model.config, max_seq_len=64, max_batch=4, cuda_graphs=True))


def test_cuda_graphs_and_eager_decode_the_same_prompts(tiny_llama):
    """Graphs and eager decoding run the same prompts to the same length at batch 1 and 8 (the step
    times print with -s; speed is a benchmark's, `bench decode-profile`, not a test's)."""
    model = load_model(tiny_llama, "bf16", dtype=torch.bfloat16, device="cuda")
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=1)
    for batch in (1, 8):
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        times = {}
        for graphs in (True, False):
            engine = _engine(model, batch, graphs=graphs)
            engine.generate(prompts, sampling=params)  # capture, warm up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = engine.generate(prompts, sampling=params)
            times[graphs] = (time.perf_counter() - t0, out.decode_seconds / out.decode_steps)
        print(f"batch {batch}: graphs {1e3 * times[True][1]:.2f} ms/step, eager {1e3 * times[False][1]:.2f} ms/step")
        assert out.generated_tokens == 40 * batch
