"""The arms across seeds: per arm, each summary figure's value in every seed with its mean, spread
and range, and each of the paper's claims with the number of seeds where it held.

Reads the `arms.json` files `qerl-pipe bench arms` wrote, one per seed (same arm names), and writes
one results JSON:

    qerl-pipe bench seeds SEED0/arms.json SEED1/arms.json ... --out seeds.json
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qerl_lab.results import nulls_for_non_finite, results_file, target
from qerl_pipe.errors import QerlError
from qerl_pipe.strict_json import write_json

FIGURES = ("greedy_accuracy_before", "greedy_accuracy_after", "reward_first_tenth", "reward_last_tenth",
           "entropy_first_tenth", "step_reward_0.5", "step_reward_0.8")


def spread(values: list[float | None]) -> dict[str, Any]:
    """The values as given (None where a seed lacks the figure) and, over those present, n, mean,
    sample standard deviation (n >= 2), min and max."""
    present = [v for v in values if v is not None]
    out: dict[str, Any] = {"values": values, "n": len(present)}
    if present:
        out.update(mean=statistics.fmean(present), min=min(present), max=max(present),
                   std=statistics.stdev(present) if len(present) > 1 else None)
    return out


def across_seeds(files: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per-arm figures over the seeds (arms in first-seen order) and the claims with how often they held."""
    rows = [{r["arm"]: r for r in f["results"]} for f in files]
    names = list(dict.fromkeys(name for seed in rows for name in seed))
    results = [{"arm": name, "seeds": sum(name in seed for seed in rows),
                **{fig: spread([seed[name].get(fig) if name in seed else None for seed in rows]) for fig in FIGURES}}
               for name in names]
    claims: dict[str, list[dict[str, Any]]] = {}
    for f in files:
        for t in f["targets"]:
            claims.setdefault(t["name"], []).append(t)
    targets = [target(f"{name} (in every seed checked)", seen[0]["target"],
                      sum(t["met"] for t in seen), f"of {len(seen)} seeds held", all(t["met"] for t in seen))
               for name, seen in claims.items()]
    return results, targets


def summarize_seeds(arms_files: Sequence[Path], out: Path, note: str = "", gpu: str | None = None) -> dict[str, Any]:
    """`qerl-pipe bench seeds`: the arms.json of each seed side by side, written to `out`."""
    missing = [str(p) for p in arms_files if not p.is_file()]
    if missing:
        raise QerlError(f"no such arms file: {', '.join(missing)}; write each with `qerl-pipe bench arms`")
    files = [json.loads(p.read_text()) for p in arms_files]
    results, targets = across_seeds(files)
    extra = {"gpu": gpu} if gpu else {}
    result = results_file(results, targets, note=note, sources=[str(p) for p in arms_files], **extra)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, nulls_for_non_finite(result))
    return result
