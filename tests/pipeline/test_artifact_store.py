"""The artifact store: ids from inputs, atomic writes, reuse, --force, damage detection, locking."""

import fcntl
import json
import multiprocessing
import os
from pathlib import Path

import pytest

from qerl_pipe.artifacts import ArtifactStore, artifact_id, find_problems
from qerl_pipe.errors import ArtifactError
from stage_cli import cli


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
    assert [a.id for a in store.survey()[0]] == [first.id, other.id]


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


def _hash_calls(monkeypatch) -> list:
    """Record every file the manifest module hashes."""
    import qerl_pipe.artifacts.manifest as manifest

    calls, real = [], manifest.sha256_file
    monkeypatch.setattr(manifest, "sha256_file", lambda path: calls.append(path) or real(path))
    return calls


def test_reuse_rehashes_only_files_whose_size_or_mtime_changed(tmp_path, monkeypatch):
    store = ArtifactStore(tmp_path)
    art, _ = make(store, {"k": 1})
    blob = art.path / "sub" / "blob.bin"
    recorded = json.loads((art.path / "manifest.json").read_text())["files"]["sub/blob.bin"]
    assert recorded["mtime_ns"] == blob.stat().st_mtime_ns
    calls = _hash_calls(monkeypatch)
    again, created = make(store, {"k": 1})
    assert not created and again.path == art.path and calls == []  # nothing re-read
    # An edit of the same size: its mtime moves, so reuse re-hashes that file and refuses it.
    blob.write_bytes(b"dat4")
    with pytest.raises(ArtifactError, match="sha256 differs"):
        make(store, {"k": 1})
    assert calls == [blob]
    # A file of another size is refused on its size alone.
    blob.write_bytes(b"data and more")
    with pytest.raises(ArtifactError, match="truncated or replaced"):
        make(store, {"k": 1})


def test_an_edit_that_restores_the_mtime_is_found_by_a_full_verify(tmp_path):
    store = ArtifactStore(tmp_path)
    art, _ = make(store, {"k": 1})
    blob = art.path / "sub" / "blob.bin"
    before = blob.stat()
    blob.write_bytes(b"dat4")
    os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))  # as git's index, stat alone cannot tell
    assert make(store, {"k": 1})[1] is False
    with pytest.raises(ArtifactError, match="sha256 differs"):
        ArtifactStore(tmp_path, full_verify=True).find_existing("demo", art.id)  # the CLI's --verify
    assert any("sha256" in p for p in find_problems(art))  # `qerl-pipe verify`


def test_a_manifest_without_mtimes_is_hashed_in_full(tmp_path, monkeypatch):
    store = ArtifactStore(tmp_path)
    art, _ = make(store, {"k": 1})
    manifest_file = art.path / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    for meta in manifest["files"].values():
        del meta["mtime_ns"]  # as written before mtimes were recorded
    from qerl_pipe.artifacts.manifest import manifest_digest

    manifest["digest"] = manifest_digest(manifest)
    manifest_file.write_text(json.dumps(manifest))
    calls = _hash_calls(monkeypatch)
    assert make(store, {"k": 1})[1] is False and calls == [art.path / "sub" / "blob.bin"]


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
    made, created = make(store, {"k": 1})
    assert created and not leftover.exists()


def test_a_killed_force_rebuild_leftover_is_removed_by_a_plain_rerun_that_reuses(tmp_path):
    """`quantize --force` killed midway leaves the artifact's own temporary directory next to the
    artifact itself; the next plain run of the same stage reuses the artifact and removes it."""
    store = ArtifactStore(tmp_path)
    made, created = make(store, {"k": 1})
    assert created
    leftover = tmp_path / f".tmp-{made.path.name}-999999"
    (leftover / "sub").mkdir(parents=True)
    (leftover / "sub" / "big.bin").write_bytes(b"x" * 1024)
    again, created = make(store, {"k": 1})
    assert not created and again.path == made.path and not leftover.exists()


def test_any_run_on_the_store_removes_abandoned_temporaries_and_ls_shows_them(tmp_path):
    """A writer holds its artifact's lock while its temporary directory exists: one whose lock is
    free was left by a killed run and goes with the next artifact made anywhere in the store."""
    store = ArtifactStore(tmp_path)
    abandoned = tmp_path / ".tmp-demo-aaaaaaaaaaaaaaaa-999999"
    (abandoned / "sub").mkdir(parents=True)
    busy = tmp_path / ".tmp-demo-bbbbbbbbbbbbbbbb-999998"
    busy.mkdir()
    (tmp_path / ".locks").mkdir()
    with (tmp_path / ".locks" / "demo-bbbbbbbbbbbbbbbb.lock").open("w") as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)  # a live writer of another artifact, in another open file
        states = dict(store.survey()[1])
        assert states[abandoned].startswith("abandoned") and states[busy] == "in progress"
        make(store, {"k": 1})
        assert not abandoned.exists() and busy.exists()
    make(store, {"k": 2})
    assert not busy.exists()


def test_ls_shows_resumable_work_directories_running_or_interrupted(tmp_path):
    store = ArtifactStore(tmp_path)
    running, killed = store.work_dir_for("demo", "1" * 16), store.work_dir_for("demo", "2" * 16)
    running.mkdir(parents=True)
    killed.mkdir()
    (tmp_path / ".locks").mkdir()
    with (tmp_path / ".locks" / f"{running.name}.lock").open("w") as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)
        states = dict(store.survey()[1])
    assert states[running] == "in progress"
    assert states[killed].startswith("interrupted (the same command resumes it")
    make(store, {"k": 1})
    assert killed.exists()  # a work directory is resumed, never swept


def _edit_manifest(art, edit) -> None:
    path = art.path / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest, indent=2))


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m["summary"].update(n=2), "edited after the artifact was made"),
    (lambda m: m["config"].update(k=7), "does not follow from its stage, config and parents"),
    # The id takes the parents' identities (`parent_identities`); the lineage is under the digest.
    (lambda m: m.update(parents=["p2"]), "edited after the artifact was made"),
    (lambda m: m.update(parent_identities=["p2"]), "does not follow from its stage, config and parents"),
    (lambda m: m.update(reports=["sub/blob.bin"], content="0" * 16), "its content digest does not follow from its files"),
    (lambda m: m.update(id="0" * 16), "does not follow from its stage, config and parents"),
    (lambda m: m.pop("stage"), "lacks its stage, config or parents"),
])
def test_an_edited_manifest_is_damage(tmp_path, edit, needle):
    store = ArtifactStore(tmp_path)
    art, _ = make(store, {"k": 1})
    assert find_problems(art) == []
    _edit_manifest(art, edit)
    edited = store.resolve(art.path.name, verify=False)
    assert any(needle in p for p in find_problems(edited)), find_problems(edited)
    with pytest.raises(ArtifactError, match=r"re-create it with `qerl-pipe demo --force`"):
        store.resolve(art.path.name)


def test_a_manifest_without_a_digest_still_verifies(tmp_path):
    """Artifacts made before the digest existed stay usable; their id is still checked."""
    store = ArtifactStore(tmp_path)
    art, _ = make(store, {"k": 1})
    _edit_manifest(art, lambda m: m.pop("digest"))
    assert find_problems(store.resolve(art.path.name, verify=False)) == []


def test_an_added_file_is_fixed_by_removing_it_not_by_re_creating(tmp_path):
    store = ArtifactStore(tmp_path)
    art, _ = make(store, {"k": 1})
    (art.path / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match=r"remove what its manifest does not list \(.*notes.txt\); "
                                            r"its own files are intact") as info:
        make(store, {"k": 1})
    assert "--force" not in str(info.value)
    (art.path / "notes.txt").unlink()
    assert make(store, {"k": 1}) == (store.resolve(art.path.name), False)


def test_a_broken_manifest_says_how_to_repair_and_ls_shows_it(tmp_path):
    store = ArtifactStore(tmp_path)
    art, _ = make(store, {"k": 1})
    (art.path / "manifest.json").write_text("{truncated")
    assert store.survey()[0] == []
    [(path, state)] = store.survey()[1]
    assert path == art.path and state.startswith("damaged:") and "manifest.json is unreadable" in state
    with pytest.raises(ArtifactError, match=r"manifest.json is unreadable .*`qerl-pipe demo --force`") as info:
        store.resolve(art.path.name, verify=False)
    assert "verify" not in str(info.value)  # verify would only read the same broken file
    repaired, created = make(store, {"k": 1}, force=True)
    assert created and find_problems(repaired) == []


def test_short_unique_prefixes_resolve_and_ambiguous_ones_list_the_candidates(tmp_path):
    store = ArtifactStore(tmp_path)
    arts = [make(store, {"k": k})[0] for k in range(40)]
    by_first = {}
    for art in arts:
        by_first.setdefault(art.id[0], []).append(art)
    unique = next(group[0] for group in by_first.values() if len(group) == 1)
    shared = next(group for group in by_first.values() if len(group) > 1)
    assert store.resolve(unique.id[:1]).path == unique.path
    assert store.resolve(f"demo-{unique.id[:1]}").path == unique.path
    assert store.resolve(arts[7].id[:6]).path == arts[7].path  # what a user types: six hex digits
    with pytest.raises(ArtifactError) as info:
        store.resolve(shared[0].id[:1])
    message = str(info.value)
    assert "\n" not in message and f"matches {len(shared)} artifacts" in message and "give more of the id" in message
    assert all(art.path.name in message for art in shared)  # every candidate, not the first few
    with pytest.raises(ArtifactError, match="no artifact 'zz' .* `qerl-pipe ls`"):
        store.resolve("zz")


def test_a_prefix_of_a_damaged_artifact_finds_it_and_says_what_is_wrong(tmp_path):
    store = ArtifactStore(tmp_path)
    art, _ = make(store, {"k": 1})
    (art.path / "manifest.json").write_text("{truncated")
    # Before: a prefix searched only the readable manifests and said "no artifact", though it is there.
    with pytest.raises(ArtifactError, match=r"is damaged: manifest.json is unreadable .*--force"):
        store.resolve(art.id[:6])


def test_cli_show_and_verify_take_a_short_prefix(tmp_path):
    store = ArtifactStore(tmp_path)
    arts = [make(store, {"k": k})[0] for k in range(2)]
    for art in arts:
        assert json.loads(cli("show", art.id[:6], "--artifacts", tmp_path).stdout)["id"] == art.id
        assert cli("verify", art.id[:6], "--artifacts", tmp_path).stdout.strip().endswith(art.path.name)
    bad = cli("show", "demo-", "--artifacts", tmp_path, ok=False)
    assert bad.exit_code == 1 and "matches 2 artifacts" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_a_nan_in_a_summary_is_refused_and_leaves_no_artifact(tmp_path):
    from qerl_pipe.strict_json import NonFiniteError

    store = ArtifactStore(tmp_path)
    with pytest.raises(NonFiniteError, match=r"summary\.perplexity\.nvfp4_w4a16 is nan, which strict JSON"):
        with store.create(stage="demo", stage_version=1, kind="k", config={}, parents=[]) as (pending, _):
            pending.summary["perplexity"] = {"bf16": 15.5, "nvfp4_w4a16": float("nan")}
    assert [p.name for p in tmp_path.iterdir() if p.name != ".locks"] == []


def test_every_json_the_package_writes_goes_through_the_strict_writer():
    # json.dumps writes NaN as a bare `NaN` unless told not to; qerl_pipe.strict_json always tells it
    # (and so does the lab's every results file: qerl_lab/*.py)
    root = Path(__file__).parents[2]
    modules = sorted([*(root / "qerl_pipe").rglob("*.py"), *(root / "qerl_lab").glob("*.py")])
    loose = [f"{path.relative_to(root)}:{n}" for path in modules if path.name != "strict_json.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if "json.dump" in line]
    assert loose == [], loose


def test_a_run_that_only_reuses_still_removes_what_a_killed_run_left(tmp_path):
    store = ArtifactStore(tmp_path)
    made, _ = make(store, {"k": 1})
    abandoned = tmp_path / ".tmp-demo-aaaaaaaaaaaaaaaa-999999"  # its lock is free: its writer is gone
    (abandoned / "sub").mkdir(parents=True)
    assert dict(store.survey()[1])[abandoned].startswith("abandoned (the next run on this store removes it)")
    again, created = make(store, {"k": 1})
    assert not created and again.path == made.path and not abandoned.exists()


def test_ls_lists_each_artifact_after_its_parents(tmp_path):
    """A `run` seals several artifacts within one second: `created` ties, and name order put an
    export above the train run it was made from."""
    store = ArtifactStore(tmp_path)

    def seal(stage: str, parents: list[str]):
        with store.create(stage=stage, stage_version=1, kind=stage, config={}, parents=parents) as (pending, _):
            (pending.dir / "f").write_text(stage)
        return store.find_existing(stage, pending.id)

    train = seal("train", [])
    export = seal("export", [train.id])
    for artifact in (train, export):  # the same second, as a fast run makes them
        manifest = json.loads((artifact.path / "manifest.json").read_text())
        (artifact.path / "manifest.json").write_text(json.dumps({**manifest, "created": "2025-01-01T00:00:00+00:00"}))
    assert [a.stage for a in store.survey()[0]] == ["train", "export"]
    listed = [line.split()[0] for line in cli("ls", "--artifacts", tmp_path).stdout.splitlines()]
    assert listed == [train.path.name, export.path.name]
