"""FP8 rollouts on the CPU (the references): the E4M3 rows and copies, the engine's FP8 path, the
recipe key and its refusals, the memory plan's copy bytes, the TIS default and the mismatch metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import adapted_model, make_tiny_model
from qerl_pipe.engine import Engine, SamplingParams, plan_limits
from qerl_pipe.engine import fp8 as engine_fp8
from qerl_pipe.errors import QerlError
from qerl_pipe.jobs.step_plan import copy_bytes_asked
from qerl_pipe.jobs.train_config import FP8_TIS_CAP, fp8_rollout, train_config
from qerl_pipe.kernels import fp8
from qerl_pipe.memory.step import fp8_copy_bytes
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.recipe import EngineSection, TrainSection
from qerl_pipe.rl.algo.losses import PolicyLossConfig, policy_loss

from qerl_pipe.model.shapes import SHAPES


def test_quantize_rows_scale_and_rounding():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=gen) * torch.tensor([1.0, 1e-3, 50.0, 1.0, 0.0])[:, None]
    q = fp8.quantize_rows(x)
    assert q.codes.dtype == fp8.FP8 and q.scale.shape == (5, 1)
    amax = x.abs().amax(-1)
    torch.testing.assert_close(q.scale[:4, 0], amax[:4] / fp8.FP8_MAX)
    assert float(q.codes[:4].float().abs().amax(-1).min()) == fp8.FP8_MAX  # each row's largest value maps to 448
    back = q.codes.float() * q.scale
    # E4M3 keeps 3 mantissa bits: nearest rounding is within 2^-4 of each value (normal range).
    normal = x.abs() >= q.scale * 2 ** -6
    assert bool(((back - x).abs() <= x.abs() * 2 ** -4 + 1e-30)[normal].all())
    assert float(q.codes[4].float().abs().max()) == 0 and bool(torch.isfinite(back).all())  # a zero row


def test_weight_copy_is_per_output_channel_and_chunked():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 48, generator=gen) * torch.linspace(0.01, 3, 70)[:, None]
    whole, chunked = fp8.quantize_weight(w), fp8.quantize_weight(w, rows_per_chunk=16)
    assert whole.scale.shape == (1, 70) and whole.nbytes == 70 * 48 + 70 * 4
    assert torch.equal(whole.codes.view(torch.uint8), chunked.codes.view(torch.uint8))
    assert torch.equal(whole.scale, chunked.scale)
    x = torch.randn(3, 48, generator=gen)
    got = fp8.fp8_linear(fp8.quantize_rows(x), whole, torch.float32)
    exact = x @ w.T
    assert float((got - exact).norm() / exact.norm()) < 0.06


@pytest.fixture(scope="module")
def tiny_llama_fp8(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-fp8"), "llama")


def _model(path: Path, base: str):
    return adapted_model(path, base, torch.float32, "cpu")


def test_engine_runs_every_dense_projection_on_fp8_copies(tiny_llama_fp8, monkeypatch):
    model = _model(tiny_llama_fp8, "bf16")
    limits = plan_limits(model.config, max_seq_len=48, max_batch=4)
    calls: list[tuple[int, int]] = []
    real = engine_fp8.fp8_linear

    def counted(x, w, out_dtype=torch.bfloat16, bias=None, lora=None):
        calls.append(tuple(w.codes.shape))
        return real(x, w, out_dtype, bias, lora)

    monkeypatch.setattr(engine_fp8, "fp8_linear", counted)
    engine = Engine(model, limits, activations="fp8")
    assert engine.activations == "fp8"
    assert engine.fp8_copy_bytes == sum(m.out_features * (m.in_features + 4) for m in engine_fp8.fp8_linears(model))
    params = SamplingParams(temperature=0, max_new_tokens=6)
    got = engine.generate([[1, 5, 6, 7], [1, 9, 10]], n=2, sampling=params)
    shapes = {(m.out_features, m.in_features) for m in engine_fp8.fp8_linears(model)}
    assert set(calls) == shapes  # q/k/v, o, gate/up and down, in prefill and decode
    ref = Engine(model, limits).generate([[1, 5, 6, 7], [1, 9, 10]], n=2, sampling=params)
    first = max(abs(a[0] - b[0]) for a, b in zip(ref.logprobs, got.logprobs))
    assert 0 < first < 0.1  # FP8 moved the numbers, a little


def test_nvfp4_decode_rows_below_the_crossover_keep_the_w4a16_kernel(tiny_llama_fp8, monkeypatch):
    model = _model(tiny_llama_fp8, "nvfp4")
    served: list[int] = []
    real = engine_fp8.Fp8Linears.forward

    def spy(self, linear, x, q, lora):
        served.append(x.shape[0])
        return real(self, linear, x, q, lora)

    monkeypatch.setattr(engine_fp8.Fp8Linears, "forward", spy)
    engine = Engine(model, plan_limits(model.config, max_seq_len=96, max_batch=4), activations="fp8")
    prompt = list(range(1, engine_fp8.NVFP4_MIN_ROWS + 2))
    engine.generate([prompt], n=2, sampling=SamplingParams(temperature=0, max_new_tokens=4))
    # The prefill runs FP8; decode steps of 2 rows stay on the NVFP4 kernel.
    assert served and min(served) >= engine_fp8.NVFP4_MIN_ROWS


def test_no_room_for_copies_falls_back_to_bf16_activations(tiny_llama_fp8):
    model = _model(tiny_llama_fp8, "bf16")
    engine = Engine(model, plan_limits(model.config, max_seq_len=32, max_batch=2), kernel_copies=False,
                    activations="fp8")
    assert engine.activations == "bf16" and engine.fp8_copy_bytes == 0


def test_refusals_name_the_fix(monkeypatch):
    with pytest.raises(QerlError, match="engine.activations=fp8 takes an nvfp4 or bf16 base, not nf4"):
        engine_fp8.check_activations("fp8", "nf4", torch.device("cpu"), torch.float32)
    with pytest.raises(QerlError, match="choose one of bf16, fp8"):
        engine_fp8.check_activations("int8", "nvfp4", torch.device("cpu"), torch.float32)
    engine_fp8.check_activations("fp8", "nvfp4", torch.device("cpu"), torch.float32)  # the CPU reference: any dtype
    monkeypatch.setattr(engine_fp8, "runs_fp8", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(QerlError, match="needs FP8 tensor cores .* A100 has none; set engine.activations=bf16"):
        engine_fp8.check_activations("fp8", "nvfp4", torch.device("cuda"), torch.bfloat16)
    engine_fp8.check_activations("bf16", "nf4", torch.device("cuda"), torch.float16)  # bf16 runs anywhere
    monkeypatch.setattr(engine_fp8, "runs_fp8", lambda device: True)
    with pytest.raises(QerlError, match="runs bfloat16 models on a GPU, not float16; set engine.dtype=bfloat16"):
        engine_fp8.check_activations("fp8", "nvfp4", torch.device("cuda"), torch.float16)
    engine_fp8.check_activations("fp8", "nvfp4", torch.device("cuda"), torch.bfloat16)


def test_only_linears_the_fp8_gemm_takes_get_copies(tiny_llama_fp8):
    """torch's FP8 GEMM needs K and N multiples of 16: a linear of other sizes keeps bf16 activations."""
    model = _model(tiny_llama_fp8, "bf16")
    layer = model.layers[0]
    assert layer.mlp.down_proj in engine_fp8.fp8_linears(model)
    odd = layer.mlp.down_proj
    odd.in_features, saved = odd.in_features + 1, odd.in_features
    try:
        assert odd not in engine_fp8.fp8_linears(model) and layer.self_attn.qkv_proj in engine_fp8.fp8_linears(model)
    finally:
        odd.in_features = saved


def test_recipe_key():
    assert EngineSection().activations == "bf16"
    assert EngineSection(activations="fp8").activations == "fp8"
    with pytest.raises(ValueError, match="activations"):
        EngineSection(activations="fp16")


def test_an_engine_id_names_a_rollout_setting_only_when_it_is_not_the_default():
    """Engines built before activations / kv_cache existed keep their ids; fp8 and int8 get their own."""
    from qerl_pipe.jobs.step_plan import EngineBudget
    from qerl_pipe.kernels.base_formats import FORMATS
    from qerl_pipe.recipe import Recipe
    from qerl_pipe.stages.build_engine import _Base, _engine_key

    base = _Base(Path("."), {}, {"model": "m"}, [])

    def key(**engine):
        recipe = Recipe.model_validate({"engine": engine})
        return _engine_key(recipe, base, FORMATS["nvfp4"], torch.device("cpu"), EngineBudget(1, None, None))

    assert "kv_cache" not in key()["engine"] and "activations" not in key()["engine"]
    assert key(kv_cache="int8")["engine"]["kv_cache"] == "int8"
    assert key(kv_cache="fp8")["engine"]["kv_cache"] == "fp8" and key(activations="fp8")["engine"]["activations"] == "fp8"
    assert key(kv_cache="int8") != key(kv_cache="fp8")


def test_tis_cap_defaults_to_2_with_fp8_rollouts_unless_the_recipe_sets_it():
    assert train_config(TrainSection()).loss.tis_cap is None
    assert train_config(TrainSection(), fp8=True).loss.tis_cap == FP8_TIS_CAP == 2.0
    assert train_config(TrainSection(tis_cap=3.0), fp8=True).loss.tis_cap == 3.0
    assert train_config(TrainSection(tis_cap=None), fp8=True).loss.tis_cap is None  # off, on purpose
    bf16 = {"activations": "bf16", "limits": {"kv_cache": "bf16"}}
    assert not fp8_rollout(bf16) and not fp8_rollout({"limits": {}})  # an engine made before the settings
    assert fp8_rollout({**bf16, "activations": "fp8"}) and fp8_rollout({**bf16, "limits": {"kv_cache": "fp8"}})
    assert fp8_rollout({**bf16, "limits": {"kv_cache": "int8"}})
    assert train_config(TrainSection(tis_cap=1.5)).loss.tis_cap == 1.5


def test_fp8_copies_are_planned_instead_of_humming_copies():
    c = DecoderConfig.from_hf(SHAPES["qwen2.5-7b"])
    # 28 layers of q/k/v [4608, 3584], o [3584, 3584], gate/up [37888, 3584], down [3584, 18944].
    per_layer = sum(n * (k + 4) for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)))
    assert fp8_copy_bytes(c) == 28 * per_layer
    cpu = torch.device("cpu")
    for base in ("nvfp4", "bf16"):
        assert copy_bytes_asked(c, base, cpu, None, True, False, "fp8") == 28 * per_layer
    assert copy_bytes_asked(c, "bf16", cpu, None, True, False) == 0


def test_mismatch_metrics_are_logged_with_and_without_the_cap():
    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    rollout = torch.tensor([[-1.0, -2.5, -0.4, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    for cap in (None, 1.5):
        _, m = policy_loss(logp, torch.tensor([1.0]), mask, PolicyLossConfig("dapo", 0.2, 0.28, 0.0, 4, cap),
                           rollout_logp=rollout)
        d = torch.tensor([0.0, 0.5, -0.1], dtype=torch.float64)  # trainer - rollout on the 3 counted tokens
        ratio = torch.exp(d)
        assert m["mismatch_k3"] == pytest.approx(float((ratio - d - 1).mean()))
        assert m["tis_ratio_mean"] == pytest.approx(float(ratio.mean()))
        assert m["tis_ratio_max"] == pytest.approx(float(ratio.max()))
        assert m["tis_truncated"] == pytest.approx(1 / 3 if cap else 0.0)


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_coded_kv_cache_holds_codes_and_scales_and_moves_them_together(kv):
    c = DecoderConfig.from_hf({**SHAPES["qwen2.5-7b"], "num_hidden_layers": 2})
    from qerl_pipe.model.decoder import KVCache

    cache = KVCache(c, 3, 16, torch.float32, "cpu", kv)
    assert cache.k.dtype == fp8.KV_CODES[kv] and cache.k_scale.shape == cache.k.shape[:-1]
    gen = torch.Generator().manual_seed(0)
    cache.k.view(torch.uint8).copy_(torch.randint(0, 120, cache.k.shape, generator=gen, dtype=torch.uint8))
    cache.k_scale.uniform_(0.1, 1.0, generator=gen)
    cache.copy_slots(torch.tensor([0]), torch.tensor([2]), 8)
    assert torch.equal(cache.k.view(torch.uint8)[:, 2, :, :8], cache.k.view(torch.uint8)[:, 0, :, :8])
    assert torch.equal(cache.k_scale[:, 2, :, :8], cache.k_scale[:, 0, :, :8])
    view = cache.first_slots(2, 8)
    assert view.k_scale.shape == (2, 2, c.num_kv_heads, 8) and view.k_scale.data_ptr() == cache.k_scale.data_ptr()
    assert KVCache(c, 1, 4, torch.float32, "cpu").layer(0)[2] is None  # bf16: no scales


@pytest.mark.parametrize(("codes", "most"), [(fp8.FP8, 0.05), (torch.int8, 0.02)])
def test_coded_kv_decode_attention_reads_back_what_it_wrote(codes, most):
    from qerl_pipe.kernels.decode_ops import decode_attention_reference

    gen = torch.Generator().manual_seed(3)
    b, hq, hkv, d, length = 2, 4, 2, 32, 24
    q, k, v = (torch.randn(b, h, d, generator=gen) for h in (hq, hkv, hkv))
    cos, sin = torch.ones(b, d), torch.zeros(b, d)  # no rotation: the written k is k itself
    positions = torch.tensor([5, 17])
    k16, v16 = (torch.randn(b, hkv, length, d, generator=gen) for _ in range(2))
    ref = decode_attention_reference(q, k, v, cos, sin, k16.clone(), v16.clone(), positions, d ** -0.5)
    k8, ks = fp8.row_codes(k16, codes)
    v8, vs = fp8.row_codes(v16, codes)
    k_cache, v_cache, k_scale, v_scale = k8.clone(), v8.clone(), ks[..., 0].clone(), vs[..., 0].clone()
    got = decode_attention_reference(q, k, v, cos, sin, k_cache, v_cache, positions, d ** -0.5, 0, 0.0,
                                     k_scale, v_scale)
    want_codes, want_scale = fp8.row_codes(k, codes)
    assert torch.equal(k_cache[0, :, 5].view(torch.uint8), want_codes[0].view(torch.uint8))
    assert torch.equal(k_scale[1, :, 17], want_scale[1, :, 0])
    err = float((got - ref).norm() / ref.norm())
    assert 0 < err < most, err  # E4M3 keys and values: a few percent at most; INT8's finer steps: less


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_engine_with_a_coded_kv_cache(tiny_llama_fp8, kv):
    model = _model(tiny_llama_fp8, "nvfp4")
    params = SamplingParams(temperature=0, max_new_tokens=8)
    prompts = [[1, 5, 6, 7], [1, 9, 10]]
    ref = Engine(model, plan_limits(model.config, max_seq_len=48, max_batch=4)).generate(prompts, 2, params)
    limits = plan_limits(model.config, max_seq_len=48, max_batch=4, kv_cache=kv)
    engine = Engine(model, limits)
    assert engine.runner.cache.k.dtype == fp8.KV_CODES[kv]
    got = engine.generate(prompts, 2, params)
    # The first token comes from the prefill, which attends over the prompt's own k/v: the same.
    assert [t[0] for t in got.tokens] == [t[0] for t in ref.tokens]
    later = max(abs(a - b) for x, y in zip(ref.logprobs, got.logprobs) for a, b in zip(x[1:2], y[1:2]))
    assert 0 < later < 0.2


def test_an_fp8_kv_cache_doubles_the_slots_of_the_32b_paper_setting():
    """Issue 50: Qwen2.5-32B, 128 prompts x 16 of 1024 + 8192 tokens, NVFP4, one 80 GB budget."""
    from qerl_pipe.engine.limits import kv_bytes_per_token
    from qerl_pipe.jobs.step_plan import train_step_shape
    from qerl_pipe.memory.plan import GB, plan_step

    c = DecoderConfig.from_hf(SHAPES["qwen2.5-32b"])
    assert kv_bytes_per_token(c, torch.bfloat16, "fp8") / kv_bytes_per_token(c, torch.bfloat16) == (128 + 4) / 256
    assert kv_bytes_per_token(c, torch.bfloat16, "int8") == kv_bytes_per_token(c, torch.bfloat16, "fp8")
    train = TrainSection(prompts_per_step=128, group_size=16, max_new_tokens=8192)
    slots = {kv: plan_step(c, "nvfp4", train_step_shape(train, 1024 + 8192, 2048, kv_cache=kv), int(80 * GB)).kv_slots
             for kv in ("bf16", "fp8", "int8")}
    assert slots == {"bf16": 16, "fp8": 32, "int8": 32}


def test_kv_cache_key_and_refusal(monkeypatch):
    assert EngineSection().kv_cache == "bf16" and EngineSection(kv_cache="fp8").kv_cache == "fp8"
    monkeypatch.setattr(engine_fp8, "runs_fp8", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    engine_fp8.check_kv_cache("int8", torch.device("cuda"))  # INT8 codes run wherever Triton does
    with pytest.raises(QerlError, match="engine.kv_cache=fp8 needs FP8 support .* A100 has none"):
        engine_fp8.check_kv_cache("fp8", torch.device("cuda"))
