"""Shared fixtures: tiny random Llama-family models with a real tokenizer, saved as HF directories.

Nothing comes from a hub: the tokenizer is trained on the spot on packaged GSM8K text, so the real
loading code (config.json, safetensors shards, tokenizer files) runs in every test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qerl_pipe.textdata import load_texts

TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)


def train_tokenizer(out: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(load_texts("gsm8k:train")[:500], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    fast.save_pretrained(out)
    return fast


def make_tiny_model(out: Path, arch: str = "llama", *, seed: int = 0, shard_mb: float | None = None,
                    dims: dict | None = None, **overrides) -> Path:
    """A random-init model of `arch` ('llama', 'qwen2', 'qwen3', 'qwen3_moe') saved with its tokenizer in `out`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    tokenizer = train_tokenizer(out)
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[arch]
    config = config_cls(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        **{**(dims or TINY_DIMS), **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    kwargs = {"max_shard_size": f"{int(shard_mb * 1000)}KB"} if shard_mb else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return out


def randomize_weights(model: torch.nn.Module, norm_center: float = 1.0, embed_std: float = 1.0) -> None:
    """HF init leaves norms at their unit scale (1, or Gemma's 0 of 1 + w) and biases at 0:
    randomise them (and the rest) so that a mixed-up norm or bias shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(norm_center + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "embed" in name:
                p.normal_(0, embed_std)
            else:
                p.normal_(0, 0.08)


def adapted_model(path: Path, base: str, dtype: torch.dtype, device: str, rank: int = 4):
    """The model in `path` loaded in `base` with a LoRA adapter of `rank` whose B's are nonzero."""
    from qerl_pipe.model.load import load_model
    from qerl_pipe.model.lora import LoraSpec

    model = load_model(path, base, dtype=dtype, device=device, lora=LoraSpec(rank=rank, alpha=2 * rank))
    randomize_lora_b(model, 0.3)
    return model


def randomize_lora_b(model: torch.nn.Module, scale: float, seed: int = 0) -> None:
    """Nonzero LoRA B's (drawn on the model's device), so that the adapters change the outputs."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * scale)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture()
def store_dir(tmp_path) -> Path:
    return tmp_path / "artifacts"


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())
