"""What `qerl-pipe eval` is pointed at (--model, --adapter), resolved to artifacts before any engine
is built or weight read. Nothing is built unless the call builds (`--build-missing`, `qerl-pipe run`):
not an engine, and not the import of a GGUF source. See docs/eval.md, section "Inputs"."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qerl_pipe.artifacts import Artifact, ArtifactStore, load_artifact
from qerl_pipe.artifacts.manifest import MANIFEST_NAME
from qerl_pipe.dag import BUILD_ENGINE, EVAL, QUANTIZE, TRAIN, MissingArtifact
from qerl_pipe.errors import ArtifactError, QerlError
from qerl_pipe.formats.hf_config import read_model_config
from qerl_pipe.lineage import engine_model_name, is_full_run
from qerl_pipe.model.peft import AdapterFiles, read_adapter
from qerl_pipe.recipe import Recipe
from qerl_pipe.runner import StageCall
from qerl_pipe.sources import ALIASES, resolve_model


@dataclass(frozen=True)
class AdapterInput:
    """The adapter to apply: its checked files, and the artifact holding them when there is one."""

    files: AdapterFiles
    artifact: Artifact | None

    def identity(self) -> dict[str, Any]:
        """What names the adapter in the eval's id: the artifact (its manifest hashes every file),
        or the content of a plain directory (so an edited adapter is never mistaken for the old one)."""
        if self.artifact is not None:
            return {"artifact": self.artifact.id, "subdir": self.files.dir.relative_to(self.artifact.path).as_posix()}
        return {"sha256": self.files.sha256}


def open_adapter(adapter: Path | Artifact | str, store: ArtifactStore) -> AdapterInput:
    """A train run, any artifact or directory holding a PEFT LoRA adapter (itself or `adapter/`),
    or a store reference (id prefix, directory name) to one."""
    if isinstance(adapter, str):
        path = Path(adapter)
        # A path-like reference is a directory; anything else may name an artifact in the store.
        adapter = path if path.is_dir() or "/" in adapter or adapter.startswith(".") else store.resolve(adapter)
    if isinstance(adapter, Path) and (adapter / MANIFEST_NAME).is_file():
        adapter = load_artifact(adapter)  # an artifact given by path: verified, and it becomes a parent
    if isinstance(adapter, Artifact):
        if adapter.kind in (BUILD_ENGINE.kind, QUANTIZE.kind, EVAL.kind):
            raise ArtifactError(f"{adapter.path} is a '{adapter.kind}' artifact, not an adapter; pass a train run "
                                "(or an exported PEFT adapter) to --adapter")
        if adapter.kind == TRAIN.kind and is_full_run(adapter):
            raise ArtifactError(f"{adapter.path} trained every weight (train.adapter=full) and has no adapter; "
                                f"evaluate its model: `qerl-pipe export --run {adapter.path} --format merged-bf16`, "
                                "then pass that export to --model")
        return AdapterInput(read_adapter(adapter.path), adapter)
    if not adapter.is_dir():
        raise ArtifactError(f"adapter {adapter} does not exist; pass a train run or a directory with "
                            "adapter_model.safetensors + adapter_config.json")
    return AdapterInput(read_adapter(adapter), None)


@dataclass(frozen=True)
class ModelTarget:
    """What --model named, before anything is built: an engine, or what the recipe builds one from."""

    engine: Artifact | None
    quantized: Artifact | None
    recipe: Recipe  # with model.source set when a model source was named
    hf_config: dict[str, Any]
    name: str


def _no_engine(target: str, call: StageCall, exc: MissingArtifact) -> QerlError:
    return QerlError(f"eval needs an engine for {target}, and the recipe's is not in {call.store.root}: run "
                     f"`qerl-pipe build-engine` with the same recipe and model{exc.first(BUILD_ENGINE.name)}, pass --model ENGINE, or "
                     "add --build-missing")


def _source_target(source: str | None, call: StageCall) -> ModelTarget:
    recipe = call.recipe
    if source is not None:
        recipe = recipe.model_copy(deep=True)
        recipe.model.source = source
    try:
        resolved = resolve_model(recipe.model, call.store, find_only=not call.builds)
    except MissingArtifact:
        try:  # a GGUF source not imported yet has no engine either: the lookup names the first stage to run
            call.artifact_for(BUILD_ENGINE, recipe, {})
        except MissingArtifact as exc:
            raise _no_engine(recipe.model.source, call, exc) from None
        raise
    return ModelTarget(None, None, recipe, resolved.config, recipe.model.source)


def resolve_model_target(ref: str | Path | Artifact | None, call: StageCall) -> ModelTarget:
    """--model: an engine; a quantize checkpoint or a model source (the recipe's engine section makes its engine);
    None = the recipe's model. Builds nothing (not a GGUF source's import) unless the call builds."""
    store = call.store
    if ref is None:
        return _source_target(None, call)
    artifact = ref if isinstance(ref, Artifact) else None
    if isinstance(ref, str):
        path = Path(ref)
        if path.is_dir() and (path / MANIFEST_NAME).is_file():
            artifact = load_artifact(path)
        elif path.is_dir() or ref in ALIASES or ref.startswith("pkg:") or ref.endswith(".gguf") or "/" in ref:
            return _source_target(ref, call)
        else:
            artifact = store.resolve(ref)
    assert artifact is not None
    recipe = call.recipe
    if artifact.kind == BUILD_ENGINE.kind:
        return ModelTarget(artifact, None, recipe, read_model_config(artifact.path), engine_model_name(artifact, store))
    if artifact.kind == QUANTIZE.kind:
        return ModelTarget(None, artifact, recipe, read_model_config(artifact.path), artifact.path.name)
    if artifact.kind == TRAIN.kind:
        raise ArtifactError(f"{artifact.path} is a train run (an adapter), not a model; pass it to --adapter and "
                            "its engine to --model")
    # An artifact that is itself a Hugging Face model directory (an imported GGUF, a merged export).
    if (artifact.path / "config.json").is_file() and any(artifact.path.glob("*.safetensors")):
        return _source_target(str(artifact.path), call)
    raise ArtifactError(f"{artifact.path} is a '{artifact.kind}' artifact, not a model; --model takes an engine "
                        "(build-engine), a quantize checkpoint, or a model source")


def build_target_engine(target: ModelTarget, call: StageCall) -> Artifact:
    """The engine --model names, or the one the recipe builds from the checkpoint or model source it
    names: found in the store, built (with its own missing inputs) only when the call builds."""
    if target.engine is not None:
        return target.engine
    made = {QUANTIZE.name: target.quantized} if target.quantized is not None else {}
    try:
        return call.artifact_for(BUILD_ENGINE, target.recipe, made)
    except MissingArtifact as exc:
        raise _no_engine(target.name, call, exc) from None
