"""The manifest: what an artifact is, where it came from, and every file's sha256, size and mtime.

Written last, so its presence marks a complete artifact; its id must follow from its stage, config and
parents, and its `digest` (the sha256 of the rest) catches an edited summary.
See docs/pipeline.md, section "The artifact store (`qerl_pipe/artifacts/`)"."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import qerl_pipe
from qerl_pipe.strict_json import dumps

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1
_HASH_CHUNK = 1 << 22


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace: equal configs give equal text, hence equal ids."""
    return dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def artifact_id(stage: str, stage_version: int, config: dict[str, Any], parents: list[str]) -> str:
    """The id names the inputs, not the output: the same stage, config and parents give the same id."""
    key = canonical_json({"stage": stage, "version": stage_version, "config": config, "parents": sorted(parents)})
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def describe_files(root: Path) -> dict[str, dict[str, Any]]:
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
        stat = path.stat()
        files[path.relative_to(root).as_posix()] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                                   "sha256": sha256_file(path)}
    return files


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest without its digest, as it reads back from JSON (tuples are lists)."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(canonical_json(json.loads(dumps(body))).encode()).hexdigest()


def build_manifest(*, art_id: str, kind: str, stage: str, stage_version: int, config: dict[str, Any],
                   parents: list[str], root: Path, summary: dict[str, Any], reports: frozenset[str],
                   identities: list[str]) -> dict[str, Any]:
    files = describe_files(root)
    manifest = {
        "schema_version": SCHEMA_VERSION, "id": art_id, "kind": kind,
        "stage": {"name": stage, "version": stage_version}, "config": config, "parents": parents,
        "parent_identities": identities,  # what the id took of each parent (`Artifact.identity`)
        "files": files,
        **({"reports": sorted(reports), "content": content_digest(files, reports)} if reports else {}),
        "package": {"name": "qerl-pipe", "version": qerl_pipe.__version__},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "summary": summary,
    }
    manifest["digest"] = manifest_digest(manifest)
    return manifest


def content_digest(files: dict[str, dict[str, Any]], reports: frozenset[str] | set[str]) -> str:
    """What a child reads of an artifact that declares reports (files no child reads): its other files by
    sha256. A child's id takes this instead of the parent's id, so a setting that changes only a report
    (quantize's quality report) makes a new parent whose children are reused. Artifacts without reports
    keep their id as identity: some of their files carry build times (engine.json)."""
    kept = {name: meta["sha256"] for name, meta in files.items() if name not in reports}
    return hashlib.sha256(canonical_json(kept).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Artifact:
    """A complete artifact on disk: its directory and its parsed manifest."""

    path: Path
    manifest: dict[str, Any]

    @property
    def id(self) -> str:
        return self.manifest["id"]

    @property
    def identity(self) -> str:
        """What its children's ids take: the digest of the files they read (`content_digest`);
        the id itself for an artifact made before manifests recorded it (its children keep their ids)."""
        return self.manifest.get("content", self.id)

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def stage(self) -> str:
        return self.manifest["stage"]["name"]

    @property
    def summary(self) -> dict[str, Any]:
        return self.manifest.get("summary", {})


class Problem(str):
    """One way an artifact differs from its manifest. `kind` picks the cheapest repair:
    'extra' (a file it does not list: remove it), 'file' (a listed file missing or changed) or
    'manifest' (the manifest itself edited): re-create the artifact."""

    kind: str

    def __new__(cls, text: str, kind: str) -> "Problem":
        problem = super().__new__(cls, text)
        problem.kind = kind
        return problem


def manifest_problems(manifest: dict[str, Any]) -> list[Problem]:
    """Edits of the manifest itself: an id that its inputs do not give, or a digest that differs."""
    problems = []
    try:
        expected = artifact_id(manifest["stage"]["name"], manifest["stage"]["version"], manifest["config"],
                               manifest.get("parent_identities", manifest["parents"]))
    except (KeyError, TypeError):
        return [Problem(f"{MANIFEST_NAME}: lacks its stage, config or parents (edited by hand)", "manifest")]
    if expected != manifest.get("id"):
        problems.append(Problem(f"{MANIFEST_NAME}: id {manifest.get('id')} does not follow from its stage, config and "
                                f"parents ({expected}): edited by hand", "manifest"))
    if "content" in manifest and manifest["content"] != content_digest(manifest.get("files", {}),
                                                                       set(manifest.get("reports", []))):
        problems.append(Problem(f"{MANIFEST_NAME}: its content digest does not follow from its files: edited by hand",
                                "manifest"))
    if "digest" in manifest and manifest["digest"] != manifest_digest(manifest):  # older manifests have none
        problems.append(Problem(f"{MANIFEST_NAME}: edited after the artifact was made (its digest differs)", "manifest"))
    return problems


def find_problems(artifact: Artifact, *, full: bool = True) -> list[Problem]:
    """Every way the files differ from the manifest, and the manifest from itself. `full=False` (on reuse)
    re-hashes only files whose size or mtime changed since sealing (or that have no recorded mtime)."""
    problems = manifest_problems(artifact.manifest)
    listed = artifact.manifest.get("files", {})
    for rel, meta in listed.items():
        path = artifact.path / rel
        if not path.is_file():
            problems.append(Problem(f"{rel}: missing", "file"))
            continue
        stat = path.stat()
        if stat.st_size != meta["size"]:
            problems.append(Problem(f"{rel}: size {stat.st_size} bytes, manifest says {meta['size']} (truncated or "
                                    "replaced)", "file"))
        elif (full or stat.st_mtime_ns != meta.get("mtime_ns")) and sha256_file(path) != meta["sha256"]:
            problems.append(Problem(f"{rel}: sha256 differs from the manifest (the file was edited or damaged)", "file"))
    for path in sorted(artifact.path.rglob("*")):
        rel = path.relative_to(artifact.path).as_posix()
        if path.is_file() and path.name != MANIFEST_NAME and rel not in listed:
            problems.append(Problem(f"{rel}: not listed in the manifest (added after the artifact was made)", "extra"))
    return problems


def stage_of(path: Path, manifest: dict[str, Any] | None = None) -> str:
    """The stage that made an artifact: its manifest's, else its directory name's `<stage>-<id>`."""
    try:
        return str(manifest["stage"]["name"])  # type: ignore[index]
    except (TypeError, KeyError):
        return path.name.rsplit("-", 1)[0] if "-" in path.name else "the stage that made it"


def repair_advice(path: Path, stage: str, problems: list[Problem] | None = None) -> str:
    """The cheapest fix: remove files added to an intact artifact, else re-create it with --force
    on the stage that made it (which may not be the command that found it: a damaged parent)."""
    if problems and all(p.kind == "extra" for p in problems):
        added = ", ".join(str(path / p.split(":", 1)[0]) for p in problems[:3])
        return f"remove what its manifest does not list ({added}{', ...' if len(problems) > 3 else ''}); its own files are intact"
    if stage == "import":
        return f"remove {path}; the next command that needs the model imports it again"
    return f"re-create it with `qerl-pipe {stage} --force` (with the recipe and inputs that made it)"
