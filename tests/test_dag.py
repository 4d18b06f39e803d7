"""The pipeline declared once (qerl_pipe/dag.py): the stages' inputs and entry points agree with
it, no stage module imports another, the Makefile chains what it declares, and a stage command
whose input is missing fails at once naming the command that makes it, instead of building it."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

from qerl_pipe import dag
from qerl_pipe.orchestration import STAGE_INPUTS
from qerl_pipe.recipe import STAGE_ORDER
from tests.stage_cli import cli

ROOT = Path(__file__).parents[1]


def test_every_input_comes_from_an_earlier_stage_and_each_entry_point_takes_it():
    assert STAGE_ORDER == dag.STAGE_ORDER
    for position, stage in enumerate(dag.STAGES):
        for inp in stage.inputs:
            assert dag.STAGE_ORDER.index(inp.stage) < position, (stage.name, inp.stage)
        params = inspect.signature(stage.entry_point()).parameters
        expected = {"force", "build_missing", "find_only", *(i.keyword for i in stage.inputs)}
        assert expected <= set(params), (stage.name, expected - set(params))
        assert STAGE_INPUTS[stage.name] == tuple((i.option, i.stage) for i in stage.inputs)


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
    assert {s.entry.partition(":")[0] for s in dag.STAGES} <= modules
    for module in modules:  # `run` (stages/pipeline.py) included: it reaches the stages through the DAG
        found = {m for m in _imports(ROOT / (module.replace(".", "/") + ".py")) if m.startswith("qerl_pipe.stages")}
        assert found <= {module}, (module, found)


def test_each_stage_module_is_orchestration_of_at_most_150_lines():
    for path in (ROOT / "qerl_pipe" / "stages").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 150, path.name


def test_formats_never_import_model():
    """The layers: formats (file layouts, number formats) sit under model (the Decoder)."""
    for path in (ROOT / "qerl_pipe" / "formats").glob("*.py"):
        assert not {m for m in _imports(path) if m.startswith("qerl_pipe.model")}, path.name


def test_the_makefile_chains_the_declared_dag():
    """Each stage's make rule depends on the pointers of exactly the stages it reads, and hands each
    one's path to the option the DAG declares (`make -n` in test_make_chain checks the full commands)."""
    text = (ROOT / "recipes" / "Makefile").read_text()
    assert re.search(r"^STAGES := (.*)$", text, re.M).group(1).split() == list(dag.STAGE_ORDER)
    for stage in dag.STAGES:
        rule = re.search(rf"^\$\(STAMPS\)/{re.escape(stage.name)}:(.*)\n\t(.*)$", text, re.M)
        assert rule is not None, stage.name
        prerequisites = re.findall(r"\$\(STAMPS\)/([\w-]+)", rule.group(1))
        assert prerequisites == [i.stage for i in stage.inputs], stage.name
        handed = re.findall(r"(--[\w-]+) \$\(call path_of,([\w-]+)\)", rule.group(2))
        assert handed == [(i.option, i.stage) for i in stage.inputs], stage.name


def test_export_without_its_run_fails_fast_naming_the_command(tiny_llama, store_dir):
    result = cli("export", "--model", tiny_llama, "--artifacts", store_dir, ok=False)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: export needs the recipe's run"), result.stderr
    assert "`qerl-pipe train`" in lines[0] and "--run" in lines[0] and "--build-missing" in lines[0]
    assert "`qerl-pipe calibrate` first" in lines[0]  # the first stage missing from the chain
    assert not store_dir.exists() or [p.name for p in store_dir.iterdir()] == []  # nothing was made


def test_a_stage_finds_its_input_when_the_recipe_made_it(tiny_llama, store_dir):
    fast = ["--set", "quantize.quality.perplexity=never", "--set", "engine.max_seq_len=64", "--set", "engine.device=cpu"]
    missing = cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, *fast, ok=False)
    assert "`qerl-pipe quantize`" in missing.stderr and "`qerl-pipe calibrate` first" in missing.stderr
    cli("calibrate", "--model", tiny_llama, "--artifacts", store_dir, "--set", "calibrate.num_samples=2",
        "--set", "calibrate.seq_len=32")
    still = cli("build-engine", "--model", tiny_llama, "--artifacts", store_dir, *fast, "--set",
                "calibrate.num_samples=2", "--set", "calibrate.seq_len=32", ok=False)
    assert "needs the recipe's quantize checkpoint" in still.stderr and " first)" not in still.stderr
