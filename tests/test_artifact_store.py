"""The artifact store: ids from inputs, atomic writes, reuse, --force, damage detection, locking."""

import json
import multiprocessing
from pathlib import Path

import pytest

from qerl_pipe.artifacts import ArtifactStore, artifact_id, find_problems
from qerl_pipe.errors import ArtifactError


def make(store: ArtifactStore, config: dict, *, force: bool = False, payload: bytes = b"data", fail: bool = False):
    with store.create(stage="demo", stage_version=1, kind="demo-kind", config=config,
                      parents=["p1"], force=force) as (pending, existing):
        if existing is not None:
            return existing, False
        (pending.dir / "sub").mkdir()
        (pending.dir / "sub" / "blob.bin").write_bytes(payload)
        pending.summary["n"] = 1
        if fail:
            raise RuntimeError("stage crashed")
    return store.find_existing("demo", pending.id), True


def test_id_depends_on_inputs_only():
    a = artifact_id("s", 1, {"x": 1, "y": [1, 2]}, ["b", "a"])
    assert a == artifact_id("s", 1, {"y": [1, 2], "x": 1}, ["a", "b"])
    assert a != artifact_id("s", 2, {"x": 1, "y": [1, 2]}, ["a", "b"])
    assert a != artifact_id("s", 1, {"x": 2, "y": [1, 2]}, ["a", "b"])
    assert a != artifact_id("s", 1, {"x": 1, "y": [1, 2]}, ["a"])


def test_create_then_reuse(tmp_path):
    store = ArtifactStore(tmp_path)
    first, created = make(store, {"k": 1})
    assert created
    manifest = json.loads((first.path / "manifest.json").read_text())
    assert manifest["kind"] == "demo-kind" and manifest["stage"] == {"name": "demo", "version": 1}
    assert manifest["parents"] == ["p1"] and manifest["summary"] == {"n": 1}
    assert manifest["files"]["sub/blob.bin"]["size"] == 4
    assert manifest["package"]["name"] == "qerl-pipe" and manifest["created"]
    again, created = make(store, {"k": 1})
    assert not created and again.path == first.path
    other, created = make(store, {"k": 2})
    assert created and other.path != first.path
    assert [a.id for a in store.list()] == [first.id, other.id]


def test_crash_leaves_nothing(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(RuntimeError):
        make(store, {"k": 1}, fail=True)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".locks")] == []


def test_force_replaces(tmp_path):
    store = ArtifactStore(tmp_path)
    first, _ = make(store, {"k": 1}, payload=b"old")
    second, created = make(store, {"k": 1}, force=True, payload=b"new!")
    assert created and second.path == first.path
    assert (second.path / "sub" / "blob.bin").read_bytes() == b"new!"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_damage_is_detected_and_never_reused(tmp_path):
    store = ArtifactStore(tmp_path)
    art, _ = make(store, {"k": 1})
    blob = art.path / "sub" / "blob.bin"
    blob.write_bytes(b"dat4")  # same size, one byte flipped
    assert any("sha256" in p for p in find_problems(art))
    with pytest.raises(ArtifactError, match="damaged"):
        make(store, {"k": 1})
    blob.write_bytes(b"da")  # truncated
    assert any("truncated" in p for p in find_problems(art))
    (art.path / "extra.txt").write_text("x")
    assert any("not listed" in p for p in find_problems(art))
    repaired, created = make(store, {"k": 1}, force=True)
    assert created and find_problems(repaired) == []


def test_foreign_directory_is_never_touched(tmp_path):
    store = ArtifactStore(tmp_path)
    art_id = artifact_id("demo", 1, {"k": 1}, ["p1"])
    mine = store.path_for("demo", art_id)
    mine.mkdir(parents=True)
    (mine / "precious.txt").write_text("user data")
    for force in (False, True):
        with pytest.raises(ArtifactError, match="not a qerl-pipe artifact"):
            make(store, {"k": 1}, force=force)
    assert (mine / "precious.txt").read_text() == "user data"


def test_resolve_by_path_name_and_prefix(tmp_path):
    store = ArtifactStore(tmp_path)
    art, _ = make(store, {"k": 1})
    assert store.resolve(str(art.path)).id == art.id
    assert store.resolve(art.path.name).id == art.id
    assert store.resolve(art.id[:6]).id == art.id
    with pytest.raises(ArtifactError, match="no artifact"):
        store.resolve("ffffffffffff")


def _worker(root: str, queue) -> None:
    store = ArtifactStore(Path(root))
    art, created = make(store, {"k": "concurrent"}, payload=b"x" * 100_000)
    queue.put((str(art.path), created))


def test_concurrent_runs_make_one_artifact(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    results = [queue.get(timeout=5) for _ in procs]
    assert len({path for path, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    assert find_problems(ArtifactStore(tmp_path).resolve(results[0][0])) == []


def test_a_killed_run_leftover_is_removed_when_the_artifact_is_made(tmp_path):
    """SIGKILL skips every cleanup: the temporary directory stays until that artifact is made."""
    store = ArtifactStore(tmp_path)
    art_id = artifact_id("demo", 1, {"k": 1}, ["p1"])
    leftover = tmp_path / f".tmp-{store.path_for('demo', art_id).name}-999999"
    (leftover / "sub").mkdir(parents=True)
    (leftover / "sub" / "big.bin").write_bytes(b"x" * 1024)
    other = tmp_path / ".tmp-demo-someotherid-999999"  # another artifact's: not ours to judge
    other.mkdir()
    made, created = make(store, {"k": 1})
    assert created and not leftover.exists() and other.exists()
