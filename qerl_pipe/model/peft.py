"""LoRA adapters in PEFT's format (adapter_model.safetensors + adapter_config.json): the one reader
and writer (`save_adapter`; `read_adapter`, one set of rules for eval and export), tensors named
as PEFT saves them. See docs/model.md, section "The model (`qerl_pipe/model/`)" (the table of
files), and docs/export.md, section "peft"."""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from qerl_pipe.artifacts.manifest import sha256_file
from qerl_pipe.errors import ArtifactError
from qerl_pipe.formats.checkpoint import save_safetensors
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.formats.names import (
    LORA_TARGETS, PEFT_LORA_KEY, PEFT_NORM_KEY, PEFT_PREFIX, PROJECTIONS, is_expert, peft_name, targets_of,
)
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.lora import LoraSpec, adapted_projections, lora_state_dict
from qerl_pipe.model.norm import RMSNorm
from qerl_pipe.strict_json import write_json

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# Where a train run keeps its adapter; `read_adapter` of the run's directory looks there too.
ADAPTER_DIR = "adapter"


def target_modules(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """PEFT's target_modules for the model's adapters, in the order of `targets`: the module that
    carries each target (`q` -> `q_proj`, or Phi3's fused `qkv_proj`, named once)."""
    adapted = {name for m in model.modules() if isinstance(m, QuantLinear) for name in m.lora_A}
    out: list[str] = []
    for target in targets:
        out += [name for name in sorted(adapted) if target in targets_of(name) and name not in out]
    return out


def adapter_config(model: nn.Module, spec: LoraSpec, base_model: str) -> dict[str, Any]:
    # The trainable norms by their last name part: PEFT's modules_to_save match by suffix.
    norms = sorted({name.rpartition(".")[2] for name, m in model.named_modules()
                    if isinstance(m, RMSNorm) and m.weight.requires_grad}) if spec.train_norms else []
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": spec.rank,
            "lora_alpha": spec.alpha, "lora_dropout": 0.0, "target_modules": target_modules(model, spec.targets),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": norms or None}


def save_adapter(model: nn.Module, spec: LoraSpec, out_dir: Path, base_model: str) -> None:
    """Write the model's trainable tensors and their PEFT config into `out_dir` (created)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in lora_state_dict(model).items()}
    save_safetensors(tensors, out_dir / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    write_json(out_dir / ADAPTER_CONFIG, adapter_config(model, spec, base_model))


@torch.no_grad()
def load_adapter_weights(model: nn.Module, path: Path) -> None:
    """Copy an adapter_model.safetensors (PEFT names) into the model's LoRA/norm tensors, in place."""
    stored = load_file(str(path))
    ours = lora_state_dict(model)
    if stored.keys() != ours.keys():
        missing, extra = sorted(ours.keys() - stored.keys()), sorted(stored.keys() - ours.keys())
        raise ArtifactError(f"{path}: the adapter does not fit this model (missing {missing[:2]}, "
                            f"unexpected {extra[:2]}); was it trained with other lora settings?")
    # copy_ would broadcast a [1, in] tensor into [r, in] silently: compare shapes first.
    wrong = [f"{n} {tuple(stored[n].shape)} (model: {tuple(t.shape)})" for n, t in ours.items()
             if stored[n].shape != t.shape]
    if wrong:
        raise ArtifactError(f"{path}: the adapter's shapes do not fit this model ({wrong[0]}"
                            f"{f' and {len(wrong) - 1} more' if len(wrong) > 1 else ''}); it was trained on "
                            "another base model")
    for name, tensor in ours.items():
        tensor.copy_(stored[name])


# --- reading an adapter written by anyone (us, PEFT, another trainer) --------------------------

# adapter_config.json keys that change what the adapter computes in ways our LoRA does not
# implement; loading such an adapter as plain LoRA would evaluate another model.
_UNSUPPORTED = {
    "use_dora": "DoRA", "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
    "layers_to_transform": "a subset of layers", "fan_in_fan_out": "Conv1D (fan_in_fan_out) weights",
}


@dataclass(frozen=True)
class AdapterFiles:
    """A PEFT LoRA directory, checked and described: what `apply_lora` needs to rebuild it."""

    dir: Path
    spec: LoraSpec
    shapes: dict[str, tuple[int, ...]]  # tensor name -> shape, read from the safetensors header
    config: dict[str, Any]

    @cached_property
    def sha256(self) -> dict[str, str]:
        """The two files' digests, hashed once (an eval's id and its report both name them)."""
        return {name: sha256_file(self.dir / name) for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)}


def find_adapter_dir(path: Path) -> Path | None:
    """The directory holding both adapter files: `path` itself, its `adapter/` (a train run), or
    its only subdirectory that has them (another stage's layout, e.g. an exported adapter)."""
    def holds(d: Path) -> bool:
        return (d / ADAPTER_WEIGHTS).is_file() and (d / ADAPTER_CONFIG).is_file()

    for candidate in (path, path / ADAPTER_DIR):
        if holds(candidate):
            return candidate
    found = [d for d in sorted(path.iterdir()) if d.is_dir() and holds(d)] if path.is_dir() else []
    return found[0] if len(found) == 1 else None


def _adapter_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: not readable JSON ({exc}); it should be PEFT's adapter_config.json") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        peft_type = config.get("peft_type") if isinstance(config, dict) else None
        raise ArtifactError(f"{path}: peft_type {peft_type!r}; only LoRA adapters (peft_type LORA) can be loaded")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ArtifactError(f"{path}: {key} is set ({what}), which this LoRA implementation does not compute; "
                                "export the adapter as plain LoRA")
    if config.get("bias", "none") != "none":
        raise ArtifactError(f"{path}: bias={config['bias']!r} (LoRA bias terms) is not supported; use bias 'none'")
    if not isinstance(config.get("r"), int) or not isinstance(config.get("lora_alpha"), (int, float)):
        raise ArtifactError(f"{path}: 'r' and 'lora_alpha' must be numbers")
    return config


def read_adapter(path: Path) -> AdapterFiles:
    """Check a PEFT LoRA directory without loading its tensors; the spec rebuilds it on our model: targets
    from the tensor names, rank from the A shapes, alpha from the config (rsLoRA's made plain)."""
    adapter_dir = find_adapter_dir(path)
    if adapter_dir is None:
        raise ArtifactError(f"{path} holds no {ADAPTER_WEIGHTS} + {ADAPTER_CONFIG}; pass a train run or a PEFT "
                            "LoRA adapter directory")
    config = _adapter_config(adapter_dir / ADAPTER_CONFIG)
    try:
        with safe_open(str(adapter_dir / ADAPTER_WEIGHTS), framework="pt") as fh:
            shapes = {name: tuple(fh.get_slice(name).get_shape()) for name in fh.keys()}
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise ArtifactError(f"{adapter_dir / ADAPTER_WEIGHTS}: not a readable safetensors file ({exc})") from None
    targets, ranks, norms, unknown, experts = set(), set(), False, [], False
    for name, shape in shapes.items():
        if (m := PEFT_LORA_KEY.match(name)) and f"{m.group(2)}_proj" in PROJECTIONS:
            targets.update(targets_of(f"{m.group(2)}_proj"))
            experts = experts or is_expert(name)
            ranks.add(shape[0] if m.group(3) == "A" else shape[-1])
        elif PEFT_NORM_KEY.match(name):
            norms = True
        else:
            unknown.append(name)
    if unknown or not targets:
        what = unknown[:2] or ["no LoRA tensors"]
        raise ArtifactError(f"{adapter_dir / ADAPTER_WEIGHTS}: {what} cannot be applied to our decoder, which "
                            "takes LoRA on q/k/v/o/gate/up/down_proj (Phi3: qkv_proj, gate_up_proj) and norm weights only")
    if ranks != {config["r"]}:
        raise ArtifactError(f"{adapter_dir}: tensor ranks {sorted(ranks)} differ from r={config['r']} in "
                            f"{ADAPTER_CONFIG}")
    alpha = float(config["lora_alpha"])
    if config.get("use_rslora"):
        alpha *= math.sqrt(config["r"])  # rsLoRA scales by alpha/sqrt(r) = (alpha*sqrt(r))/r
    spec = LoraSpec(config["r"], alpha, tuple(t for t in LORA_TARGETS if t in targets), norms, experts)
    return AdapterFiles(adapter_dir, spec, shapes, config)


@dataclass(frozen=True)
class LoraTensors:
    """An adapter's tensors by Hugging Face parameter name, for merging into a checkpoint."""

    lora: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "<module>.weight" -> (A [r, in], B [out, r])
    norms: dict[str, torch.Tensor]  # "<norm>.weight" -> the trained weight
    scaling: float  # alpha / r, rsLoRA's alpha already converted by `read_adapter`


def lora_tensors(adapter: AdapterFiles) -> LoraTensors:
    """The checked adapter's LoRA factors and trained norms under the base checkpoint's names."""
    tensors = load_file(str(adapter.dir / ADAPTER_WEIGHTS))
    factors: dict[str, dict[str, torch.Tensor]] = {}
    norms: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        if m := re.match(r"^(.*)\.lora_([AB])\.weight$", name):
            factors.setdefault(f"{m.group(1)}.weight", {})[m.group(2)] = tensor
        else:
            norms[name] = tensor
    unpaired = sorted(name for name, ab in factors.items() if len(ab) != 2)
    if unpaired:
        raise ArtifactError(f"{adapter.dir}: {unpaired[0]} has LoRA A without B or B without A")
    lora = {name: (ab["A"], ab["B"]) for name, ab in factors.items()}
    return LoraTensors(lora, norms, adapter.spec.alpha / adapter.spec.rank)


def expected_lora_shapes(hf_config: dict[str, Any], spec: LoraSpec) -> dict[str, tuple[int, ...]]:
    """The LoRA tensors (PEFT names, shapes) `spec` gives a model of this config.json."""
    cfg = DecoderConfig.from_hf(hf_config)
    shapes = {}
    for layer in range(cfg.num_layers):
        # A sparse layer has no dense MLP; its experts carry LoRA only with `spec.experts`.
        blocks = [(f"layers.{layer}.{block}", n_in, projections) for block, _, n_in, projections in cfg.layer_linears()
                  if block != "mlp" or not cfg.is_sparse(layer)]
        if cfg.is_sparse(layer) and spec.experts:
            blocks += [(f"layers.{layer}.{block}.{e}", n_in, projections) for e in range(cfg.num_experts)
                       for block, _, n_in, projections in cfg.expert_linears()]
        for module, n_in, projections in blocks:
            sizes = dict(projections)
            for proj in adapted_projections(tuple(sizes), spec.targets):
                prefix = peft_name(f"{module}.{proj}")
                shapes[f"{prefix}.lora_A.weight"] = (spec.rank, n_in)
                shapes[f"{prefix}.lora_B.weight"] = (sizes[proj], spec.rank)
    return shapes


def check_adapter_fits(adapter: AdapterFiles, hf_config: dict[str, Any], model_name: str) -> None:
    """Refuse, before any weight is read, an adapter made for another model (layers or shapes)."""
    want = expected_lora_shapes(hf_config, adapter.spec)
    have = {n: s for n, s in adapter.shapes.items() if PEFT_LORA_KEY.match(n)}
    missing, extra = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    wrong = [f"{n} {have[n]} (model: {want[n]})" for n in sorted(want.keys() & have.keys()) if have[n] != want[n]]
    if missing or extra or wrong:
        detail = (wrong[:1] and f"shape {wrong[0]}") or (extra[:1] and f"unexpected {extra[0]}") or \
            f"missing {missing[0]}"
        raise ArtifactError(f"the adapter in {adapter.dir} does not fit {model_name} ({detail}); pass the model "
                            "it was trained on, or an adapter trained on this one")


def copy_adapter(adapter_dir: Path, out: Path) -> dict[str, Any]:
    """Copy a PEFT adapter's two files to `out` after checking that they parse (an export must
    never hand on an adapter PEFT cannot load); returns what the export's summary says of it."""
    adapter = read_adapter(adapter_dir)
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        shutil.copy2(adapter_dir / name, out / name)
    return {
        "rank": adapter.config["r"], "alpha": adapter.config["lora_alpha"],
        "lora_modules": sum(name.endswith(".lora_A.weight") for name in adapter.shapes),
        "modules_to_save": adapter.config.get("modules_to_save"),
    }
