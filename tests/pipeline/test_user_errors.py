"""Every user-facing failure is one line naming the problem and the fix, exit 1, nothing half-written:
broken model configs, data files that are not UTF-8, an --artifacts that cannot be a store, a full disk."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from qerl_pipe.artifacts import ArtifactStore
from qerl_pipe.errors import ArtifactError
from qerl_pipe.rl.task.tasks import TaskError, load_problems
from qerl_pipe.textdata import load_texts
from qerl_pipe.userfiles import describe_os_error
from tests.stage_cli import cli, last_line, named

FAST = ["--set", "quantize.quality.perplexity=never"]


def one_line_failure(result, *needles: str) -> str:
    """The error line of a failed command, checked: exit 1, one line, no traceback, every needle."""
    assert result.exit_code == 1, (result.stdout, result.exception)
    err = result.stderr.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def copy_model(src: Path, dst: Path, edit_config=None) -> Path:
    shutil.copytree(src, dst)
    if edit_config is not None:
        config = dst / "config.json"
        config.write_text(edit_config(config.read_text()))
    return dst


def _drop_hidden_size(text: str) -> str:
    config = json.loads(text)
    del config["hidden_size"]
    return json.dumps(config)


@pytest.mark.parametrize("edit, needles", [
    (lambda text: "{not json", ["is not valid JSON (line 1, column 2", "restore the original"]),
    (_drop_hidden_size, ["has no hidden_size", "restore the model's original config.json"]),
    (lambda text: "[1, 2]", ["is not a JSON object"]),
    (lambda text: text.replace('"hidden_size": 64', '"hidden_size": "64"'), ["hidden_size is '64', not a positive integer"]),
])
def test_a_broken_model_config_is_one_line(tiny_llama, tmp_path, edit, needles):
    model = copy_model(tiny_llama, tmp_path / "model", edit)
    store = tmp_path / "store"
    one_line_failure(cli("quantize", "--model", model, "--artifacts", store, *FAST, ok=False), *needles)
    if store.exists():  # refused before the store was made is fine too; made, it holds nothing of this run
        assert named(store, "quantize") == [] and not list(store.glob(".tmp-*"))


def _latin1(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("latin-1"))
    return path


def test_data_files_that_are_not_utf8_name_the_file_and_the_fix(tmp_path):
    txt = _latin1(tmp_path / "calib.txt", "caf\xe9 au lait\n\nmore")
    with pytest.raises(Exception, match=r"text data .*calib.txt is not UTF-8 text \(byte 3.*re-save it as UTF-8"):
        load_texts(str(txt))
    problems = _latin1(tmp_path / "train.jsonl", '{"question": "caf\xe9?", "answer": "1"}\n')
    with pytest.raises(TaskError, match=r"problem file .*train.jsonl is not UTF-8 text"):
        load_problems(str(problems))
    recipe = _latin1(tmp_path / "recipe.yaml", "# caf\xe9\nstages: [quantize]\n")
    one_line_failure(cli("quantize", "--recipe", recipe, ok=False), "recipe file", "is not UTF-8 text")


def test_calibrate_with_latin1_data_fails_in_one_line_and_writes_nothing(tiny_llama, tmp_path):
    data = _latin1(tmp_path / "calib.txt", "caf\xe9 au lait\n\nmore")
    store = tmp_path / "store"
    result = cli("calibrate", "--model", tiny_llama, "--artifacts", store, "--set", f"calibrate.data={data}", ok=False)
    one_line_failure(result, "calib.txt is not UTF-8 text")
    assert named(store, "calibrate") == [] and not list(store.glob(".tmp-*"))


def test_an_artifacts_path_that_cannot_be_a_store(tiny_llama, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a store")
    one_line_failure(cli("quantize", "--model", tiny_llama, "--artifacts", a_file, *FAST, ok=False),
                     "is a file, not a directory", "--artifacts")
    one_line_failure(cli("quantize", "--model", tiny_llama, "--artifacts", a_file / "sub", *FAST, ok=False),
                     "a part of the path is a file", "--artifacts")
    one_line_failure(cli("ls", "--artifacts", a_file, ok=False), "is a file, not a directory")
    one_line_failure(cli("show", "abc", "--artifacts", a_file, ok=False), "is a file, not a directory")
    assert a_file.read_text() == "not a store"


def _refuse_locks(monkeypatch) -> None:
    """A store this user may read but not write (chmod alone cannot show it to root, who runs CI)."""
    def denied(self, name):
        raise PermissionError(errno.EACCES, "Permission denied", str(self.root / ".locks"))
    monkeypatch.setattr(ArtifactStore, "_lock", denied)


def test_a_read_only_store_still_reuses_and_refuses_new_work_in_one_line(tiny_llama, tmp_path, monkeypatch):
    store = tmp_path / "store"
    made = last_line(cli("quantize", "--model", tiny_llama, "--artifacts", store, *FAST))
    _refuse_locks(monkeypatch)
    reused = cli("quantize", "--model", tiny_llama, "--artifacts", store, *FAST)
    assert last_line(reused) == made and "up to date" in reused.stderr
    other = ["--set", "quantize.method=mse"]
    one_line_failure(cli("quantize", "--model", tiny_llama, "--artifacts", store, *FAST, *other, ok=False),
                     "is not writable (Permission denied)", "quantize has no up-to-date artifact", "--artifacts")
    one_line_failure(cli("quantize", "--model", tiny_llama, "--artifacts", store, *FAST, "--force", ok=False),
                     "--force re-creates the artifact")


def test_a_full_disk_is_one_line_and_leaves_no_temporary_directory(tiny_llama, tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    store = tmp_path / "store"
    err = one_line_failure(cli("quantize", "--model", tiny_llama, "--artifacts", store, *FAST, ok=False),
                           "No space left on device", "free space", "model.safetensors")
    assert "SafetensorError" not in err
    assert named(store, "quantize") == [] and not list(store.glob(".tmp-*"))


def test_os_errors_read_as_the_file_the_reason_and_the_fix():
    line = describe_os_error(OSError(errno.EROFS, "Read-only file system", "/data/x"))
    assert line == "/data/x: Read-only file system; choose a path on a writable file system (--artifacts)"
    assert describe_os_error(OSError(errno.EIO, "Input/output error")) == "Input/output error"


def test_the_store_refuses_a_file_as_its_root(tmp_path):
    root = tmp_path / "file"
    root.write_text("")
    with pytest.raises(ArtifactError, match="is a file, not a directory"):
        with ArtifactStore(root).create(stage="demo", stage_version=1, kind="k", config={}, parents=[]):
            pass


def test_a_jsonl_line_that_is_not_an_object_names_the_line(tmp_path):
    data = tmp_path / "calib.jsonl"
    data.write_text('{"text": "fine"}\n\n5\n')
    with pytest.raises(Exception, match=r"calib.jsonl:3: expected a JSON object, got int"):
        load_texts(str(data))  # was a TypeError from `field in 5`
    problems = tmp_path / "train.jsonl"
    problems.write_text('{"question": "q", "answer": "1"}\n[1]\n')
    with pytest.raises(TaskError, match=r"train.jsonl:2: expected a JSON object, got list"):
        load_problems(str(problems))


def test_a_checkpoint_on_a_full_disk_is_one_error_that_says_the_run_resumes(tmp_path, monkeypatch):
    import torch

    from qerl_pipe.errors import QerlError
    from qerl_pipe.rl.loop.checkpoint import latest_checkpoint, save_checkpoint
    from tests.rl.test_rl_trainer import _random_lora_model

    model = _random_lora_model("bf16")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file "
                           "data/0: file write failed")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(QerlError, match=r"cannot write the checkpoint .*state.pt \(\[enforce fail.* MB free on its "
                                        r"disk\): free space, then run the same command again, which resumes"):
        save_checkpoint(tmp_path, 2, model, optimizer, scheduler, {"step": 2})
    assert latest_checkpoint(tmp_path) is None  # nothing half-written counts as a checkpoint


def test_a_nan_in_a_norm_weight_is_refused_by_quantize_calibrate_and_build_engine_naming_it_alike(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    model = copy_model(tiny_llama, tmp_path / "model")
    tensors = load_file(str(model / "model.safetensors"))
    name = "model.layers.1.post_attention_layernorm.weight"
    tensors[name][3] = float("nan")  # not a linear: quantize copies it as it is
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    store = tmp_path / "store"
    for command in (["quantize", *FAST], ["calibrate", "--set", "calibrate.num_samples=2", "--set",
                                          "calibrate.seq_len=16"],
                    ["build-engine", "--set", "engine.base_format=bf16", "--set", "engine.device=cpu",
                     "--set", "engine.max_seq_len=128", "--set", "engine.max_batch=2"]):
        result = cli(command[0], "--model", model, "--artifacts", store, *command[1:], ok=False)
        one_line_failure(result, f"{name} has non-finite values", "re-download or re-convert")
        assert named(store, command[0]) == [] and not list(store.glob(".tmp-*"))


def test_a_full_disk_before_any_checkpoint_says_the_run_starts_over(tmp_path):
    from qerl_pipe.errors import QerlError
    from qerl_pipe.userfiles import resumable_on_full_disk

    for has_checkpoint, says in ((False, "it starts the run over in"), (True, "it resumes from the last checkpoint in")):
        with pytest.raises(QerlError) as err, resumable_on_full_disk(tmp_path, lambda: has_checkpoint):
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "state.pt"))
        assert says in str(err.value) and str(tmp_path) in str(err.value)
        assert ("checkpoint in" in str(err.value)) == has_checkpoint
