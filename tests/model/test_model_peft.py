"""The one PEFT reader serves export too: `lora_tensors` gives the factors by Hugging Face name with
the scaling `read_adapter` derived, so an rsLoRA adapter merges with alpha / sqrt(r) (the old
export reader refused rsLoRA, and took no notice of rank_pattern or bias)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from qerl_pipe.model.random_init import init_random_model
from qerl_pipe.errors import ArtifactError
from qerl_pipe.model.lora import LoraSpec, apply_lora
from qerl_pipe.model.peft import ADAPTER_CONFIG, lora_tensors, read_adapter, save_adapter
from tests.conftest import TINY_DIMS


def test_lora_tensors_by_hf_name_with_the_readers_scaling(tmp_path):
    model = init_random_model({"model_type": "llama", "vocab_size": 320, **TINY_DIMS}, "bf16", dtype=torch.float32)
    spec = LoraSpec(rank=4, alpha=8.0, train_norms=True)
    apply_lora(model, spec, seed=1)
    save_adapter(model, spec, tmp_path, "tiny")
    tensors = lora_tensors(read_adapter(tmp_path))
    a, b = tensors.lora["model.layers.0.self_attn.q_proj.weight"]
    assert a.shape == (4, TINY_DIMS["hidden_size"]) and b.shape[1] == 4
    assert tensors.scaling == 2.0 and "model.norm.weight" in tensors.norms
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_rslora": True}))
    assert lora_tensors(read_adapter(tmp_path)).scaling == pytest.approx(8.0 / math.sqrt(4))
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, "rank_pattern": {"q_proj": 8}}))
    with pytest.raises(ArtifactError, match="per-module ranks"):
        read_adapter(tmp_path)
