"""build-engine on a CUDA GPU (run on the H200: `pytest -m gpu tests/engine/test_build_engine_gpu.py`):
the dispatch measured for real on Hopper, the auto KV budget, CUDA-graph sizes, and the table
`load_engine` installs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qerl_pipe.cli import app
from qerl_pipe.kernels import cuda_ext, dispatch
from qerl_pipe.model.load import load_model
from qerl_pipe.jobs.engine_artifact import load_engine
from tests.conftest import read_json

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_build_engine_on_cuda_measures_plans_and_loads(tiny_llama, tmp_path):
    store = tmp_path / "artifacts"
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
    assert "kernel_table" not in spec
    if cuda_ext.available("cuda"):
        # Tiny Llama: qkv (128, 64), o (64, 64), gate_up (256, 64), down (64, 128), at every row M.
        assert len(spec["dispatch_table"]["deterministic"]) == 4 * len(dispatch.ROWS_M)
    else:  # NVFP4 runs dequantize + cuBLAS here: nothing to measure
        assert spec["dispatch_table"] is None
    assert read_json(engine / "manifest.json")["config"]["device"] == torch.cuda.get_device_name()

    try:
        model, limits = load_engine(engine)
        assert model.embed_tokens.weight.device.type == "cuda" and limits.max_batch == 8
        if spec["dispatch_table"] is not None:
            assert dispatch.active(torch.device("cuda"))[0].to_json() == spec["dispatch_table"]
        (ckpt,) = [p for p in store.iterdir() if p.name.startswith("quantize-")]
        reference = load_model(ckpt, "nvfp4", dtype=torch.bfloat16, device="cuda")
        ours, theirs = model.state_dict(), reference.state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
        ids = torch.randint(0, 300, (2, 11), device="cuda")
        with torch.no_grad():
            a, b = model.logits(ids).float(), reference.logits(ids).float()
        # The same weights under the same dispatch table: equal up to the last bits of a split-K sum.
        assert float((a - b).norm() / b.norm()) < 1e-2
    finally:
        dispatch.configure(None, True)
        dispatch._ACTIVE.chosen = False
