"""Where a run's numbers go: metrics.jsonl (one line per step), TensorBoard when it is installed,
a progress line on stderr, and PNG plots at the end."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from qerl_pipe.log import console, log
from qerl_pipe.strict_json import dumps

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOTS_DIR = "plots"
# (metrics key, plot title, y-axis label) of the PNGs written at the end.
PLOTTED = (("reward_mean", "reward", "mean reward of the step's responses"),
           ("accuracy", "accuracy", "fraction of responses correct"),
           ("entropy", "entropy", "mean token entropy (nats)"),
           ("sigma", "AQN sigma", "noise std on the norm weights"),
           ("response_length_mean", "response length (tokens)", "mean response length (tokens)"))
LENGTH_KEY = "response_length_mean"


class MetricsLog:
    """Appends one JSON line per step to `run_dir/metrics.jsonl` (flushed at once); opened at `first_step`
    (a resumed run), it drops the lines of later steps, which run again from the checkpoint."""

    def __init__(self, run_dir: Path, first_step: int = 0):
        self.path = run_dir / METRICS_FILE
        self.records: list[dict[str, Any]] = []
        if self.path.exists():
            lines = [line for line in self.path.read_text().splitlines() if line.strip()]
            self.records = [r for r in map(json.loads, lines) if r["step"] <= first_step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(dumps(r) + "\n" for r in self.records))
        tmp.replace(self.path)
        self._file = self.path.open("a")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional
            self._tb = None
        else:
            self._tb = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=first_step + 1 if first_step else None)

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._file.write(dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"train/{key}", value, record["step"])
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


@contextmanager
def step_progress(total: int, done: int) -> Iterator[Callable[[dict[str, Any]], None]]:
    """Yields `update(record)`: a bar with reward and ETA on a terminal, else one log line per step."""
    columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(),
               TextColumn("reward {task.fields[reward]}"), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("train", total=total, completed=done, reward="-")

        def update(r: dict[str, Any]) -> None:
            bar.update(task, advance=1, reward=f"{r['reward_mean']:.3f}")
            if not console.is_terminal:
                log(step_line(r, total))

        yield update


def step_line(r: dict[str, Any], total: int) -> str:
    """The one log line per step a run prints when stderr is not a terminal."""
    return (f"train: step {r['step']}/{total} reward {r['reward_mean']:.3f} accuracy {r['accuracy']:.3f} "
            f"length {r['response_length_mean']:.1f} sigma {r['sigma']:.2g} lr {r['lr']:.2g} "
            f"{r['step_seconds']:.1f} s")


def greedy_line(when: str, result: dict[str, Any], data: str) -> str:
    """The log line of the greedy evaluation `when` ('before' / 'after') training."""
    return (f"train: greedy accuracy {when} training {result['accuracy']:.3f} "
            f"({result['correct']}/{result['total']} of {data})")


def plot_figures(records: list[dict[str, Any]], token_cap: int | None = None) -> list[tuple[str, Any]]:
    """(file name, matplotlib figure) per PLOTTED metric that has a finite value, against the step;
    the length plot has a dashed line at `token_cap` (train.max_new_tokens), where responses are cut."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    figures = []
    for key, title, ylabel in PLOTTED:
        values = [r.get(key) for r in records]
        if not any(isinstance(v, (int, float)) and math.isfinite(v) for v in values if v is not None):
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, [math.nan if v is None else v for v in values], marker="." if len(steps) < 50 else None)
        if key == LENGTH_KEY and token_cap is not None:
            ax.axhline(token_cap, color="tab:red", linestyle="--", linewidth=1,
                       label=f"max_new_tokens = {token_cap} (cut here)")
            ax.legend(loc="lower right", fontsize="small")
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        figures.append((f"{key}.png", fig))
    return figures


def write_plots(records: list[dict[str, Any]], out_dir: Path, token_cap: int | None = None) -> list[str]:
    """One PNG per PLOTTED metric (`plot_figures`); returns the file names ([] and a log line when
    matplotlib is not installed)."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        log("train: matplotlib is not installed, so no plots were written (pip install matplotlib)")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in plot_figures(records, token_cap):
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(name)
    return written
