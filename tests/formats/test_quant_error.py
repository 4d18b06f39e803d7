"""Per-layer weight and output error (`formats.quant_error`) and the quantize stage's report of it."""

from __future__ import annotations

import math

import pytest
import torch

from qerl_pipe.formats.modelopt_writer import quantize_in_row_chunks
from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, global_scale_from_amax, quantize_nvfp4
from qerl_pipe.formats.quant_error import ErrorSums, LayerError, summarize
from tests.conftest import read_json
from tests.stage_cli import cli, last_line

CAL = ["--set", "calibrate.num_samples=4", "--set", "calibrate.seq_len=32", "--set", "calibrate.batch_size=2"]
FAST = ["--set", "quantize.quality.perplexity=never"]


def layer_errors(weight: torch.Tensor, dequantized: torch.Tensor,
                 channel_mean_square: torch.Tensor | None = None) -> LayerError:
    """`LayerError` of a whole weight at once."""
    sums = ErrorSums(channel_mean_square)
    sums.add(weight, dequantized)
    return sums.result()


def _weight(seed: int, heavy: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 128, generator=gen)
    return w * torch.exp(torch.randn(64, 128, generator=gen)) if heavy else w


def _channel_ms(k: int, seed: int) -> torch.Tensor:
    # Mean squares over four decades, as real activations have (a few outlier channels).
    return torch.exp(torch.randn(k, generator=torch.Generator().manual_seed(seed)) * 2.3)


def test_output_error_is_the_expected_output_error_for_uncorrelated_inputs() -> None:
    """Against explicit outputs: inputs whose channels are exactly uncorrelated (orthogonal columns)
    give the formula to rounding; independent Gaussian inputs give it within Monte-Carlo noise."""
    w = _weight(0, heavy=True).double()
    ms = _channel_ms(w.shape[1], 1).double()
    delta = dequantize_nvfp4(quantize_nvfp4(w.float())).double() - w
    predicted = layer_errors(w, w + delta, ms).output

    n = 4096
    q, _ = torch.linalg.qr(torch.randn(n, w.shape[1], generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    x = q * math.sqrt(n) * ms.sqrt()  # x^T x / n == diag(ms) exactly
    explicit = math.sqrt(float((x @ delta.T).pow(2).sum() / (x @ w.T).pow(2).sum()))
    assert predicted == pytest.approx(explicit, rel=1e-6)  # the column sums are fp32

    x = torch.randn(200_000, w.shape[1], generator=torch.Generator().manual_seed(3), dtype=torch.float64) * ms.sqrt()
    sampled = math.sqrt(float((x @ delta.T).pow(2).sum() / (x @ w.T).pow(2).sum()))
    assert predicted == pytest.approx(sampled, rel=0.02)


def test_weight_error_and_equal_channels() -> None:
    w = _weight(4)
    d = dequantize_nvfp4(quantize_nvfp4(w))
    err = layer_errors(w, d, torch.full((w.shape[1],), 3.0))
    assert err.weight == pytest.approx(float((d - w).norm() / w.norm()), rel=1e-6)
    assert err.output == pytest.approx(err.weight, rel=1e-6)  # equal mean squares: the same figure
    assert layer_errors(w, d).output is None
    assert layer_errors(torch.zeros(4, 16), torch.zeros(4, 16), torch.ones(16)) == LayerError(0.0, 0.0)


def test_chunks_sum_to_the_whole_and_mismatched_statistics_fail() -> None:
    w = _weight(5, heavy=True)
    d = dequantize_nvfp4(quantize_nvfp4(w))
    ms = _channel_ms(w.shape[1], 6)
    sums = ErrorSums(ms)
    for rows, deq in zip(w.split(7), d.split(7)):
        sums.add(rows, deq)
    chunked, whole = sums.result(), layer_errors(w, d, ms)
    assert chunked.weight == pytest.approx(whole.weight, rel=1e-6)
    assert chunked.output == pytest.approx(whole.output, rel=1e-6)
    with pytest.raises(Exception, match="input channels"):
        ErrorSums(ms[:16], "q_proj").add(w, d)


@pytest.mark.parametrize("heavy", [False, True])
def test_each_method_never_loses_to_rtn_on_what_it_minimises(heavy: bool) -> None:
    """mse minimises each block's squared weight error and act-mse its channel-weighted one, each
    over candidates that include rtn's scale: per layer, the weight error (mse) and the output
    error (act-mse) can only go down. Nothing is claimed for the other figure of each."""
    for seed in range(3):
        w = _weight(10 + seed, heavy).to(torch.bfloat16)
        ms = _channel_ms(w.shape[1], 20 + seed)
        scale = global_scale_from_amax(w.float().abs().amax() * 1.25)  # as if shared with a larger member
        runs = {m: quantize_in_row_chunks(w, scale, "w", m, ms if m == "act-mse" else None, ms)[1]
                for m in ("rtn", "mse", "act-mse")}
        assert runs["mse"].weight <= runs["rtn"].weight * (1 + 1e-6)
        assert runs["act-mse"].output <= runs["rtn"].output * (1 + 1e-6)
        assert runs["act-mse"].output < runs["rtn"].output  # and strictly better on such data


def test_summarize_ranks_by_output_error_when_every_layer_has_one() -> None:
    errors = {"a": LayerError(0.1, 0.3), "b": LayerError(0.2, 0.1), "c": LayerError(0.05, 0.2)}
    s = summarize(errors, worst=2)
    assert [r["module"] for r in s["worst_layers"]] == ["a", "c"]
    assert s["max_weight_error"] == 0.2 and s["mean_output_error"] == pytest.approx(0.2)
    no_output = summarize({"a": LayerError(0.1), "b": LayerError(0.2)})
    assert no_output["mean_output_error"] is None and no_output["worst_layers"][0]["module"] == "b"


def test_stage_reports_both_errors_per_layer(tiny_llama, store_dir) -> None:
    plain = last_line(cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *FAST))
    quality = read_json(plain / "quality.json")
    assert quality["method"] == "rtn" and len(quality["relative_error"]) == 14
    assert quality["output_relative_error"] is None and "no calibration" in quality["output_error_basis"]
    assert read_json(plain / "manifest.json")["summary"]["mean_output_relative_error"] is None

    cal = last_line(cli("calibrate", "--model", tiny_llama, "--artifacts", store_dir, *CAL))
    reports = {}
    for method in ("rtn", "mse", "act-mse"):
        made = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *FAST, "--calibration", cal,
                   "--set", f"quantize.method={method}")
        ckpt = last_line(made)
        assert "output (calibration)" in made.stderr  # the human summary's table
        reports[method] = read_json(ckpt / "quality.json")
        summary = read_json(ckpt / "manifest.json")["summary"]
        assert summary["mean_output_relative_error"] == reports[method]["summary"]["mean_output_error"] > 0
    rtn, mse, act = (reports[m] for m in ("rtn", "mse", "act-mse"))
    assert set(act["output_relative_error"]) == set(rtn["relative_error"])
    assert quality["relative_error"] == rtn["relative_error"]  # the same weights with or without calibration
    for module, base in rtn["output_relative_error"].items():
        assert act["output_relative_error"][module] <= base * (1 + 1e-6), module
        assert mse["relative_error"][module] <= rtn["relative_error"][module] * (1 + 1e-6), module
