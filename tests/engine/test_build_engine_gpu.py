"""build-engine on a CUDA GPU (run on the H200: `pytest -m gpu tests/engine/test_build_engine_gpu.py`):
kernel tuning for real, the auto KV budget, CUDA-graph sizes, and the table `load_engine` installs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qerl_pipe.cli import app
from qerl_pipe.formats.nf4 import dequantize_nf4, quantize_nf4
from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from qerl_pipe.kernels import configs, cuda_ext, nf4_linear, nvfp4_linear
from qerl_pipe.kernels.tuning import tune_kernels
from qerl_pipe.model.load import load_model
from qerl_pipe.jobs.engine_artifact import load_engine
from qerl_pipe.jobs import engine_build as engine_build
from tests.conftest import read_json

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(("fmt", "shapes"), [("nvfp4", [(4608, 3584), (3584, 18944)]), ("nf4", [(1000, 512)])])
def test_tune_kernels_gives_a_correct_config_per_shape_bucket_and_op(fmt, shapes):
    table = tune_kernels(shapes, [1, 16, 4096], fmt, "cuda")
    expected = {configs.table_key(op, fmt, m, n, k) for op in ("fwd", "dx") for m in (1, 16, 1024)
                for n, k in shapes}
    assert set(table) == expected
    configs.set_table(table)
    try:
        for n, k in shapes:
            w = torch.randn(n, k, device="cuda") * 0.02
            q = quantize_nvfp4(w) if fmt == "nvfp4" else quantize_nf4(w)
            dense = dequantize_nvfp4(q) if fmt == "nvfp4" else dequantize_nf4(q)
            op = nvfp4_linear if fmt == "nvfp4" else nf4_linear
            for m in (1, 16, 4096):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                ref = x.float() @ dense.T
                assert float((op(x, q).float() - ref).norm() / ref.norm()) < 1e-2, (n, k, m)
    finally:
        configs.set_table({})


def test_build_engine_on_cuda_tunes_plans_and_loads(tiny_llama, tmp_path, monkeypatch):
    store = tmp_path / "artifacts"
    monkeypatch.setattr(engine_build, "TUNING_MS", (1, 16, 4096))  # three buckets keep it short
    args = ["build-engine", "--model", str(tiny_llama), "--artifacts", str(store), "--build-missing",
            "--set", "stages=[quantize, build-engine]", "--set", "quantize.quality.perplexity=never",
            "--set", "engine.max_seq_len=256", "--set", "engine.max_batch=8", "--set", "engine.device=cuda"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr + str(result.exception)
    engine = Path(result.stdout.strip().splitlines()[-1])
    spec = read_json(engine / "engine.json")
    assert spec["device"] == {"type": "cuda", "name": torch.cuda.get_device_name()}
    assert spec["dtype"] == "bfloat16" and spec["kv_budget_bytes"] > 0
    assert spec["limits"]["max_batch"] == 8 and spec["limits"]["graph_batch_sizes"] == [1, 2, 4, 8]
    if cuda_ext.available("cuda"):
        # NVFP4 runs our CUDA kernels here, whose configs ship with the package: no Triton table.
        assert spec["kernel_table"] is None
    else:
        # Tiny Llama: qkv (128, 64), o (64, 64), gate_up (256, 64), down (64, 128); forward at M=1
        # (16 is above max_batch 8) and 4096, dX at 4096 only.
        assert len(spec["kernel_table"]) == 4 * 3
    assert read_json(engine / "manifest.json")["config"]["device"] == torch.cuda.get_device_name()

    try:
        model, limits = load_engine(engine)
        assert model.embed_tokens.weight.device.type == "cuda" and limits.max_batch == 8
        if spec["kernel_table"] is not None:
            assert all(configs._ACTIVE[k] == v for k, v in configs.table_from_json(spec["kernel_table"]).items())
        (ckpt,) = [p for p in store.iterdir() if p.name.startswith("quantize-")]
        reference = load_model(ckpt, "nvfp4", dtype=torch.bfloat16, device="cuda")
        ours, theirs = model.state_dict(), reference.state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        ids = torch.randint(0, 300, (2, 11), device="cuda")
        with torch.no_grad():
            a, b = model.logits(ids).float(), reference.logits(ids).float()
        # Split-K kernels add partial tiles with atomics: the order, hence the last bits, may vary.
        assert float((a - b).norm() / b.norm()) < 1e-2
    finally:
        configs.set_table({})
