"""The package's dependencies install without warnings: every extra asked of a dependency is one it provides."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


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
