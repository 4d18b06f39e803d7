"""The artifact store: a directory of artifacts, each written atomically and named by its inputs.

Written in a hidden sibling and renamed into place once `manifest.json` is in (never a half artifact
under a real name); a per-id file lock makes a concurrent run of the same stage wait, then reuse.
See docs/pipeline.md, section "The artifact store (`qerl_pipe/artifacts/`)"."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_pipe.artifacts.manifest import (
    MANIFEST_NAME, Artifact, artifact_id, build_manifest, find_problems, repair_advice, stage_of,
)
from qerl_pipe.errors import ArtifactError
from qerl_pipe.log import log
from qerl_pipe.strict_json import write_json

ENV_VAR = "QERL_ARTIFACTS"
DEFAULT_ROOT = Path("artifacts")
_TMP_PREFIX = ".tmp-"
# Work directories that outlive a process on purpose (a train run resumes from its checkpoints),
# named like the artifact they become: `<root>/.runs/<stage>-<id>/`.
WORK_DIR = ".runs"


def default_root() -> Path:
    return Path(os.environ.get(ENV_VAR) or DEFAULT_ROOT)


@dataclass
class PendingArtifact:
    """An artifact being written: the stage fills `dir` and `summary`; the store seals it."""

    id: str
    dir: Path
    summary: dict[str, Any] = field(default_factory=dict)
    # Files (relative paths) the stage writes as reports only: no child reads them, so they are
    # left out of the identity children take (`manifest.content_digest`).
    reports: set[str] = field(default_factory=set)


def _read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest; one that cannot be read is the artifact's record lost, so the advice is
    the repair (verify would only read it again)."""
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        why = f"unreadable ({exc})"
    else:
        if isinstance(manifest, dict) and "id" in manifest and isinstance(manifest.get("files"), dict):
            return manifest
        why = "not a qerl-pipe manifest (no id or files)"
    raise ArtifactError(f"{path} is damaged: manifest.json is {why}; {repair_advice(path, stage_of(path))}")


def _parents_first(artifacts: list[Artifact]) -> list[Artifact]:
    """`artifacts` (oldest first) with each one after its parents in the list: `created` counts
    seconds, and a `run` seals several artifacts in one, which then fell back to name order (an
    export above the train run it came from)."""
    by_id = {a.id: a for a in artifacts}
    placed: dict[str, Artifact] = {}

    def place(artifact: Artifact, path: tuple[str, ...]) -> None:
        if artifact.id in placed or artifact.id in path:  # `path`: a hand-edited cycle ends here
            return
        for parent in artifact.manifest.get("parents", []):
            if parent in by_id:
                place(by_id[parent], path + (artifact.id,))
        placed[artifact.id] = artifact

    for artifact in artifacts:
        place(artifact, ())
    return list(placed.values())


def _tmp_owner(path: Path) -> str | None:
    """The artifact a temporary directory `.tmp-[old-]<stage>-<id>-<pid>` belongs to (its lock name)."""
    base, _, pid = path.name[len(_TMP_PREFIX):].removeprefix("old-").rpartition("-")
    return base if base and pid.isdigit() else None


def load_artifact(path: Path, *, verify: bool = True, full: bool = False) -> Artifact:
    """Open the artifact at `path`; with `verify`, refuse it if any file differs from its manifest:
    re-hashing the files whose size or mtime changed since sealing, or every file with `full`."""
    if not (path / MANIFEST_NAME).is_file():
        raise ArtifactError(f"{path} is not an artifact (no manifest.json): it may be incomplete or not made by qerl-pipe")
    artifact = Artifact(path=path, manifest=_read_manifest(path))
    if verify:
        problems = find_problems(artifact, full=full)
        if problems:
            raise ArtifactError(f"artifact {path} is damaged ({problems[0]}{'; ...' if len(problems) > 1 else ''}); "
                                + repair_advice(path, stage_of(path, artifact.manifest), problems))
    return artifact


class ArtifactStore:
    """A store directory. `full_verify` (the CLI's --verify) hashes every byte of each artifact it
    opens; by default only files whose size or mtime changed since sealing are re-hashed."""

    def __init__(self, root: Path | None = None, *, full_verify: bool = False) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.full_verify = full_verify

    def path_for(self, stage: str, art_id: str) -> Path:
        return self.root / f"{stage}-{art_id}"

    def work_dir_for(self, stage: str, art_id: str) -> Path:
        """Where a resumable stage works on artifact `art_id` until it is sealed (kept when killed)."""
        return self.root / WORK_DIR / f"{stage}-{art_id}"

    def survey(self) -> tuple[list[Artifact], list[tuple[Path, str]]]:
        """One pass over the store (each manifest read once): the sealed artifacts, oldest first and each
        after its parents, and what that leaves out with its state (damaged, in progress, abandoned,
        interrupted), as `ls` shows them."""
        self._refuse_a_file_root()  # else `ls` says "no artifacts in FILE" and `show` finds nothing
        if not self.root.is_dir():
            return [], []
        found: list[Artifact] = []
        unfinished: list[tuple[Path, str]] = []
        for path in sorted(self.root.iterdir()):
            if not path.is_dir():
                continue
            if path.name.startswith(_TMP_PREFIX):
                owner = _tmp_owner(path)
                busy = owner is None or self._lock_is_held(owner)
                unfinished.append((path, "in progress" if busy else "abandoned (the next run on this store removes it)"))
            elif path.name == WORK_DIR:
                unfinished += [(work, "in progress" if self._lock_is_held(work.name) else
                                "interrupted (the same command resumes it; --force starts it over)")
                               for work in sorted(path.iterdir()) if work.is_dir()]
            elif not path.name.startswith(".") and (path / MANIFEST_NAME).is_file():
                try:
                    found.append(Artifact(path=path, manifest=_read_manifest(path)))
                except ArtifactError as exc:
                    unfinished.append((path, f"damaged: {exc}"))
        return _parents_first(sorted(found, key=lambda a: a.manifest.get("created", ""))), unfinished

    @contextmanager
    def _holding_if_free(self, name: str) -> Iterator[bool]:
        """Take `name`'s lock without waiting; yields whether it was free (and is now ours). A lock
        file that does not exist is free: a writer creates it before its temporary directory."""
        try:
            fh = (self.root / ".locks" / f"{name}.lock").open("r")
        except FileNotFoundError:
            yield True
            return
        with fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _lock_is_held(self, name: str) -> bool:
        with self._holding_if_free(name) as free:
            return not free

    def _sweep_abandoned(self, own: str) -> None:
        """Remove the temporary directories of killed runs (possibly gigabytes each). A writer holds
        its artifact's lock for as long as its directory exists, so a directory whose lock is free is
        abandoned; it is removed under that lock, so no new writer of it can start meanwhile. The
        caller holds `own`'s lock: its leftovers (a killed `--force` rebuild's too) go at once."""
        for path in self.root.glob(f"{_TMP_PREFIX}*"):
            owner = _tmp_owner(path)
            if owner == own:
                shutil.rmtree(path, ignore_errors=True)
            elif owner is not None:
                with self._holding_if_free(owner) as free:
                    if free:
                        shutil.rmtree(path, ignore_errors=True)

    def resolve(self, ref: str, *, verify: bool = True) -> Artifact:
        """Find an artifact by path, by directory name, or by a unique prefix of its id or directory
        name ('5b6ac2', 'train-5b6a'). A damaged artifact is found as well, and refused with its repair."""
        as_path = Path(ref)
        if as_path.is_dir():
            return self._open(as_path, verify)
        if ref and (self.root / ref).is_dir():
            return self._open(self.root / ref, verify)
        matches = self._starting_with(ref) if ref else []
        if not matches:
            raise ArtifactError(f"no artifact '{ref}' in {self.root}; `qerl-pipe ls` lists the artifacts there")
        if len(matches) > 1:
            names = ", ".join(path.name for path in matches)
            raise ArtifactError(f"'{ref}' matches {len(matches)} artifacts in {self.root} ({names}); "
                                "give more of the id")
        return self._open(matches[0], verify)

    def identities(self, parents: list[str]) -> list[str]:
        """What a child's id takes of each parent (by id): its `Artifact.identity` when it is in this
        store, else the id itself."""
        found = [self._starting_with(parent) if parent else [] for parent in parents]
        return [self._open(f[0], verify=False).identity if len(f) == 1 else p for p, f in zip(parents, found)]

    def artifact_id_for(self, stage: str, stage_version: int, config: dict[str, Any], parents: list[str]) -> str:
        """The id `create` gives the artifact of these inputs (`identities` of the parents)."""
        return artifact_id(stage, stage_version, config, self.identities(parents))

    def _starting_with(self, prefix: str) -> list[Path]:
        """Artifact directories '<stage>-<id>' (damaged ones too) whose name or id starts with `prefix`."""
        self._refuse_a_file_root()
        if not self.root.is_dir():
            return []
        return [path for path in sorted(self.root.iterdir())
                if path.is_dir() and not path.name.startswith(".") and (path / MANIFEST_NAME).is_file()
                and (path.name.startswith(prefix) or path.name.rpartition("-")[2].startswith(prefix))]

    def _open(self, path: Path, verify: bool) -> Artifact:
        return load_artifact(path, verify=verify, full=self.full_verify)

    def sealed(self, stage: str, art_id: str) -> Artifact:
        """The artifact this process has just sealed: its manifest was made from these very files,
        so they are not read again."""
        return load_artifact(self.path_for(stage, art_id), verify=False)

    @contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        lock_dir = self.root / ".locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        with (lock_dir / f"{name}.lock").open("w") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a silent wait of hours (a train) looks like a hang: say who we wait for
                log(f"waiting for another process that is making {name} in {self.root} to finish "
                    "(then its artifact is reused)")
                fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def find_existing(self, stage: str, art_id: str) -> Artifact | None:
        """The up-to-date artifact for these inputs, or None; a foreign directory there is an error."""
        path = self.path_for(stage, art_id)
        if not path.exists():
            return None
        if not (path / MANIFEST_NAME).is_file():
            raise ArtifactError(f"{path} exists but is not a qerl-pipe artifact; move it away (qerl-pipe never deletes "
                                "what it did not make)")
        return self._open(path, True)

    @contextmanager
    def create(self, *, stage: str, stage_version: int, kind: str, config: dict[str, Any], parents: list[str],
               force: bool = False) -> Iterator[tuple[PendingArtifact | None, Artifact | None]]:
        """Yield `(pending, None)` to build a new artifact into `pending.dir` (sealed and renamed into place
        on a clean exit, removed on an exception), or `(None, existing)` when one is up to date."""
        identities = self.identities(parents)
        art_id = artifact_id(stage, stage_version, config, identities)
        final = self.path_for(stage, art_id)
        with ExitStack() as held:
            blocked = self._enter_lock(held, final.name)
            if blocked is not None:
                yield None, self._reuse_unlocked(stage, art_id, blocked, force)
                return
            existing = None
            try:
                existing = self.find_existing(stage, art_id)
            except ArtifactError:
                if not force or not (final / MANIFEST_NAME).is_file():
                    raise
            # Under this artifact's lock no live process writes one: any temporary directory of it
            # is what a killed run left, so it goes, also when this run only reuses (`ls` promises
            # it); so do other artifacts' whose lock is free.
            self._sweep_abandoned(final.name)
            if existing is not None and not force:
                yield None, existing
                return
            tmp = self.root / f"{_TMP_PREFIX}{final.name}-{os.getpid()}"
            tmp.mkdir()
            pending = PendingArtifact(id=art_id, dir=tmp)
            try:
                yield pending, None
                manifest = build_manifest(art_id=art_id, kind=kind, stage=stage, stage_version=stage_version,
                                          config=config, parents=parents, root=tmp, summary=pending.summary,
                                          reports=frozenset(pending.reports), identities=identities)
                write_json(tmp / MANIFEST_NAME, manifest)
                trash = self.root / f"{_TMP_PREFIX}old-{final.name}-{os.getpid()}"
                if final.exists():  # an old artifact (only with --force) is moved aside first
                    os.rename(final, trash)
                os.rename(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise

    def _refuse_a_file_root(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise ArtifactError(f"the artifact store {self.root} is a file, not a directory; "
                                "pass a directory to --artifacts (or QERL_ARTIFACTS)")

    def _enter_lock(self, held: ExitStack, name: str) -> OSError | None:
        """Create the store directory (a path that cannot be one is an error naming --artifacts) and take the
        artifact's lock in `held`; the OSError of a store we may not write, else None."""
        self._refuse_a_file_root()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            held.enter_context(self._lock(name))
        except (FileExistsError, NotADirectoryError):
            raise ArtifactError(f"cannot create the artifact store {self.root}: a part of the path is a file; "
                                "pass a directory to --artifacts (or QERL_ARTIFACTS)") from None
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            return exc
        return None

    def _reuse_unlocked(self, stage: str, art_id: str, blocked: OSError, force: bool) -> Artifact:
        """In a store this user may only read, an up-to-date artifact is still reusable: a sealed
        artifact never changes, so reading it needs no lock. Anything else needs a writable store."""
        existing = None if force else self.find_existing(stage, art_id)
        if existing is None:
            why = "--force re-creates the artifact" if force else f"{stage} has no up-to-date artifact there"
            raise ArtifactError(f"the artifact store {self.root} is not writable ({blocked.strerror}) and {why}; "
                                "pass a writable directory to --artifacts (or QERL_ARTIFACTS)")
        return existing


def _holds_copy(output: Path, art_id: str) -> bool:
    """Whether `output` is an intact copy of artifact `art_id` (the same command run again)."""
    if not (output / MANIFEST_NAME).is_file():
        return False
    try:
        copy = load_artifact(output, verify=True)
    except ArtifactError:
        return False
    return copy.id == art_id


def check_output_dir(output: Path | None, art_id: str) -> bool:
    """Refuse, before any work, an `--output` that exists and holds anything but artifact `art_id`;
    returns whether it holds an intact copy of it already (so the copy is not checked again)."""
    if output is None or not output.exists():
        return False
    if _holds_copy(output, art_id):
        return True
    _refuse_occupied(output)
    return False


def _refuse_occupied(output: Path) -> None:
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ArtifactError(f"output directory {output} exists and is not empty; choose a new path (nothing was written)")


def copy_to(artifact: Artifact, output: Path) -> bool:
    """Copy a sealed artifact to a user-chosen directory, atomically (temp sibling, then rename);
    a directory that already holds this very artifact is left as it is (returns False)."""
    if _holds_copy(output, artifact.id):  # re-hashes the copy: once per command, here
        return False
    _refuse_occupied(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".tmp-{output.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(artifact.path, tmp)
    if output.exists():
        output.rmdir()  # checked empty above
    tmp.rename(output)
    return True


def link_tree(src: Path, dst: Path) -> None:
    """Hard-link every file of src into dst (same file system: instant, no second copy); copy when
    links are not possible. The work directory stays whole until the artifact is sealed."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, dst, copy_function=link, dirs_exist_ok=True)
