"""The layers point down (docs/architecture.md). The import graph of qerl_pipe is read with `ast`
from the source files (nothing is imported): module-level and in-function imports, those under
`if TYPE_CHECKING:` apart (annotations only: no edge at run time). No two packages may import
each other, even through others, and the lower layers must not import the ones above them. The lab
(the package `qerl_lab`, beside qerl_pipe) sits on top of it all: the product imports nothing of it, but
for the one hook that starts a `qerl-pipe bench` command (LAB_HOOK)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "qerl_pipe"

# The pipeline and its face: what chains stages, reads recipes for them or starts them.
PIPELINE = {f"qerl_pipe.{name}" for name in
            ("dag", "runner", "pipeline", "stages", "orchestration", "eval_inputs", "lineage", "sources", "cli")}
RL = {"qerl_pipe.rl", "qerl_pipe.rl.algo", "qerl_pipe.rl.task", "qerl_pipe.rl.loop"}
# The core takes plain numbers and dataclasses: it never reaches the RL, the jobs, the recipe or the pipeline.
ABOVE_CORE = PIPELINE | RL | {"qerl_pipe.jobs", "qerl_pipe.recipe"}
FORBIDDEN = {
    "qerl_pipe.formats": ABOVE_CORE | {"qerl_pipe.model", "qerl_pipe.kernels", "qerl_pipe.engine", "qerl_pipe.memory"},
    "qerl_pipe.kernels": ABOVE_CORE | {"qerl_pipe.model", "qerl_pipe.engine", "qerl_pipe.memory"},
    "qerl_pipe.model": ABOVE_CORE | {"qerl_pipe.engine", "qerl_pipe.memory"},
    "qerl_pipe.engine": ABOVE_CORE | {"qerl_pipe.memory"},  # memory models the engine's KV cache, not the reverse
    "qerl_pipe.memory": ABOVE_CORE,
    # RL takes a TrainConfig, not the recipe; within it the method and the task stand alone.
    "qerl_pipe.rl.algo": PIPELINE | {"qerl_pipe.jobs", "qerl_pipe.recipe", "qerl_pipe.rl.task", "qerl_pipe.rl.loop"},
    "qerl_pipe.rl.task": PIPELINE | {"qerl_pipe.jobs", "qerl_pipe.recipe", "qerl_pipe.rl.algo", "qerl_pipe.rl.loop"},
    "qerl_pipe.rl.loop": PIPELINE | {"qerl_pipe.jobs", "qerl_pipe.recipe"},
    "qerl_pipe.jobs": PIPELINE,
}
LAB = "qerl_lab"
# The only edge from the product to the lab: in a method of cli.py's `bench` group, run when a bench
# command is asked for (tests/lab/test_lab_cli.py checks that `import qerl_pipe.cli` does not run it).
LAB_HOOK = ("cli.py", "_load", "qerl_lab.cli")


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    return {id(n) for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}


def _imported(path: Path) -> Iterator[str]:
    """The qerl_pipe modules `path` imports (and `module.name` for each name imported from one)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


def unit(module: str) -> str | None:
    """The package `module` belongs to: a direct child of qerl_pipe (`qerl_pipe.engine`,
    `qerl_pipe.dag`), rl's sub-packages counted apart; None outside qerl_pipe or for its root."""
    parts = module.split(".")
    if parts[0] != "qerl_pipe" or len(parts) < 2:
        return None
    return ".".join(parts[:3] if parts[1] == "rl" and len(parts) > 2 else parts[:2])


def import_graph() -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the file-level edges (`a.py -> qerl_pipe.x.y`) that make it."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        source = unit(module)
        for target in _imported(path):
            dest = unit(target)
            if source is not None and dest is not None and dest != source:
                graph.setdefault(source, {}).setdefault(dest, set()).add(f"{path.relative_to(PACKAGE)} -> {target}")
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_third_package():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_package_imports_itself_through_others():
    graph = import_graph()
    found = cycles({source: set(targets) for source, targets in graph.items()})
    detail = {(a, b): sorted(graph[a][b])[:3] for comp in found for a in comp for b in comp if b in graph.get(a, {})}
    assert found == [], detail


def test_the_lower_layers_never_import_the_ones_above():
    graph = import_graph()
    assert set(FORBIDDEN) <= set(graph)  # every guarded package exists and imports something
    broken = {(source, target): sorted(edges)[:3] for source, banned in FORBIDDEN.items()
              for target, edges in graph[source].items() if target in banned}
    assert broken == {}


def _lab_imports(path: Path) -> Iterator[tuple[str, str]]:
    """(enclosing function or `<module>`, module) for each import of the lab in `path`, TYPE_CHECKING ones too."""
    tree = ast.parse(path.read_text())
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    where = {id(inner): f.name for f in functions for inner in ast.walk(f)}  # innermost last: ast.walk is breadth first
    for node in ast.walk(tree):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            if name == LAB or name.startswith(LAB + "."):
                yield where.get(id(node), "<module>"), name


def test_the_lab_finder_finds_an_import_and_where_it_stands(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import qerl_lab\nimport qerl_labs\ndef f():\n    from qerl_lab.cli import x\n")
    assert list(_lab_imports(sample)) == [("<module>", "qerl_lab"), ("f", "qerl_lab.cli")]


def test_the_product_never_imports_the_lab():
    edges = {(str(path.relative_to(PACKAGE)), function, module)
             for path in PACKAGE.rglob("*.py") for function, module in _lab_imports(path)}
    assert edges == {LAB_HOOK}, "qerl_pipe must not import the lab (qerl_lab/): the lab imports the product"


def test_only_the_labs_own_tests_import_the_lab():
    tests = PACKAGE.parent / "tests"
    importers = sorted(str(path.relative_to(tests)) for path in tests.rglob("*.py")
                       if path.parent.name != "lab" and any(_lab_imports(path)))
    assert len(list((tests / "lab").glob("test_*.py"))) > 5 and importers == [], \
        "product tests import no lab module: move the test to tests/lab/, or the helper it needs into qerl_pipe"


def test_a_stage_entry_point_is_orchestration_of_at_most_40_lines():
    entries = {}
    for path in (PACKAGE / "stages").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Call) and getattr(d.func, "id", "") == "register" for d in node.decorator_list):
                entries[f"{path.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert len(entries) == 7  # one per stage, the GGUF import included
    assert {name: n for name, n in entries.items() if n > 40} == {}, "move the work into jobs/ or a library module"


def test_the_generation_loop_never_reaches_into_the_engine_or_its_runner():
    """engine.py's loop asks `ModelRunner` (admit / prefill / step / move / release) and never
    reads or writes a private attribute of another object: no `x._name` but on `self`."""
    import re

    source = (Path(__file__).parents[2] / "qerl_pipe" / "engine" / "engine.py").read_text()
    reaching = [line.strip() for line in source.splitlines()
                if re.search(r"\b(?!self\b)\w+\._[a-z]\w*", line.split("#")[0])
                and not line.lstrip().startswith(("from ", "import "))]
    assert reaching == [], reaching
    assert re.search(r"\bself\.(engine|runner)\._", source) is None
