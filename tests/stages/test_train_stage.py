"""`qerl-pipe train` on a tiny model (CPU): the run artifact, reuse, the PEFT adapter, inputs that
fail before any work, and a run killed with SIGKILL then resumed, bit-identical to an unbroken one."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import read_json
from tests.stage_cli import cli, last_line, named

ROOT = Path(__file__).parents[2]
ENGINE = ["--set", "stages=[quantize, build-engine, train]", "--set", "quantize.quality.perplexity=never",
          "--set", "engine.max_seq_len=128", "--set", "engine.max_batch=16", "--set", "engine.device=cpu"]
# A small run with a reward the random model can learn (see tests/rl/test_rl_trainer.py).
TRAIN = ["--set", "train.steps=4", "--set", "train.prompts_per_step=4", "--set", "train.group_size=4",
         "--set", "train.max_new_tokens=12", "--set", "train.temperature=0.25", "--set", "train.lr=2e-2",
         "--set", "train.eval_limit=8", "--set", "train.checkpoint_every=2", "--set", "train.device=cpu",
         "--set", "train.rewards.accuracy=0", "--set", "train.rewards.custom=[tests.stages.test_train_stage:letter_e]"]


def letter_e(completion: str, problem) -> float:
    if os.environ.get("QERL_TEST_SLOW_REWARD"):
        time.sleep(0.02)  # the killed run: slow enough that the kill lands between checkpoints
    return completion.count("e") / max(1, len(completion))


def test_train_writes_a_run_and_reuses_it(tiny_llama, store_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  source: {tiny_llama}\n")
    first = cli("run", recipe, "--artifacts", store_dir, *ENGINE, *TRAIN)
    run = last_line(first)
    assert run.name.startswith("train-") and "greedy accuracy before training" in first.stderr
    (engine,) = named(store_dir, "build-engine-")
    manifest = read_json(run / "manifest.json")
    assert manifest["kind"] == "run" and manifest["parents"] == [engine.removeprefix("build-engine-")]
    assert manifest["config"]["train"]["steps"] == 4 and manifest["summary"]["steps"] == 4
    files = set(manifest["files"])
    assert {"adapter/adapter_model.safetensors", "adapter/adapter_config.json", "metrics.jsonl", "report.json",
            "report.md", "run.json", "eval/before.jsonl", "eval/after.jsonl",
            "checkpoints/step-000004/adapter_model.safetensors", "checkpoints/step-000004/trainer_state.pt"} <= files
    assert not any(f.startswith("checkpoints/step-000002") for f in files)  # only the last one is kept
    pytest.importorskip("matplotlib")
    assert {"plots/reward_mean.png", "plots/accuracy.png", "plots/entropy.png", "plots/sigma.png",
            "plots/response_length_mean.png"} <= files

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("reward_mean", "reward_std", "accuracy", "entropy", "response_length_mean", "truncation_rate",
                "clip_fraction", "kl", "sigma", "lr", "rollout_tokens_per_s", "train_tokens_per_s", "step_seconds",
                "peak_gpu_memory_gib"):
        assert key in records[0], key
    assert {"question", "completion", "reward"} == records[0]["sample"].keys()
    report = read_json(run / "report.json")
    assert report["eval_before"]["total"] == 8 and 0 <= report["eval_after"]["accuracy"] <= 1
    assert "| before |" in (run / "report.md").read_text()
    assert named(store_dir / ".runs", "train-") == []  # sealed: the work directory is gone
    cli("verify", run)

    again = cli("train", "--model", tiny_llama, "--artifacts", store_dir, *ENGINE, *TRAIN)
    assert last_line(again) == run and "train: up to date" in again.stderr
    by_ref = cli("train", "--engine", engine, "--model", tiny_llama, "--artifacts", store_dir, *ENGINE, *TRAIN)
    assert last_line(by_ref) == run


def test_adapter_loads_into_peft_and_reproduces_our_logits(tiny_llama, store_dir):
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from qerl_pipe.model.peft import load_adapter_weights
    from qerl_pipe.model.lora import LoraSpec
    from qerl_pipe.jobs.engine_artifact import load_engine

    run = last_line(cli("train", "--model", tiny_llama, "--artifacts", store_dir, "--build-missing", *ENGINE, *TRAIN,
                        "--set", "engine.base_format=bf16", "--set", "train.steps=2", "--set", "train.eval_limit=0",
                        "--set", "train.lora.rank=4", "--set", "train.lora.alpha=8"))
    adapter = run / "adapter"
    config = PeftConfig.from_pretrained(str(adapter))
    assert config.peft_type == "LORA" and config.task_type == "CAUSAL_LM" and config.r == 4
    assert config.lora_alpha == 8 and set(config.target_modules) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert config.base_model_name_or_path == str(tiny_llama)

    (engine,) = named(store_dir, "build-engine-")
    ours, _ = load_engine(store_dir / engine, "cpu", lora=LoraSpec(4, 8))
    load_adapter_weights(ours, adapter / "adapter_model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(adapter))
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        got = ours.logits(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    with torch.no_grad(), peft_model.disable_adapter():
        assert (peft_model(input_ids=ids).logits - want).abs().max() > 1e-4  # the adapter was trained


@pytest.mark.parametrize("override, needle", [
    ("train.loss=ppo", "'train.loss'"),
    ("train.group_size=1", "'train.group_size'"),
    ("train.aqn.sigma_end=0.1", "sigma_end (0.1) > sigma_start"),
    ("train.data=/nonexistent/problems.jsonl", "does not exist"),
    ("train.eval_data=gsm8k:dev", "problem set 'gsm8k:dev'"),
    ("train.rewards.custom=[no_such_module:reward]", "cannot import module 'no_such_module'"),
])
def test_bad_train_inputs_fail_before_any_work(tiny_llama, store_dir, tmp_path, override, needle):
    for command in ("train", "run"):
        if command == "run":
            recipe = tmp_path / "r.yaml"
            # an engine the model can hold: `run` checks it (before train's inputs) too
            recipe.write_text(f"stages: [calibrate, quantize, build-engine, train]\nmodel:\n  source: {tiny_llama}\n"
                              "engine:\n  max_seq_len: 128\n")
            result = cli("run", recipe, "--artifacts", store_dir, "--set", override, ok=False)
        else:
            result = cli("train", "--model", tiny_llama, "--artifacts", store_dir, "--build-missing", *ENGINE, "--set",
                         override, ok=False)
        assert result.exit_code == 1, result.stdout
        assert result.stderr.strip().startswith("error:") and len(result.stderr.strip().splitlines()) == 1
        assert needle in result.stderr, result.stderr
        assert [p for p in named(store_dir, "") if p != ".locks"] == []  # nothing made, not even a quantize


def _command(model: Path, store: Path) -> list[str]:
    args = ["train", "--model", model, "--artifacts", store, "--build-missing", *ENGINE, *TRAIN,
            "--set", "train.steps=10", "--set", "train.checkpoint_every=2", "--set", "train.eval_limit=4"]
    return [sys.executable, "-m", "qerl_pipe", *map(str, args)]


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def kill_and_resume(command: Callable[[Path], list[str]], tmp_path: Path,
                    seconds: float) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """Run `command(store)` whole in one store; in another, SIGKILL it after its 4th step's
    checkpoint (with a slowed reward, so the kill lands mid-run) and run it again. Checks that the
    kill left no artifact and that the second run resumed from the latest checkpoint; returns the
    reference artifact, the resumed artifact and the resumed process."""
    whole = subprocess.run(command(tmp_path / "a"), env=_env(), capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    reference = Path(whole.stdout.strip().splitlines()[-1])

    store = tmp_path / "b"
    proc = subprocess.Popen(command(store), env=_env(QERL_TEST_SLOW_REWARD="1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + seconds
    try:
        while not list(store.glob(".runs/train-*/checkpoints/step-000004")):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its 4th step"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert named(store, "train-") == []  # killed mid-run: no artifact
    (run_dir,) = store.glob(".runs/train-*")
    # A kill between a checkpoint's rename and the removal of the previous one leaves both: the
    # resume takes the latest.
    done = max(int(c.name.removeprefix("step-")) for c in (run_dir / "checkpoints").glob("step-*"))
    assert 4 <= done < 10

    resumed = subprocess.run(command(store), env=_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming {run_dir} after step {done} of 10" in resumed.stderr
    run = Path(resumed.stdout.strip().splitlines()[-1])
    assert run.name == reference.name  # same inputs, same id
    return reference, run, resumed


def assert_same_training(run: Path, reference: Path) -> list[dict]:
    """Both runs logged the same 10 steps, number for number, and evaluated alike; returns `run`'s
    metric lines."""
    lines = [[json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()] for r in (run, reference)]
    assert [r["step"] for r in lines[0]] == list(range(1, 11))
    for mine, ref in zip(*lines):
        for key in ("reward_mean", "loss", "grad_norm", "entropy", "sigma", "lr", "response_length_mean"):
            assert mine[key] == ref[key], (mine["step"], key)
    assert read_json(run / "report.json")["eval_after"] == read_json(reference / "report.json")["eval_after"]
    return lines[0]


@pytest.mark.slow
def test_a_killed_run_resumes_bit_identical(tiny_llama, tmp_path):
    reference, run, resumed = kill_and_resume(lambda store: _command(tiny_llama, store), tmp_path, 120)
    assert "greedy accuracy before training" not in resumed.stderr  # kept from the first session
    for rel in ("adapter/adapter_model.safetensors", "checkpoints/step-000010/adapter_model.safetensors"):
        assert (run / rel).read_bytes() == (reference / rel).read_bytes(), rel
    lines = assert_same_training(run, reference)
    report = read_json(run / "report.json")
    assert report["step_seconds_total"] == pytest.approx(sum(r["step_seconds"] for r in lines), abs=0.1)
    assert report["steps"] == 10 and "10 steps on cpu" in (run / "report.md").read_text()


def test_an_edited_data_file_is_never_reused(tiny_llama, store_dir, tmp_path):
    problems = tmp_path / "problems.jsonl"
    rows = [{"question": f"What is {a} + 1?", "answer": f"#### {a + 1}"} for a in range(12)]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  source: {tiny_llama}\n")
    opts = ["run", recipe, "--artifacts", store_dir, *ENGINE, *TRAIN, "--set", f"train.data={problems}",
            "--set", "train.eval_data=null", "--set", "train.steps=2"]
    first = last_line(cli(*opts))
    assert last_line(cli(*opts)) == first
    assert read_json(first / "manifest.json")["config"]["data_sha256"]
    problems.write_text(problems.read_text().replace("+ 1?", "+ 2?"))
    assert last_line(cli(*opts)) != first  # neither reused nor resumed: a run of its own


def test_an_edited_custom_reward_is_never_reused(tiny_llama, store_dir, tmp_path, monkeypatch):
    module = tmp_path / "my_rewards_21.py"
    module.write_text("def shorter(completion, problem):\n    return -len(completion) / 100\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  source: {tiny_llama}\n")
    opts = ["run", recipe, "--artifacts", store_dir, *ENGINE, *TRAIN, "--set", "train.eval_data=null",
            "--set", "train.steps=1", "--set", "train.rewards.custom=[my_rewards_21:shorter]"]
    first = last_line(cli(*opts))
    assert last_line(cli(*opts)) == first
    digests = read_json(first / "manifest.json")["config"]["custom_rewards_sha256"]
    assert list(digests) == ["my_rewards_21:shorter"] and len(digests["my_rewards_21:shorter"]) == 64
    module.write_text("def shorter(completion, problem):\n    return -len(completion) / 10\n")
    assert last_line(cli(*opts)) != first  # the same name, another function: a run of its own


def _short_run(model: Path, store: Path) -> list[str]:
    """A 6-step run with no checkpoint due before its end and no evaluation: quick to stop and resume."""
    args = ["train", "--model", model, "--artifacts", store, "--build-missing", *ENGINE, *TRAIN,
            "--set", "train.steps=6", "--set", "train.checkpoint_every=0", "--set", "train.eval_limit=0"]
    return [sys.executable, "-m", "qerl_pipe", *map(str, args)]


@pytest.mark.slow
def test_sigterm_saves_the_step_in_progress_and_says_how_to_resume(tiny_llama, tmp_path):
    store = tmp_path / "store"
    proc = subprocess.Popen(_short_run(tiny_llama, store), env=_env(QERL_TEST_SLOW_REWARD="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    try:
        while sum(len(m.read_text().splitlines()) for m in store.glob(".runs/train-*/metrics.jsonl")) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its 2nd step"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGTERM)  # mid-step: no checkpoint is due before step 6
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    (run_dir,) = store.glob(".runs/train-*")
    done = len((run_dir / "metrics.jsonl").read_text().splitlines())
    assert 2 <= done < 6 and [c.name for c in (run_dir / "checkpoints").iterdir()] == [f"step-{done:06d}"]
    last = err.strip().splitlines()[-1]
    assert last == (f"stopped by SIGTERM after step {done} of 6, saved in {run_dir}; the same command resumes from "
                    f"there: {shlex.join(['qerl-pipe', *_short_run(tiny_llama, store)[3:]])}"), last
    assert named(store, "train-") == [] and named(store, ".tmp-") == []
    resumed = subprocess.run(_short_run(tiny_llama, store), env=_env(), capture_output=True, text=True)
    assert resumed.returncode == 0 and f"resuming {run_dir} after step {done} of 6" in resumed.stderr, resumed.stderr


def test_a_full_disk_mid_train_keeps_the_work_directory_and_says_the_same_command_resumes(
        tiny_llama, store_dir, monkeypatch):
    import errno

    import qerl_pipe.jobs.train_job as train_job

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(store_dir / "adapter_model.safetensors"))
    monkeypatch.setattr(train_job, "save_adapter", full)  # after the last step, as the adapter is written
    args = ["train", "--model", tiny_llama, "--artifacts", store_dir, "--build-missing", *ENGINE, *TRAIN,
            "--set", "train.steps=2", "--set", "train.eval_limit=0"]
    result = cli(*args, ok=False)
    (run_dir,) = store_dir.glob(".runs/train-*")
    err = result.stderr.strip().splitlines()[-1]  # after the lines of the work that ran
    assert result.exit_code == 1 and err.startswith("error:"), result.stderr
    assert (f"No space left on device; free space, then run the same command again: it resumes from the last "
            f"checkpoint in {run_dir}, which is kept") in err and "nothing" not in err
    assert (run_dir / "checkpoints" / "step-000002").is_dir() and named(store_dir, "train-") == []
    monkeypatch.undo()
    again = cli(*args)
    assert f"resuming {run_dir} after step 2 of 2" in again.stderr and last_line(again).name.startswith("train-")
