"""The engine's CUDA decode for Gemma2, Gemma3, Phi3 and sliding-window Mistral against the training
forward (run on a GPU: `pytest -m gpu tests/model/test_families_gpu.py`): the Triton decode attention with
each layer's window, Gemma2's score cap and Phi3's partial rotary, under CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl_pipe.engine import Engine, SamplingParams, plan_limits
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.load import load_model
from qerl_pipe.model.lora import LoraSpec
from tests.conftest import randomize_lora_b
from tests.model.test_model_families import FAMILIES, PROMPTS, argmax_continuation, save_family_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = SamplingParams(temperature=0, max_new_tokens=20)  # prompts of 3-14 tokens: well past the window
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=20, seed=3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families-gpu")
    for family in FAMILIES:
        save_family_model(root / family, family)
    return {family: root / family for family in FAMILIES}


def _model(path: Path, base: str, dtype: torch.dtype) -> Decoder:
    model = load_model(path, base, dtype=dtype, device="cuda", lora=LoraSpec(rank=4, alpha=8))
    randomize_lora_b(model, 0.2)
    return model


def _engine(model: Decoder, graphs: bool) -> Engine:
    return Engine(model, plan_limits(model.config, max_seq_len=64, max_batch=8, cuda_graphs=True), cuda_graphs=graphs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_decode_equals_training_forward_fp32(saved, family):
    model = _model(saved[family], "bf16", torch.float32)
    engine = _engine(model, graphs=True)
    out = engine.generate(PROMPTS, n=2, sampling=GREEDY)
    assert engine.uses_cuda_graphs
    for i, prompt in enumerate(PROMPTS):
        want = argmax_continuation(model, prompt, GREEDY.max_new_tokens)
        assert out.tokens[2 * i] == want and out.tokens[2 * i + 1] == want
        # The engine's logprobs are the training forward's (fp32: the kernels' rounding only).
        with torch.no_grad():
            seq = torch.tensor([prompt + want], device="cuda")
            ref = torch.log_softmax(model.logits(seq)[0, len(prompt) - 1:-1].float(), -1)
        ref = ref.gather(-1, torch.tensor(want, device="cuda")[:, None])[:, 0].cpu()
        torch.testing.assert_close(torch.tensor(out.logprobs[2 * i]), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("base", ["bf16", "nvfp4"])
def test_cuda_graphs_equal_eager_bf16(saved, family, base):
    model = _model(saved[family], base, torch.bfloat16)
    graphed = _engine(model, graphs=True)
    eager = _engine(model, graphs=False)
    eager.runner.graphs.sizes = graphed.runner.graphs.sizes  # the same batch buckets: the same kernels run
    for params in (GREEDY, SAMPLED):
        g, e = graphed.generate(PROMPTS, n=2, sampling=params), eager.generate(PROMPTS, n=2, sampling=params)
        assert g.tokens == e.tokens and g.finish_reasons == e.finish_reasons
        for x, y in zip(g.logprobs, e.logprobs):
            torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=0)
