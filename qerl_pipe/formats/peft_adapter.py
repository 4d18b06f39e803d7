"""LoRA adapters in PEFT's format: adapter_model.safetensors + adapter_config.json.

`lora_state_dict` already names every tensor as PEFT saves it
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, norms as
`base_model.model.model.norm.weight`), so `peft.PeftModel.from_pretrained` loads the directory
onto the Hugging Face model of the same base.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qerl_pipe.errors import ArtifactError
from qerl_pipe.model.lora import LoraSpec, lora_state_dict
from qerl_pipe.model.norm import RMSNorm

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _norm_names(model: nn.Module) -> list[str]:
    """Last name parts of the trainable norms (PEFT's modules_to_save match by suffix)."""
    names = {name.rpartition(".")[2] for name, m in model.named_modules()
             if isinstance(m, RMSNorm) and m.weight.requires_grad}
    return sorted(names)


def adapter_config(model: nn.Module, spec: LoraSpec, base_model: str) -> dict[str, Any]:
    norms = _norm_names(model) if spec.train_norms else []
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": [f"{t}_proj" for t in spec.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": norms or None,
    }


def save_adapter(model: nn.Module, spec: LoraSpec, out_dir: Path, base_model: str) -> None:
    """Write the model's trainable tensors and their PEFT config into `out_dir` (created)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in lora_state_dict(model).items()}
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(model, spec, base_model)
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def load_adapter_weights(model: nn.Module, path: Path) -> None:
    """Copy an adapter_model.safetensors (PEFT names) into the model's LoRA/norm tensors, in place."""
    stored = load_file(str(path))
    ours = lora_state_dict(model)
    if stored.keys() != ours.keys():
        missing, extra = sorted(ours.keys() - stored.keys()), sorted(stored.keys() - ours.keys())
        raise ArtifactError(f"{path}: the adapter does not fit this model (missing {missing[:2]}, "
                            f"unexpected {extra[:2]}); was it trained with other lora settings?")
    for name, tensor in ours.items():
        tensor.copy_(stored[name])
