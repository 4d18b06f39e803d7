"""`qerl-pipe compare ARM...`: training arms (train runs, or eval artifacts of a run's adapter) side by
side, one table and one figure. See docs/eval.md, section "Comparing arms"."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_pipe.errors import QerlError
from qerl_pipe.rl.loop.metrics import METRICS_FILE
from qerl_pipe.userfiles import read_jsonl_objects, read_user_json

# (metrics key, panel title) of the figure, each against steps.
PANELS = (("reward_mean", "training reward"), ("accuracy", "training accuracy (sampled)"),
          ("entropy", "policy entropy (nats/token)"), ("response_length_mean", "response length (tokens)"))
SMOOTH = 5  # steps in a plotted moving average; the raw curve is drawn faintly under it


@dataclass
class Arm:
    """One arm's step records (metrics.jsonl), settings (run.json) and evaluations."""

    name: str
    records: list[dict[str, Any]]
    run: dict[str, Any] = field(default_factory=dict)
    greedy: dict[str, dict[str, Any]] = field(default_factory=dict)  # "before" / "after": the run's
    eval_report: dict[str, Any] | None = None  # an eval artifact's report.json


def read_run(run_dir: Path, name: str) -> Arm:
    """A train run's arm: its records, run.json and greedy evaluations (`eval/before|after.json`)."""
    if not (run_dir / METRICS_FILE).is_file():
        raise QerlError(f"{run_dir} has no {METRICS_FILE}; pass a train run (its artifact or its .runs/ directory) "
                        "or an eval artifact of a run's adapter")
    records = [row for _, row in read_jsonl_objects(run_dir / METRICS_FILE, "metrics file")]
    run = read_user_json(run_dir / "run.json", "run.json") if (run_dir / "run.json").is_file() else {}
    greedy = {when: read_user_json(path, "greedy evaluation") for when in ("before", "after")
              if (path := run_dir / "eval" / f"{when}.json").is_file()}
    return Arm(name, records, run, greedy)


def read_arm(path: Path, name: str | None = None) -> Arm:
    """The arm at `path`: a run (artifact or work directory), or an eval artifact whose adapter is a
    run of the same store (found beside it)."""
    if not path.is_dir():
        raise QerlError(f"{path} is not a directory; pass a train run or an eval artifact")
    name = name or path.name
    report = path / "report.json"
    if (path / METRICS_FILE).is_file() or not report.is_file():
        return read_run(path, name)
    evaluated = read_user_json(report, "eval report")
    adapter = evaluated.get("adapter") or {}
    run_id = adapter.get("artifact") if isinstance(adapter, dict) else None
    if run_id is None:
        raise QerlError(f"{path} evaluated no run's adapter; pass the run itself (or an eval with --adapter RUN)")
    run_dir = path.parent / f"train-{run_id}"
    if not run_dir.is_dir():
        raise QerlError(f"{path} evaluated run train-{run_id}, which is not beside it in {path.parent}; pass the run")
    arm = read_run(run_dir, name)
    arm.eval_report = evaluated
    return arm


def mean_of(records: list[dict[str, Any]], key: str) -> float | None:
    """The mean of `key` over the records that have it (None: none has)."""
    # A step with no trainable group has no entropy (None): skipped.
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def summarize(arm: Arm, reference: str | None = None) -> dict[str, Any]:
    """The table's row of an arm."""
    records = arm.records
    tenth = max(1, len(records) // 10)
    train = arm.run.get("train", {})
    processes = arm.run.get("processes", 1)
    report = arm.eval_report or {}
    peaks = [r["peak_gpu_memory_gib"] for r in records if r.get("peak_gpu_memory_gib") is not None]
    return {
        "arm": arm.name, "steps": len(records), "adapter": train.get("adapter", "lora") if train else None,
        "aqn": train.get("aqn", {}).get("schedule") if train else None, "lr": train.get("lr"),
        "reward_first_tenth": mean_of(records[:tenth], "reward_mean"),
        "reward_last_tenth": mean_of(records[-tenth:], "reward_mean"),
        "greedy_before": arm.greedy.get("before", {}).get("accuracy"),
        "greedy_after": arm.greedy.get("after", {}).get("accuracy"),
        "pass@1": report.get("pass@1"), "eval_data": report.get("data"),
        "entropy_first_tenth": mean_of(records[:tenth], "entropy"),
        "entropy_last_tenth": mean_of(records[-tenth:], "entropy"),
        "gpu_hours": sum(r.get("step_seconds", 0.0) for r in records) * processes / 3600 if peaks else None,
        "peak_gpu_memory_gib": max(peaks) if peaks else None, "reference": reference,
    }


COLUMNS = (("arm", "arm"), ("steps", "steps"), ("reward_first_tenth", "reward, first tenth"),
           ("reward_last_tenth", "reward, last tenth"), ("greedy_before", "greedy before"),
           ("greedy_after", "greedy after"), ("pass@1", "pass@1"), ("entropy_last_tenth", "entropy, last tenth"),
           ("gpu_hours", "GPU hours"), ("peak_gpu_memory_gib", "peak GiB"), ("reference", "reference"))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (a column no arm has is left out)."""
    shown = [(key, title) for key, title in COLUMNS if any(r.get(key) is not None for r in rows)]
    lines = ["| " + " | ".join(title for _, title in shown) + " |", "|" + "---|" * len(shown)]
    lines += ["| " + " | ".join(_cell(r.get(key)) for key, _ in shown) + " |" for r in rows]
    return "\n".join(lines)


def _smoothed(values: list[float]) -> list[float]:
    return [sum(values[max(0, i - SMOOTH + 1):i + 1]) / len(values[max(0, i - SMOOTH + 1):i + 1])
            for i in range(len(values))]


def plot(arms: list[Arm], out: Path, title: str) -> bool:
    """One PNG: a panel per `PANELS` metric against steps, every arm in each; False (nothing
    written) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    for ax, (key, label) in zip(axes.flat, PANELS):
        for arm in arms:
            kept = [r for r in arm.records if r.get(key) is not None]
            if kept:
                steps, values = [r["step"] for r in kept], [r[key] for r in kept]
                (line,) = ax.plot(steps, _smoothed(values), label=arm.name, linewidth=1.6)
                ax.plot(steps, values, color=line.get_color(), alpha=0.2, linewidth=0.8)
        ax.set(xlabel="step", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title} ({SMOOTH}-step mean; raw faint)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def parse_arm(spec: str) -> tuple[str | None, Path]:
    """`NAME=PATH` or `PATH` (named by its directory)."""
    name, sep, path = spec.partition("=")
    return (name, Path(path)) if sep and name else (None, Path(spec))


def parse_references(specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        name, sep, figure = spec.partition("=")
        if not (sep and name and figure):
            raise QerlError(f"--reference {spec!r}: write ARM=FIGURE, e.g. qerl='GSM8K 90.8'")
        out[name] = figure
    return out
