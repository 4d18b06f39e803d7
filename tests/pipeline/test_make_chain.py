"""recipes/Makefile on a tiny random Llama (CPU): `make` runs calibrate -> quantize -> build-engine ->
train -> export, eval as separate commands, each artifact verifies and names its parent; a second
`make` runs nothing; a deleted artifact re-runs its stage alone; `make -n` prints the commands
qerl_pipe.orchestration builds."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qerl_pipe.cli import app
from qerl_pipe.orchestration import stage_words
from qerl_pipe.recipe import STAGE_ORDER
from tests.conftest import read_json

ROOT = Path(__file__).parents[2]
MAKEFILE = ROOT / "recipes" / "Makefile"
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")

# Everything as small as the stages allow: 2 calibration sequences, one RL step of 2 x 2 samples,
# 4 greedy eval problems of 8 tokens.
TINY_RECIPE = """\
model:
  source: {model}
calibrate: {{num_samples: 2, seq_len: 32, batch_size: 2, device: cpu}}
quantize:
  quality: {{perplexity: never}}
engine: {{max_seq_len: 64, max_batch: 4, device: cpu}}
train:
  data: arithmetic
  eval_limit: 0
  steps: 1
  prompts_per_step: 2
  group_size: 2
  max_new_tokens: 8
  device: cpu
  lora: {{rank: 2, alpha: 4}}
export: {{format: peft}}
eval: {{data: arithmetic, limit: 4, greedy: true, max_new_tokens: 8, device: cpu}}
"""


def make(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`make -f recipes/Makefile` from the repository root, running this checkout's code."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(["make", "-f", str(MAKEFILE), f"PYTHON={sys.executable}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def stage_lines(output: str) -> list[str]:
    """The stage commands make printed (each starts with the CLI: `<python> -m qerl_pipe <stage>`)."""
    return [line for line in output.splitlines() if line.startswith(f"{sys.executable} -m qerl_pipe ")]


def pointers(stamps: Path, stages: tuple[str, ...] = STAGE_ORDER) -> dict[str, Path]:
    return {stage: Path((stamps / stage).read_text().strip()) for stage in stages}


@pytest.mark.slow
def test_make_runs_every_stage_once_and_a_second_make_runs_nothing(tiny_llama, tmp_path):
    recipe, store = tmp_path / "tiny.yaml", tmp_path / "artifacts"
    recipe.write_text(TINY_RECIPE.format(model=tiny_llama))
    variables = [f"RECIPE={recipe}", f"ARTIFACTS={store}"]

    first = make(*variables)
    assert [shlex.split(line)[3] for line in stage_lines(first.stdout)] == list(STAGE_ORDER)
    arts = pointers(store / ".make")
    kinds = {stage: read_json(arts[stage] / "manifest.json")["kind"] for stage in STAGE_ORDER}
    assert kinds == {"calibrate": "calibration", "quantize": "nvfp4-checkpoint", "build-engine": "engine",
                     "train": "run", "export": "export-peft", "eval": "eval"}
    ids = {stage: read_json(arts[stage] / "manifest.json")["id"] for stage in STAGE_ORDER}
    parents = {stage: read_json(arts[stage] / "manifest.json")["parents"] for stage in STAGE_ORDER}
    assert parents["quantize"] == [ids["calibrate"]] and parents["build-engine"] == [ids["quantize"]]
    assert parents["train"] == [ids["build-engine"]] and ids["train"] in parents["export"]
    assert parents["eval"] == [ids["build-engine"], ids["train"]]
    runner = CliRunner()
    for stage, art in arts.items():
        assert runner.invoke(app, ["verify", str(art)]).exit_code == 0, stage
    assert read_json(arts["eval"] / "report.json")["adapter"]["applied"]

    # Up to date: `make -q` says so, and `make` runs no stage command and touches no pointer.
    mtimes = {p.name: p.stat().st_mtime_ns for p in (store / ".make").iterdir()}
    assert make("-q", *variables, check=False).returncode == 0
    again = make(*variables)
    assert stage_lines(again.stdout) == [] and "Nothing to be done" in again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in (store / ".make").iterdir()} == mtimes

    # An artifact deleted by hand: its stage runs again (re-creating it under the same id), alone.
    shutil.rmtree(arts["eval"])
    assert make("-q", *variables, check=False).returncode == 1
    third = make(*variables)
    assert [shlex.split(line)[3] for line in stage_lines(third.stdout)] == ["eval"]
    assert pointers(store / ".make") == arts and (arts["eval"] / "manifest.json").is_file()

    # clean-stamps forgets the pointers and keeps every artifact.
    make("clean-stamps", *variables)
    assert not any((store / ".make" / s).exists() for s in STAGE_ORDER)
    assert all((art / "manifest.json").is_file() for art in arts.values())


@pytest.mark.slow
def test_make_chains_an_nf4_recipe_through_the_same_stages(tiny_qwen2, tmp_path):
    # The chain always hands build-engine the quantize artifact; an nf4 (QLoRA) engine leaves it
    # unused and reads the model, as `qerl-pipe run` does.
    recipe, store = tmp_path / "nf4.yaml", tmp_path / "artifacts"
    recipe.write_text(TINY_RECIPE.format(model=tiny_qwen2))
    built = make(f"RECIPE={recipe}", f"ARTIFACTS={store}", "SET=engine.base_format=nf4", "build-engine")
    assert "is not used" in built.stderr
    engine = read_json(pointers(store / ".make", ("build-engine",))["build-engine"] / "manifest.json")
    assert engine["parents"] == [] and "model" in engine["config"]["base"]
    assert engine["config"]["engine"]["base_format"] == "nf4"


def test_make_prints_the_commands_orchestration_builds(tmp_path):
    recipe, store = tmp_path / "r.yaml", tmp_path / "store"
    recipe.write_text("{}\n")
    dry = make("-n", f"RECIPE={recipe}", f"ARTIFACTS={store}", "MODEL=./tiny", "SET=train.steps=2 eval.limit=4")
    stamps = store / ".make"
    printed = [shlex.split(line.rsplit(" > ", 1)[0]) for line in stage_lines(dry.stdout)]
    expected = [stage_words(stage, lambda parent: f"$(cat {stamps}/{parent})", cli=[sys.executable, "-m", "qerl_pipe"],
                            recipe=str(recipe), artifacts=str(store), model="./tiny",
                            sets=["train.steps=2", "eval.limit=4"]) for stage in STAGE_ORDER]
    assert printed == expected
    # Changing SET puts every pointer out of date (the variables are recorded in a file make can date).
    assert (stamps / "inputs").read_text().strip() == f"RECIPE={recipe} MODEL=./tiny SET=train.steps=2 eval.limit=4"
