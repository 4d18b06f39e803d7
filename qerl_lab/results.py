"""The self-describing results file every benchmark writes (command, commit, gpu, date, results, targets)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def current_commit() -> str:
    """The git commit of the code being measured (QERL_COMMIT wins, for copies without .git)."""
    if os.environ.get("QERL_COMMIT"):
        return os.environ["QERL_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({os.cpu_count()} cores)"


def target(name: str, target: str, measured: float, unit: str, met: bool) -> dict[str, Any]:
    return {"name": name, "target": target, "measured": measured, "unit": unit, "met": bool(met)}


def command_line() -> str:
    """How this process was started, without the machine's paths: `qerl-pipe ...` for the console
    script, `python3 -m qerl_pipe ...` or `python3 -m qerl_lab....` for a module run with -m (sys.argv[0]
    is then its file)."""
    if not sys.argv:
        return ""
    first, rest = Path(sys.argv[0]), sys.argv[1:]
    if "qerl-pipe" in first.name:
        return " ".join(["qerl-pipe", *rest])
    root = Path(__file__).resolve().parents[1]  # where the packages qerl_lab and qerl_pipe lie side by side
    try:
        module = ".".join(first.resolve().with_suffix("").relative_to(root).parts)
    except ValueError:
        return " ".join([first.name, *rest])
    return " ".join(["python3", "-m", module.removesuffix(".__main__"), *rest])


def results_file(results: Any, targets: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "command": command_line(),
        "commit": current_commit(),
        "gpu": device_name(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **extra,
        "results": results,
        "targets": targets,
    }


def nulls_for_non_finite(value: Any) -> Any:
    """`value` with every NaN or infinity replaced by None (JSON null): for measurements, where a
    NaN stands for a figure that could not be taken, so that a long run's results are never lost to one
    missing figure (the product's JSON refuses a NaN instead: qerl_pipe.strict_json)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: nulls_for_non_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nulls_for_non_finite(v) for v in value]
    return value
