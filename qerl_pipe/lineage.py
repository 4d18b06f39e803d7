"""What an artifact was made from, read back from the manifests: a train run's engine, the NVFP4
checkpoint under it, and whether the original model is still there unchanged. Export merges into
that base; it lives here because following parents is the store's knowledge, not a stage's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl_pipe.artifacts import Artifact, ArtifactStore, load_artifact
from qerl_pipe.dag import BUILD_ENGINE, IMPORT, QUANTIZE
from qerl_pipe.errors import ArtifactError, QerlError
from qerl_pipe.formats.checkpoint import detect_quant_format
from qerl_pipe.formats.hf_config import read_model_config
from qerl_pipe.log import log
from qerl_pipe.sources import dir_fingerprint
from qerl_pipe.strict_json import dumps


@dataclass(frozen=True)
class Chain:
    """A run and what it was trained over: engine, its base format, the NVFP4 checkpoint (if any)
    and the recipe + content fingerprint of the original model."""

    run: Artifact
    engine: Artifact
    base_format: str
    quantized: Artifact | None
    model_key: dict[str, Any]


@dataclass(frozen=True)
class MergeBase:
    """The dense weights a merge starts from."""

    dir: Path
    dequantized: bool  # the dir holds NVFP4 weights, dequantized while streaming
    identity: dict[str, Any]  # names it in the artifact id
    parents: list[str]
    description: str


def is_full_run(run: Artifact) -> bool:
    """Whether the run trained every weight (`train.adapter: full`) rather than an adapter."""
    return run.manifest.get("config", {}).get("train", {}).get("adapter") == "full"


def _stored(store: ArtifactStore, stage: str, art_id: str, what: str, run: Artifact) -> Artifact:
    """A parent of the run by id, its manifest only (files are re-hashed when they are read)."""
    path = store.path_for(stage, art_id)
    if not path.is_dir():
        raise ArtifactError(f"run {run.path.name} was trained over {what} {stage}-{art_id}, which is not in "
                            f"{store.root}; export from the store that holds the run's chain (--artifacts), or "
                            "rebuild it with the run's recipe")
    return load_artifact(path, verify=False)


def walk_chain(run: Artifact, store: ArtifactStore) -> Chain:
    """run -> engine -> (NVFP4 checkpoint ->) model source, as the manifests record them."""
    engine_id = run.manifest["parents"][0]
    engine = _stored(store, BUILD_ENGINE.name, engine_id, "engine", run)
    config = engine.manifest["config"]
    base = config["base"]
    quantized = None
    if "quantized" in base:  # by its id among the engine's parents (the config keys its content)
        quantized = _stored(store, QUANTIZE.name, engine.manifest["parents"][0], "NVFP4 checkpoint", run)
        model_key = quantized.manifest["config"]["model"]
    else:
        model_key = base["model"]
    return Chain(run, engine, config["engine"]["base_format"], quantized, model_key)


def _original_model(model_key: dict[str, Any], store: ArtifactStore) -> tuple[Path | None, list[str], str]:
    """The original model directory if it is still there with the same content, else why not. Never downloads or
    imports: only the recorded fingerprint or the import artifact proves these are the weights the base came from."""
    content = model_key.get("content", {})
    source = model_key.get("source", {}).get("source", "?")
    if "artifact" in content:  # a GGUF source, imported once into the store
        try:
            imported = store.find_existing(IMPORT.name, content["artifact"])
        except ArtifactError as exc:
            return None, [], str(exc)
        if imported is None:
            return None, [], f"its imported copy {IMPORT.name}-{content['artifact']} is not in {store.root}"
        return imported.path, [imported.id], ""
    path = Path(content.get("path", ""))
    if not path.is_dir():
        return None, [], f"model source {source} ({path}) no longer exists"
    now = dir_fingerprint(path) | ({"hub_id": content["hub_id"]} if "hub_id" in content else {})
    if now != content:
        return None, [], f"model source {source} ({path}) changed since the run's base was made from it"
    return path, [], ""


def find_merge_base(chain: Chain, store: ArtifactStore) -> MergeBase:
    original, parents, why_not = _original_model(chain.model_key, store)
    if original is not None:
        quant = detect_quant_format(read_model_config(original))
        return MergeBase(original, quant is not None, {"model": chain.model_key}, parents,
                     f"original model {original.name}" + (" (NVFP4, dequantized)" if quant else ""))
    if chain.quantized is not None:
        log(f"export: the original 16-bit weights are not available ({why_not}); merging into the dequantized "
            f"NVFP4 checkpoint {chain.quantized.path.name} instead (the base the run was trained over)")
        load_artifact(chain.quantized.path, verify=True)  # re-hashed: a damaged checkpoint is never merged
        return MergeBase(chain.quantized.path, True, {"quantized": chain.quantized.id}, [chain.quantized.id],
                     f"dequantized NVFP4 checkpoint {chain.quantized.path.name} ({why_not})")
    raise QerlError(f"run {chain.run.path.name}: the base of its {chain.base_format} engine cannot be found "
                    f"({why_not}); put the model source back unchanged, or train a new run over it")


def _frozen_base(engine: Artifact) -> tuple[str, str] | None:
    """(base format, what its weights came from): an NVFP4 engine's quantize artifact, else the read model's content
    fingerprint (not its name: an alias and its directory agree); None when the manifest does not say."""
    config = engine.manifest.get("config", {})
    base, fmt = config.get("base"), config.get("engine", {}).get("base_format")
    if not isinstance(base, dict) or fmt is None:
        return None
    if "quantized" in base:  # the checkpoint's content digest (its id for engines made before)
        return fmt, f"NVFP4 checkpoint {base['quantized']}"
    content = base.get("model", {}).get("content")
    if content is None:
        return None
    return fmt, "model " + dumps(content, sort_keys=True)


def base_mismatch(run: Artifact, engine: Artifact, store: ArtifactStore) -> str | None:
    """None when the run's engine and `engine` hold the same frozen base (perhaps with other limits); else a note
    saying how they differ, or that it cannot be told."""
    trained_on = run.manifest.get("parents", [])
    if engine.id in trained_on:
        return None
    if not trained_on:
        return f"the adapter's run names no engine; evaluated over {engine.id} (the base may differ)"
    try:
        theirs = store.resolve(trained_on[0], verify=False)
    except ArtifactError:
        return (f"the adapter was trained over engine {trained_on[0]}, which is not in this store; evaluated "
                f"over {engine.id} (same shapes; the base weights may differ)")
    base_theirs, base_ours = _frozen_base(theirs), _frozen_base(engine)
    if base_theirs is None or base_ours is None:
        return (f"the adapter was trained over engine {theirs.id}, evaluated over {engine.id}; their manifests "
                "do not say which base each holds (the base weights may differ)")
    if base_theirs == base_ours:
        return None
    return (f"the adapter was trained over engine {theirs.id} ({base_theirs[0]} base from {base_theirs[1]}), "
            f"evaluated over {engine.id} ({base_ours[0]} base from {base_ours[1]}): another base")


def engine_model_name(engine: Artifact, store: ArtifactStore) -> str:
    """The model an engine artifact was made from, as the recipe named it (adapter configs, reports)."""
    base = engine.manifest.get("config", {}).get("base", {})
    model_key = base.get("model")
    if model_key is None and "quantized" in base:
        try:
            model_key = store.resolve(engine.manifest["parents"][0], verify=False).manifest["config"]["model"]
        except (ArtifactError, KeyError):
            model_key = None
    try:
        return str(model_key["source"]["source"])
    except (TypeError, KeyError):
        return str(engine.path)
