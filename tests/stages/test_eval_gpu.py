"""The eval stage on CUDA (run on the H200 with `pytest -m gpu`): CUDA-graph generation through the
engine with an adapter applied, as on CPU (tests/stages/test_eval_stage.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.stages.test_eval_stage import EVAL_AS_TRAIN, TRAIN, cli, last_line, named, read_json, samples

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

CUDA = ["--set", "quantize.quality.perplexity=never", "--set", "engine.max_seq_len=128", "--set", "engine.max_batch=16",
        "--set", "engine.device=cuda", "--set", "train.device=cuda", "--set", "eval.device=cuda"]


@pytest.mark.parametrize("base_format", ["nvfp4", "bf16"])
def test_eval_on_cuda_sees_the_trained_adapter(tiny_llama, tmp_path, base_format):
    store = tmp_path / "artifacts"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"stages: [quantize, build-engine, train, eval]\nmodel:\n  source: {tiny_llama}\n")
    art = last_line(cli("run", recipe, "--artifacts", store, *TRAIN, *EVAL_AS_TRAIN, *CUDA,
                        "--set", f"engine.base_format={base_format}"))
    (run,) = named(store, "train-")
    report = read_json(art / "report.json")
    assert report["device"].startswith("cuda") and report["adapter"]["logit_max_abs_delta"] > 0
    after = [json.loads(line) for line in (store / run / "eval" / "after.jsonl").read_text().splitlines()]
    assert [s["response"] for s in samples(art)] == [a["completion"] for a in after]
    (engine,) = named(store, "build-engine-")
    sampled = last_line(cli("eval", "--model", store / engine, "--adapter", store / run, "--data", "arithmetic",
                            "--limit", "8", "--k", "4", "--set", "eval.max_new_tokens=12", "--set", "eval.device=cuda",
                            "--artifacts", store))
    assert read_json(sampled / "report.json")["samples"] == 32
