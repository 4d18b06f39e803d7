"""Plain-torch parts of qerl_pipe.kernels: references, CPU dispatch, repacking, config tables."""

from __future__ import annotations

import json

import pytest
import torch

from qerl_pipe.formats.nf4 import dequantize_nf4, quantize_nf4
from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from qerl_pipe.kernels import nf4_linear, nf4_linear_dx, nvfp4_linear, nvfp4_linear_dx
from qerl_pipe.kernels.configs import KernelConfig, default_table, get_config, set_table, table_from_json, table_to_json
from qerl_pipe.kernels.packing import prepare_nf4, prepare_nvfp4, prepared_nvfp4
from qerl_pipe.kernels.packing import pack_words, unpack_words, unprepare_nf4, unprepare_nvfp4


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


@pytest.mark.parametrize("shape", [(1, 64), (3, 5, 128)])
def test_linear_cpu_matches_dequantized_matmul(shape: tuple[int, ...]) -> None:
    gen = _gen()
    k, n = shape[-1], 48
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    dy = torch.randn(*shape[:-1], n, generator=gen).to(torch.bfloat16)
    q4, nf = quantize_nvfp4(w), quantize_nf4(w)
    for fwd, bwd, wq, dense in ((nvfp4_linear, nvfp4_linear_dx, q4, dequantize_nvfp4(q4)),
                                (nf4_linear, nf4_linear_dx, nf, dequantize_nf4(nf))):
        y = fwd(x, wq)
        assert y.shape == (*shape[:-1], n) and y.dtype == torch.bfloat16
        assert _rel(y, x.float() @ dense.T) < 1e-2
        dx = bwd(dy, wq)
        assert dx.shape == shape and dx.dtype == torch.bfloat16
        assert _rel(dx, dy.float() @ dense) < 1e-2


def test_linear_accepts_the_packed_layout_on_cpu() -> None:
    gen = _gen()
    w = torch.randn(24, 64, generator=gen)
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    q4, nf = quantize_nvfp4(w), quantize_nf4(w)
    assert torch.equal(nvfp4_linear(x, prepare_nvfp4(q4)), nvfp4_linear(x, q4))
    assert torch.equal(nf4_linear(x, prepare_nf4(nf)), nf4_linear(x, nf))


def test_word_packing_round_trips_and_orders_pairs() -> None:
    packed = torch.randint(0, 256, (7, 32), dtype=torch.uint8, generator=_gen())
    assert torch.equal(unpack_words(pack_words(packed)), packed)
    # Word of elements 0..7 with code == element: shifting left by 4s puts elements 2s and 2s+1
    # at bits 12-15 and 28-31 (what the kernel decodes together).
    word = int(pack_words(torch.tensor([[0x10, 0x32, 0x54, 0x76]], dtype=torch.uint8))) & 0xFFFFFFFF
    for s in range(4):
        v = (word << (4 * s)) & 0xFFFFFFFF
        assert ((v >> 12) & 0xF, (v >> 28) & 0xF) == (2 * s, 2 * s + 1)


def test_prepare_round_trips_to_the_checkpoint_container() -> None:
    w = torch.randn(16, 128, generator=_gen())
    q4 = quantize_nvfp4(w)
    back = unprepare_nvfp4(prepare_nvfp4(q4))
    assert torch.equal(back.packed, q4.packed)
    assert torch.equal(back.block_scales.view(torch.uint8), q4.block_scales.view(torch.uint8))
    assert torch.equal(back.global_scale, q4.global_scale)
    nf = quantize_nf4(w)
    back_nf = unprepare_nf4(prepare_nf4(nf))
    assert torch.equal(back_nf.packed, nf.packed) and torch.equal(back_nf.absmax, nf.absmax)


def test_prepared_is_cached_per_weight_object() -> None:
    q4 = quantize_nvfp4(torch.randn(16, 64, generator=_gen()))
    assert prepared_nvfp4(q4) is prepared_nvfp4(q4)
    packed = prepare_nvfp4(q4)
    assert prepared_nvfp4(packed) is packed


def test_config_table_json_round_trip_and_lookup() -> None:
    """As an engine keeps its tuned table in engine.json and installs it again."""
    table = default_table()
    tuned = KernelConfig("tiled", 64, 128, 64, num_warps=8, num_stages=4)
    table["fwd:nvfp4:m64:n4608:k3584"] = tuned
    loaded = table_from_json(json.loads(json.dumps(table_to_json(table))))
    assert loaded == table
    set_table(loaded)
    try:
        assert get_config("fwd", "nvfp4", 50, 4608, 3584) == tuned  # bucket 64, tuned layer
        assert get_config("fwd", "nvfp4", 50, 3584, 3584) == table["fwd:nvfp4:m64"]
        assert get_config("dx", "nf4", 100000, 8, 64) == table["dx:nf4:m1024"]
    finally:
        set_table(default_table())


def test_config_rejects_shapes_the_kernels_cannot_run() -> None:
    with pytest.raises(ValueError):
        KernelConfig("tiled", 8, 64, 64)
    with pytest.raises(ValueError):
        KernelConfig("skinny", 3, 64, 64)
    with pytest.raises(ValueError):
        KernelConfig("cutlass", 1, 64, 64)
