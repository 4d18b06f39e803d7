"""The manifest: what an artifact is, where it came from, and the hash of every file in it.

`manifest.json` is written last, so its presence marks a complete artifact; the per-file sha256
lets `verify` catch a truncated or edited file before anything reads it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import qerl_pipe

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
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def artifact_id(stage: str, stage_version: int, config: dict[str, Any], parents: list[str]) -> str:
    """The id names the inputs, not the output: the same stage, config and parents give the same id."""
    key = canonical_json({"stage": stage, "version": stage_version, "config": config, "parents": sorted(parents)})
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def describe_files(root: Path) -> dict[str, dict[str, Any]]:
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
        files[path.relative_to(root).as_posix()] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return files


def build_manifest(
    *,
    art_id: str,
    kind: str,
    stage: str,
    stage_version: int,
    config: dict[str, Any],
    parents: list[str],
    root: Path,
    summary: dict[str, Any],
) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "id": art_id,
        "kind": kind,
        "stage": {"name": stage, "version": stage_version},
        "config": config,
        "parents": parents,
        "files": describe_files(root),
        "package": {"name": "qerl-pipe", "version": qerl_pipe.__version__},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "summary": summary,
    }


@dataclass(frozen=True)
class Artifact:
    """A complete artifact on disk: its directory and its parsed manifest."""

    path: Path
    manifest: dict[str, Any]

    @property
    def id(self) -> str:
        return self.manifest["id"]

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def stage(self) -> str:
        return self.manifest["stage"]["name"]

    @property
    def summary(self) -> dict[str, Any]:
        return self.manifest.get("summary", {})


def find_problems(artifact: Artifact, *, full: bool = True) -> list[str]:
    """Every way the files differ from the manifest; `full=False` checks sizes only (fast)."""
    problems = []
    listed = artifact.manifest.get("files", {})
    for rel, meta in listed.items():
        path = artifact.path / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
            continue
        size = path.stat().st_size
        if size != meta["size"]:
            problems.append(f"{rel}: size {size} bytes, manifest says {meta['size']} (truncated or replaced)")
        elif full and sha256_file(path) != meta["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest (the file was edited or damaged)")
    for path in artifact.path.rglob("*"):
        rel = path.relative_to(artifact.path).as_posix()
        if path.is_file() and path.name != MANIFEST_NAME and rel not in listed:
            problems.append(f"{rel}: not listed in the manifest (added after the artifact was made)")
    return problems
