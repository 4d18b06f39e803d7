"""Logging and progress on stderr: stdout is reserved for the artifact path, so shells can chain stages."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

T = TypeVar("T")
console = Console(stderr=True, highlight=False)


def log(message: str) -> None:
    console.print(message, markup=False, soft_wrap=True)


def quiet_transformers() -> None:
    """Turn off transformers' own tqdm bars: ours go to stderr, and theirs would interleave."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def progress(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate with a progress bar on stderr (plain lines when stderr is not a terminal)."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)
