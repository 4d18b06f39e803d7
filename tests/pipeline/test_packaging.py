"""The package's dependencies install without warnings: every extra asked of a dependency is one it provides;
its wheel holds the product (qerl_pipe) and the lab's modules (qerl_lab), not the lab's results or scripts."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def test_every_requested_extra_is_provided_as_spelled():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    asked = [Requirement(r) for r in project["dependencies"]]
    for req in asked:
        if not req.extras or (req.marker is not None and not req.marker.evaluate()):
            continue
        provided = set(importlib.metadata.metadata(req.name).get_all("Provides-Extra") or [])
        # pip matched "math-verify[antlr4_13_2]" against "antlr4-13-2" and warned it does not exist
        assert req.extras <= provided, (req, sorted(provided))
    assert any(r.name == "antlr4-python3-runtime" and "4.13.2" in str(r.specifier) for r in asked)
    assert importlib.metadata.version("antlr4-python3-runtime") == "4.13.2"


def test_the_wheel_holds_the_product_and_the_labs_modules_only(tmp_path):
    # Built from a copy of what the wheel is made of, the lab's results and scripts (bench/) included,
    # so that leaving them out is the package discovery's doing (pyproject's include list).
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("qerl_pipe", "qerl_lab", "bench"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", build, str(tmp_path / "dist")], cwd=source, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = zipfile.ZipFile(tmp_path / "dist" / done.stdout.split()[-1])
    names = wheel.namelist()
    info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    assert {n.split("/")[0] for n in names} == {"qerl_pipe", "qerl_lab", info}
    lab = {n for n in names if n.startswith("qerl_lab/")}
    assert lab == {f"qerl_lab/{p.name}" for p in (ROOT / "qerl_lab").glob("*.py")}  # no results, scripts or .sh
    assert {"qerl_lab/__init__.py", "qerl_lab/cli.py"} <= lab
    assert {"qerl_pipe/cli.py", "qerl_pipe/data/gsm8k/train.jsonl", "qerl_pipe/kernels/cuda/w4a16.cu"} <= set(names)
    assert "qerl-pipe = qerl_pipe.cli:main" in wheel.read(f"{info}/entry_points.txt").decode()
