"""An engine artifact as train and eval open it: `load_engine` (the model with its base in the
kernels' layout, its limits, its dispatch table) and `check_engine_for`. The build-engine stage
writes what these read; they live here so that the stages that read an engine import no stage."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from qerl_pipe.artifacts import Artifact, load_artifact
from qerl_pipe.engine.limits import EngineLimits
from qerl_pipe.jobs.engine_weights import load_engine_model
from qerl_pipe.errors import ArtifactError, QerlError
from qerl_pipe.kernels import dispatch
from qerl_pipe.kernels.dispatch import DispatchTable
from qerl_pipe.log import log
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.lora import LoraSpec

ENGINE_FILE = "engine.json"
ENGINE_FORMAT_VERSION = 1
KIND = "engine"  # the artifact kind build-engine makes (dag.BUILD_ENGINE declares it)


def device_kind(device: torch.device) -> str:
    """The GPU's name (or 'cpu'): engines are tuned per GPU, so it names the engine."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def check_engine_for(engine: Artifact, stage: str, max_new_tokens: int) -> None:
    """Refuse an engine whose sequences cannot hold `max_new_tokens` after a prompt (its kind is checked where
    it was passed: `runner.StageCall`, `eval_inputs`); `stage` names the recipe section ('train', 'eval')."""
    max_seq_len = engine.summary.get("max_seq_len")
    if max_seq_len is not None and max_new_tokens >= max_seq_len:
        raise QerlError(f"{stage}.max_new_tokens={max_new_tokens} leaves no room for a prompt in the engine's "
                        f"max_seq_len={max_seq_len}; lower {stage}.max_new_tokens or build the engine with a larger "
                        "engine.max_seq_len")


def read_engine_json(path: Path) -> dict[str, Any]:
    """The engine's engine.json, checked: unreadable or of another format is an ArtifactError."""
    try:
        engine = json.loads((path / ENGINE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: cannot read {ENGINE_FILE} ({exc}); rebuild the engine with --force") from None
    if engine.get("format_version") != ENGINE_FORMAT_VERSION:
        raise ArtifactError(f"{path}: engine format {engine.get('format_version')!r} is not "
                            f"{ENGINE_FORMAT_VERSION}; rebuild the engine with --force")
    return engine


def load_engine(artifact_dir: Path | str, device: torch.device | str | None = None,
                lora: LoraSpec | None = None) -> tuple[Decoder, EngineLimits]:
    """The engine's model on `device` (default: the device type it was built for) and its limits; installs
    its dispatch table and schedule column (or the table shipped for this GPU) process-wide (an old
    engine.json's `kernel_table` is not read). Does not re-hash the files (`ArtifactStore.resolve` does)."""
    path = Path(artifact_dir)
    artifact = load_artifact(path, verify=False)
    if artifact.kind != KIND:
        raise ArtifactError(f"{path} is a '{artifact.kind}' artifact, not an engine; run `qerl-pipe build-engine`")
    engine = read_engine_json(path)
    built = engine["device"]
    if device is None and built["type"] == "cuda" and not torch.cuda.is_available():
        raise QerlError(f"{path.name} was built for {built['name']} but no CUDA GPU is visible; "
                        "pass device='cpu' to load it anyway")
    target = torch.device(built["type"] if device is None else device)
    if target.type != built["type"] or (target.type == "cuda" and device_kind(target) != built["name"]):
        log(f"build-engine: {path.name} was built and tuned for {built['name']}, loading on "
            f"{device_kind(target)}; its limits and dispatch table may not suit it (rebuild there)")
    model = load_engine_model(path, target, lora)
    if model.base_format != engine["base_format"]:
        raise ArtifactError(f"{path}: weights are {model.base_format} but {ENGINE_FILE} says "
                            f"{engine['base_format']}; rebuild the engine with --force")
    measured = engine.get("dispatch_table")
    dispatch.configure(DispatchTable.from_json(measured) if measured else dispatch.table_for(target),
                       deterministic=engine.get("deterministic", True))
    return model, EngineLimits.from_json(engine["limits"])

