"""Versioned, content-addressed artifacts on disk (see `store` and `manifest`)."""

from qerl_pipe.artifacts.manifest import Artifact, artifact_id, find_problems
from qerl_pipe.artifacts.store import ArtifactStore, PendingArtifact, default_root, load_artifact

__all__ = ["Artifact", "ArtifactStore", "PendingArtifact", "artifact_id", "default_root", "find_problems", "load_artifact"]
