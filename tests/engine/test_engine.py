"""The rollout engine on CPU: Hugging Face greedy parity, logprobs vs the training forward,
reproducibility, stop tokens, sampling statistics, LoRA/AQN, scheduling, input errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model
from qerl_pipe.engine import (
    Engine,
    EngineLimits,
    PromptError,
    Rollouts,
    SamplingParams,
    SamplingParamsError,
    plan_limits,
)
from qerl_pipe.engine.decode_step import decode_step
from qerl_pipe.engine.sampling import gumbel_noise, hash32, sample, sequence_key, truncate_logits
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.load import load_model
from qerl_pipe.model.lora import LoraSpec, lora_disabled
from qerl_pipe.model.norm import RMSNorm

# Prompts of different lengths (ids below the tiny vocab of 320).
PROMPTS = [[1, 45, 67, 89, 10], [1, 200, 13], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [1, 99, 98, 97, 250, 3, 4]]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", head_dim=32)


@pytest.fixture(scope="module")
def models(tiny_llama, tiny_qwen2, tiny_qwen3) -> dict[str, Path]:
    return {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}


@pytest.fixture(scope="module")
def llama32(tiny_llama) -> Decoder:
    return load_model(tiny_llama, "bf16", dtype=torch.float32)


def _engine(model: Decoder, max_batch: int, max_seq_len: int = 64, **kw) -> Engine:
    return Engine(model, plan_limits(model.config, max_seq_len=max_seq_len, max_batch=max_batch), **kw)


def _hf_greedy(path: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run to max_new_tokens, as the engine without stops
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            seq = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                              pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


def _forward_logprobs(model: Decoder, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """What a trainer computes: log_softmax(logits / T) of the response under the full forward."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model.logits(ids)[0, len(prompt) - 1 : -1].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def _reference_greedy(model: Decoder, prompt: list[int], new: int) -> list[int]:
    """Greedy decoding by the training forward over the whole sequence at every step."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            seq.append(int(model.logits(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_transformers_generate(models, arch):
    path = models[arch]
    model = load_model(path, "bf16", dtype=torch.float32)
    new, n = 12, 3
    # 4 prompts x 3 samples on 5 slots: waves, refills, split groups and compaction all happen.
    out = _engine(model, max_batch=5).generate(PROMPTS, n=n, sampling=SamplingParams(temperature=0, max_new_tokens=new))
    ref = _hf_greedy(path, PROMPTS, new)
    assert out.prompt_index == [p for p in range(len(PROMPTS)) for _ in range(n)]
    assert out.sample_index == list(range(n)) * len(PROMPTS)
    for i, tokens in enumerate(out.tokens):
        assert tokens == ref[out.prompt_index[i]], f"sequence {i}"
    assert out.finish_reasons == ["length"] * len(out)
    assert out.lengths == [new] * len(out)
    assert out.generated_tokens == new * len(out) and out.decode_steps > 0 and out.prefills >= len(PROMPTS)
    assert out.max_active == 5


def test_logprobs_equal_training_forward(llama32):
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=10, seed=11)
    out = _engine(llama32, max_batch=4).generate(PROMPTS[:3], n=3, sampling=params)
    for i, (tokens, lps) in enumerate(zip(out.tokens, out.logprobs)):
        ref = _forward_logprobs(llama32, PROMPTS[out.prompt_index[i]], tokens, 0.7)
        torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-4, rtol=0)
    # Greedy reports the T = 1 logprob.
    greedy = _engine(llama32, max_batch=4).generate(PROMPTS[:2], sampling=SamplingParams(temperature=0, max_new_tokens=6))
    for i, tokens in enumerate(greedy.tokens):
        ref = _forward_logprobs(llama32, PROMPTS[i], tokens, 1.0)
        torch.testing.assert_close(torch.tensor(greedy.logprobs[i]), ref, atol=1e-4, rtol=0)


def test_seed_reproduces_and_does_not_depend_on_batch(llama32):
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)
    a = _engine(llama32, max_batch=3).generate(PROMPTS, n=2, sampling=params)
    again = _engine(llama32, max_batch=3).generate(PROMPTS, n=2, sampling=params)
    wide = _engine(llama32, max_batch=8).generate(PROMPTS, n=2, sampling=params)
    single = _engine(llama32, max_batch=1).generate(PROMPTS, n=2, sampling=params)
    assert a.tokens == again.tokens and a.logprobs == again.logprobs
    assert a.tokens == wide.tokens == single.tokens
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(wide.logprobs), atol=1e-5, rtol=0)
    # Samples of one prompt differ (own streams), and another seed gives other tokens.
    assert len({tuple(t) for t in a.tokens}) == len(a)
    other = _engine(llama32, max_batch=3).generate(PROMPTS, n=2, sampling=SamplingParams(max_new_tokens=10, seed=6))
    assert sum(x != y for x, y in zip(a.tokens, other.tokens)) >= len(a) - 1


def test_stop_tokens_end_sequences(llama32):
    engine = _engine(llama32, max_batch=4)
    greedy = engine.generate(PROMPTS, sampling=SamplingParams(temperature=0, max_new_tokens=12))
    # A token that greedy produces mid-way through prompt 0's continuation becomes the stop token.
    stop = greedy.tokens[0][4]
    cut = greedy.tokens[0].index(stop) + 1
    out = engine.generate(PROMPTS, sampling=SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,)))
    assert out.tokens[0] == greedy.tokens[0][:cut] and out.finish_reasons[0] == "stop"
    assert out.logprobs[0] == pytest.approx(greedy.logprobs[0][:cut], abs=1e-6)
    for toks, full, reason in zip(out.tokens[1:], greedy.tokens[1:], out.finish_reasons[1:]):
        if stop in full:
            assert toks == full[: full.index(stop) + 1] and reason == "stop"
        else:
            assert toks == full and reason == "length"
    # A stop token drawn as the very first token (sampled from the prefill logits) ends it there.
    first = greedy.tokens[1][0]
    one = engine.generate([PROMPTS[1]], n=2, sampling=SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(first,)))
    assert one.tokens == [[first], [first]] and one.finish_reasons == ["stop", "stop"]


def test_top_k_1_and_tiny_top_p_equal_greedy(llama32):
    engine = _engine(llama32, max_batch=4)
    greedy = engine.generate(PROMPTS, n=2, sampling=SamplingParams(temperature=0, max_new_tokens=8))
    top_k = engine.generate(PROMPTS, n=2, sampling=SamplingParams(temperature=0.8, top_k=1, max_new_tokens=8, seed=1))
    top_p = engine.generate(PROMPTS, n=2, sampling=SamplingParams(temperature=1.3, top_p=1e-6, max_new_tokens=8))
    assert top_k.tokens == greedy.tokens and top_p.tokens == greedy.tokens
    # Truncation does not change the logprob definition: T = 0.8 logprobs of the greedy tokens.
    for i, tokens in enumerate(top_k.tokens):
        ref = _forward_logprobs(llama32, PROMPTS[top_k.prompt_index[i]], tokens, 0.8)
        torch.testing.assert_close(torch.tensor(top_k.logprobs[i]), ref, atol=1e-4, rtol=0)


def _draws(logits: torch.Tensor, params: SamplingParams, sequences: int = 4000, steps: int = 25) -> torch.Tensor:
    vocab = torch.arange(logits.shape[-1])
    keys = torch.tensor([sequence_key(params.seed, i) for i in range(sequences)])
    rows = logits.expand(sequences, -1)
    counts = torch.zeros(logits.shape[-1])
    for step in range(steps):
        tokens, _ = sample(rows, keys, torch.full((sequences,), step), vocab, params)
        counts += torch.bincount(tokens, minlength=logits.shape[-1])
    return counts


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a truncated token was drawn"
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    ("params", "probs"),
    [
        (SamplingParams(seed=0), torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])),
        (SamplingParams(temperature=0.5, seed=1), None),
        (SamplingParams(top_k=3, seed=2), torch.tensor([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8),
        (SamplingParams(top_p=0.7, seed=3), torch.tensor([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8),
    ],
    ids=["plain", "temperature", "top_k", "top_p"],
)
def test_gumbel_sampler_matches_softmax(params, probs):
    base = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    logits = base.log()[None]
    if probs is None:
        probs = (logits[0] / params.temperature).softmax(-1)
    counts = _draws(logits, params)  # 100k draws over (sequence, step) counters
    # Chi-square with <= 5 degrees of freedom: 20.5 is the 0.999 quantile of 5 dof. The draws
    # are a fixed function of the seed, so this is deterministic, not flaky.
    assert _chi_square(counts, probs) < 20.5


def test_counter_noise_properties():
    keys = torch.tensor([sequence_key(9, i) for i in range(4)])
    steps = torch.tensor([0, 1, 2, 3])
    vocab = torch.arange(1000)
    g = gumbel_noise(keys, steps, vocab)
    assert torch.isfinite(g).all()
    # Row by row the same numbers, whatever the batch around it.
    torch.testing.assert_close(gumbel_noise(keys[2:3], steps[2:3], vocab), g[2:3], atol=0, rtol=0)
    # Python ints and tensors hash alike (keys are made on the host, noise on the device).
    xs = torch.randint(0, 2**32, (100,), generator=torch.Generator().manual_seed(0))
    assert hash32(xs).tolist() == [hash32(int(x)) for x in xs]
    # Gumbel(0, 1): mean = Euler-Mascheroni constant, variance = pi^2 / 6.
    assert abs(float(g.mean()) - 0.5772) < 0.05 and abs(float(g.var()) - 1.6449) < 0.15


def test_truncate_logits():
    z = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    inf = float("-inf")
    assert truncate_logits(z, 2, 1.0).tolist() == [[3.0, inf, 2.0, inf], [inf, inf, 5.0, 1.0]]
    # softmax row 0: 0.644, 0.087, 0.237, 0.032 -> 0.8 needs the two largest.
    assert truncate_logits(z, 0, 0.8)[0].tolist() == [3.0, inf, 2.0, inf]
    assert truncate_logits(z, 1, 0.99)[0].tolist() == [3.0, inf, inf, inf]


def test_lora_and_aqn_noise_reach_the_rollouts(tiny_llama):
    model = load_model(tiny_llama, "bf16", dtype=torch.float32, lora=LoraSpec(rank=4, alpha=8))
    engine = _engine(model, max_batch=3)
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    plain = engine.generate(PROMPTS, sampling=greedy)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # in place, as an optimizer step would
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    adapted = engine.generate(PROMPTS, sampling=greedy)
    assert adapted.tokens != plain.tokens
    # The engine decoded through its fused copy of the adapter, refreshed from B.
    assert engine.runner.lora.addresses()
    for i, prompt in enumerate(PROMPTS):
        assert adapted.tokens[i] == _reference_greedy(model, prompt, 8)
    with lora_disabled(model):
        assert engine.generate(PROMPTS, sampling=greedy).tokens == plain.tokens
    # AQN: noise in the RMSNorm buffers changes the policy the same way for both paths.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.noise.copy_(torch.randn(m.noise.shape, generator=gen) * 0.3)
    noisy = engine.generate(PROMPTS, sampling=SamplingParams(temperature=0.9, max_new_tokens=8, seed=2))
    for i, prompt in enumerate(PROMPTS):
        ref = _forward_logprobs(model, prompt, noisy.tokens[i], 0.9)
        torch.testing.assert_close(torch.tensor(noisy.logprobs[i]), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("base_format", ["nvfp4", "nf4"])
def test_quantized_base_equals_its_forward(tiny_qwen2, base_format):
    model = load_model(tiny_qwen2, base_format, dtype=torch.float32)
    out = _engine(model, max_batch=3).generate(PROMPTS, sampling=SamplingParams(temperature=0, max_new_tokens=6))
    for i, prompt in enumerate(PROMPTS):
        assert out.tokens[i] == _reference_greedy(model, prompt, 6)


def test_bucketed_schedule_refills_and_compacts(llama32):
    """The CUDA-graph schedule (power-of-two buckets, padded rows, compaction) run eagerly on CPU."""
    prompts = PROMPTS * 3
    params = SamplingParams(max_new_tokens=14, seed=4, stop_token_ids=tuple(range(0, 320, 9)))
    reference = _engine(llama32, max_batch=1).generate(prompts, n=2, sampling=params)
    engine = _engine(llama32, max_batch=8)
    engine.runner.graphs.sizes = (1, 2, 4, 8)  # buckets as the graphs would use, decode still eager
    engine.runner.graphs.lengths = (16, 32, 64)  # attention over a prefix of the cache rows
    out = engine.generate(prompts, n=2, sampling=params)
    assert out.tokens == reference.tokens and out.finish_reasons == reference.finish_reasons
    assert "stop" in out.finish_reasons and "length" in out.finish_reasons
    assert out.compactions > 0 and out.max_active == 8
    assert out.decode_rows >= out.generated_tokens - len(out)  # padded rows count too
    # Fewer decode steps than one sequence at a time: sequences ran side by side.
    assert out.decode_steps < reference.decode_steps


def test_bf16_model_generates(tiny_qwen2):
    model = load_model(tiny_qwen2, "bf16", dtype=torch.bfloat16)
    out = _engine(model, max_batch=4).generate(PROMPTS, n=2, sampling=SamplingParams(max_new_tokens=6, seed=1))
    assert out.lengths == [6] * 8
    assert all(-1e9 < lp <= 0 for lps in out.logprobs for lp in lps)
    assert _engine(model, max_batch=4).generate(PROMPTS, n=2, sampling=SamplingParams(max_new_tokens=6, seed=1)).tokens == out.tokens


def test_one_new_token_needs_no_decode_step(llama32):
    out = _engine(llama32, max_batch=2).generate(PROMPTS, n=3, sampling=SamplingParams(max_new_tokens=1))
    assert out.lengths == [1] * 12 and out.decode_steps == 0 and out.finish_reasons == ["length"] * 12


def test_steps_run_one_ahead_of_the_host(llama32):
    """Step t+1 is launched before step t's tokens are read: a run to max_new_tokens wastes no
    step, a stop costs at most the one step already in flight, whose token is dropped."""
    engine = _engine(llama32, max_batch=1)
    full = engine.generate([PROMPTS[0]], sampling=SamplingParams(max_new_tokens=12, seed=3))
    assert full.decode_steps == 11  # the first token comes from the prefill
    firsts = [t for t in full.tokens[0] if 3 <= full.tokens[0].index(t) < 11]
    assert firsts, f"too few distinct tokens: {full.tokens[0]}"
    stop = firsts[0]
    cut = full.tokens[0].index(stop) + 1
    out = engine.generate([PROMPTS[0]], sampling=SamplingParams(max_new_tokens=12, seed=3, stop_token_ids=(stop,)))
    assert out.tokens[0] == full.tokens[0][:cut] and out.finish_reasons == ["stop"]
    assert out.decode_steps == cut  # cut - 1 steps drew tokens, one more was in flight


def test_length_buckets():
    from qerl_pipe.engine.graphs import length_buckets

    assert length_buckets(4096) == (256, 512, 1024, 2048, 4096)
    assert length_buckets(3000) == (256, 512, 1024, 2048, 3000)
    assert length_buckets(100) == (100,)


def test_no_prompts_gives_empty_rollouts(llama32):
    out = _engine(llama32, max_batch=2).generate([], n=4)
    assert isinstance(out, Rollouts) and len(out) == 0 and out.lengths == []


@pytest.mark.parametrize(
    ("prompts", "n", "params", "match"),
    [
        ([[1, 2], []], 1, SamplingParams(max_new_tokens=8), "prompt 1 is empty"),
        ([[1, 320]], 1, SamplingParams(), "token id 320 outside the vocabulary 0..319"),
        ([[-1, 3]], 1, SamplingParams(), "token id -1"),
        ([[1] * 40], 1, SamplingParams(max_new_tokens=30), "prompt 0 has 40 tokens.*70 > the engine's max_seq_len=64"),
        ([[1, 2]], 0, SamplingParams(), "n \\(samples per prompt\\) must be an integer >= 1"),
        ([[1, 2]], 1, SamplingParams(stop_token_ids=(400,)), "stop_token_ids \\[400\\]"),
        ([["a"]], 1, SamplingParams(), "not a sequence of token ids"),
    ],
)
def test_bad_inputs_are_refused(llama32, prompts, n, params, match):
    engine = _engine(llama32, max_batch=2, max_seq_len=64)
    with pytest.raises(PromptError, match=match):
        engine.generate(prompts, n=n, sampling=params)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(stop_token_ids=(-3,)), "stop_token_ids"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_bad_sampling_params_are_refused(kwargs, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_stop_ids():
    params = SamplingParams(stop_token_ids=[2, 5])  # a list from a recipe
    assert params.stop_token_ids == (2, 5)
    assert params == SamplingParams(stop_token_ids=(2, 5)) and hash(params) == hash(SamplingParams(stop_token_ids=(2, 5)))


def test_engine_limits_and_cache(llama32):
    limits = EngineLimits(max_batch=3, max_seq_len=32, kv_cache_bytes=0)
    engine = Engine(llama32, limits)
    assert engine.runner.cache.k.shape == (2, 3, 2, 32, 16) and engine.runner.cache.k.dtype == torch.float32
    assert not engine.uses_cuda_graphs and engine.captured_graph_sizes == ()
    engine.reset_graphs()  # a no-op without graphs
    view = engine.runner.cache.first_slots(2, 16)
    assert view.batch_size == 2 and view.max_len == 16 and view.k.data_ptr() == engine.runner.cache.k.data_ptr()
    with pytest.raises(ValueError):
        engine.runner.cache.first_slots(4)


def test_graph_bookkeeping_with_a_fake_cuda_graph(llama32, monkeypatch):
    """The CUDA-graph path's host logic on CPU: lazy capture per size, warm-up, static output
    reused across replays. The fake graph 'replays' by recomputing into the captured output."""
    from contextlib import contextmanager

    from qerl_pipe.engine.graphs import DecodeRunner

    class FakeStream:
        def wait_stream(self, other):
            pass

    class FakeGraph:
        replay_fn = None

        def replay(self):
            self.replay_fn()

    @contextmanager
    def fake_context(*args, **kwargs):
        yield

    for name, value in dict(Stream=FakeStream, current_stream=FakeStream, stream=fake_context,
                            graph=fake_context, CUDAGraph=FakeGraph, graph_pool_handle=lambda: object()).items():
        monkeypatch.setattr(torch.cuda, name, value)
    original = DecodeRunner._capture
    captures = []

    def capture(self, b, length):
        entry = original(self, b, length)
        tokens, positions, view = self.tokens[:b], self.positions[:b], self._view(b, length)
        entry.graph.replay_fn = lambda: self._logits[:b].copy_(decode_step(self.model, self.lora, tokens, positions, view))
        captures.append((b, length))
        return entry

    monkeypatch.setattr(DecodeRunner, "_capture", capture)
    params = SamplingParams(max_new_tokens=14, seed=4, stop_token_ids=tuple(range(0, 320, 9)))
    reference = _engine(llama32, max_batch=8).generate(PROMPTS * 3, n=2, sampling=params)
    engine = _engine(llama32, max_batch=8)
    engine.runner.graphs.use_graphs, engine.runner.graphs.sizes = True, (1, 2, 4, 8)
    engine.runner.graphs.lengths = (8, 16, 32, 64)
    out = engine.generate(PROMPTS * 3, n=2, sampling=params)
    assert out.tokens == reference.tokens and out.compactions > 0
    assert len(captures) == len(set(captures)) >= 4  # each (batch, length) captured once
    assert {b for b, _ in captures} == set(engine.captured_graph_sizes) and len(engine.captured_graph_sizes) >= 2
    assert len({length for _, length in captures}) >= 2
    # A rebound buffer invalidates the graphs; the next generate captures again.
    norm = llama32.norm
    monkeypatch.setattr(norm, "noise", norm.noise.clone())
    captures.clear()
    assert engine.generate(PROMPTS * 3, n=2, sampling=params).tokens == reference.tokens
    assert captures
    # Capturing every graph ahead of time, then generating, captures nothing more.
    engine.reset_graphs()
    assert engine.capture_graphs() == 4 * 4
    captures.clear()
    assert engine.generate(PROMPTS * 3, n=2, sampling=params).tokens == reference.tokens
    assert captures == []
