"""The lab (the package `bench`, beside qerl_pipe): `qerl-pipe bench` reaches it only when a bench
command is asked for, so the product's start-up imports none of it (tests/pipeline/test_layers.py holds the
source to that one hook)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs the typer app as `qerl-pipe ARGS` in a fresh interpreter, then prints the lab modules loaded.
PROBE = """
import json, sys
from typer.testing import CliRunner
import qerl_pipe.cli
loaded = lambda: sorted(m for m in sys.modules if m == "qerl_lab" or m.startswith("qerl_lab."))
after_import = loaded()
result = CliRunner().invoke(qerl_pipe.cli.app, sys.argv[1:])
print(json.dumps({"import": after_import, "run": loaded(), "exit": result.exit_code, "output": result.output}))
"""


# Makes the package qerl_lab unfindable, as in an install made before the lab left qerl_pipe/.
WITHOUT_THE_LAB = """
import importlib.abc
class NoLab(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "qerl_lab":
            raise ModuleNotFoundError("No module named 'qerl_lab'", name="qerl_lab")
sys.meta_path.insert(0, NoLab())
"""


def probe(*args: str, lab: bool = True) -> dict:
    code = PROBE if lab else PROBE.replace("import qerl_pipe.cli", WITHOUT_THE_LAB + "import qerl_pipe.cli")
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_start_up_and_the_top_level_help_import_no_benchmark():
    seen = probe("--help")
    assert seen["exit"] == 0 and "bench" in seen["output"] and "Benchmarks; results are JSON" in seen["output"]
    assert seen["import"] == [] and seen["run"] == []  # an eager `import qerl_lab...` in qerl_pipe fails here


def test_the_bench_commands_load_the_lab_and_their_own_benchmark_only_when_run():
    listed = probe("bench", "--help")
    assert listed["exit"] == 0 and "train-step" in listed["output"] and "quantize-methods" in listed["output"]
    assert listed["import"] == [] and set(listed["run"]) <= {"qerl_lab", "qerl_lab.cli", "qerl_lab.results"}  # no benchmark
    refused = probe("bench", "kernels-cuda", "--ms", "1,3")  # a QerlError: the CLI's one line, exit 1
    assert refused["exit"] == 1 and "error: --ms [3]: this benchmark measures M in" in refused["output"]
    assert "qerl_lab.kernels_cuda" in refused["run"] and "qerl_lab.train_step" not in refused["run"]


def test_an_install_without_the_lab_says_so_in_one_line():
    assert probe("--help", lab=False)["exit"] == 0
    seen = probe("bench", "seeds", lab=False)
    assert seen["exit"] == 1 and seen["output"].strip().splitlines() == [
        "error: `qerl-pipe bench` needs the package qerl_lab (qerl_lab/ beside qerl_pipe/), which this install does not "
        "have; install the repository again (pip install -e . or pip install .)"]


def test_the_group_help_is_the_labs_own():
    import typer

    from qerl_lab.cli import bench_app
    from qerl_pipe.cli import app

    group = typer.main.get_command(app).get_command(None, "bench")
    assert group.help == bench_app.info.help


def test_a_results_file_names_the_command_that_made_it(monkeypatch):
    from qerl_lab.results import command_line

    for argv, said in ((["/somewhere/bin/qerl-pipe", "bench", "memory"], "qerl-pipe bench memory"),
                       ([str(ROOT / "qerl_pipe" / "__main__.py"), "bench", "seeds"], "python3 -m qerl_pipe bench seeds"),
                       ([str(ROOT / "qerl_lab" / "train_scaling.py"), "--worker"], "python3 -m qerl_lab.train_scaling --worker")):
        monkeypatch.setattr(sys, "argv", argv)
        assert command_line() == said
