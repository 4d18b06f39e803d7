"""The MSE block-scale search (`quantize.method: mse`): fewer squared errors, the same files."""

from __future__ import annotations

import pytest
import torch

from qerl_pipe.formats.nvfp4 import BLOCK_SIZE, dequantize_nvfp4, quantize_nvfp4, quantize_nvfp4_in_row_chunks
from tests.conftest import read_json
from tests.stage_cli import cli, last_line


def _weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(256, 512, generator=gen)
    heavy = normal * torch.exp(torch.randn(256, 512, generator=gen))  # outliers in most blocks
    sparse = normal * (torch.rand(256, 512, generator=gen) < 0.1)  # many zero blocks
    return [normal, heavy, sparse, normal.to(torch.bfloat16)]


def _block_errors(w: torch.Tensor, method: str) -> torch.Tensor:
    q = quantize_nvfp4(w, method=method)
    d = (dequantize_nvfp4(q) - w.float()).pow(2)
    return d.reshape(w.shape[0], -1, BLOCK_SIZE).sum(-1)


@pytest.mark.parametrize("index", range(4))
def test_no_block_gets_worse_and_most_get_better(index: int) -> None:
    w = _weights()[index]
    rtn, mse = _block_errors(w, "rtn"), _block_errors(w, "mse")
    assert bool((mse <= rtn).all())
    assert float(mse.sum()) < 0.95 * float(rtn.sum())


def test_same_layout_and_global_scale_as_rtn() -> None:
    w = _weights()[1]
    rtn, mse = quantize_nvfp4(w), quantize_nvfp4(w, method="mse")
    assert mse.packed.shape == rtn.packed.shape and mse.packed.dtype == torch.uint8
    assert mse.block_scales.dtype == torch.float8_e4m3fn and torch.equal(mse.global_scale, rtn.global_scale)
    raw = mse.block_scales.view(torch.uint8)
    assert bool(((raw > 0) & (raw < 0x7F)).all())  # positive, finite


def test_rtn_is_the_default_and_unknown_methods_fail() -> None:
    w = _weights()[0]
    assert torch.equal(quantize_nvfp4(w).packed, quantize_nvfp4(w, method="rtn").packed)
    with pytest.raises(ValueError, match="unknown NVFP4 method 'gptq'"):
        quantize_nvfp4(w, method="gptq")


def test_row_chunks_give_the_same_bytes() -> None:
    w = _weights()[1]
    whole = quantize_nvfp4(w, method="mse")
    chunked = quantize_nvfp4_in_row_chunks(w, whole.global_scale, method="mse", chunk_elements=4096)
    assert torch.equal(whole.packed, chunked.packed)
    assert torch.equal(whole.block_scales.view(torch.uint8), chunked.block_scales.view(torch.uint8))


def test_stage_method_mse(tiny_llama, store_dir) -> None:
    import os
    import stat

    fast = ["--set", "quantize.quality.perplexity=never"]
    old_umask = os.umask(0o022)
    try:
        rtn = last_line(cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *fast))
    finally:
        os.umask(old_umask)
    for shard in rtn.glob("*.safetensors"):  # readable by a serving process of another user
        assert stat.S_IMODE(shard.stat().st_mode) == 0o644
    mse = last_line(cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *fast,
                        "--set", "quantize.method=mse"))
    assert rtn != mse  # another artifact, not a reuse
    s_rtn, s_mse = (read_json(p / "manifest.json")["summary"] for p in (rtn, mse))
    assert s_rtn["method"] == "rtn" and s_mse["method"] == "mse"
    assert s_mse["mean_relative_error"] < s_rtn["mean_relative_error"]
    bad = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *fast,
              "--set", "quantize.method=awq", ok=False)
    assert bad.exit_code != 0 and "quantize.method" in bad.stderr


def test_activation_weights_steer_the_search() -> None:
    """With one input channel per block carrying all the activation energy, act-mse fits that
    channel's weight better than plain mse does, and the function checks its arguments."""
    w = _weights()[1]
    k = w.shape[1]
    energy = torch.full((k,), 1e-3)
    energy[::BLOCK_SIZE] = 1.0
    act = quantize_nvfp4(w, method="act-mse", channel_weight=energy)
    plain = quantize_nvfp4(w, method="mse")
    err = lambda q: (dequantize_nvfp4(q) - w).pow(2)[:, ::BLOCK_SIZE].sum()  # noqa: E731
    assert float(err(act)) < float(err(plain))
    with pytest.raises(ValueError, match="channel_weight"):
        quantize_nvfp4(w, method="act-mse")
    with pytest.raises(ValueError, match="channel_weight"):
        quantize_nvfp4(w, method="mse", channel_weight=energy)


def test_stage_act_mse_needs_and_uses_calibration(tiny_llama, store_dir) -> None:
    fast = ["--set", "quantize.quality.perplexity=never"]
    cal_opts = ["--set", "calibrate.num_samples=4", "--set", "calibrate.seq_len=32"]
    refused = cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *fast,
                  "--set", "quantize.method=act-mse", ok=False)
    assert refused.exit_code != 0 and "calibrate" in refused.stderr
    assert not list(store_dir.glob("quantize-*"))  # nothing half written
    cal = last_line(cli("calibrate", "--model", tiny_llama, "--artifacts", store_dir, *cal_opts))
    from safetensors.torch import load_file

    channels = load_file(str(cal / "channel_mean_square.safetensors"))
    assert channels and all(v.ndim == 1 and bool((v >= 0).all()) for v in channels.values())
    ckpt = last_line(cli("quantize", "--model", tiny_llama, "--artifacts", store_dir, *fast,
                         "--calibration", cal, "--set", "quantize.method=act-mse"))
    assert read_json(ckpt / "manifest.json")["summary"]["method"] == "act-mse"
