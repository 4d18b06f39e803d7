"""Logging and progress on stderr: stdout is reserved for the artifact path, so shells can chain stages."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
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


# Off a terminal (a log file, CI, a scheduler) a bar prints nothing: a plain line at most this often
# shows that the work goes on, without flooding the log.
PLAIN_EVERY_S = 30.0


def progress(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate with a progress bar on stderr; when stderr is not a terminal, a plain line
    `description: done/total` at most every PLAIN_EVERY_S seconds."""
    if not console.is_terminal:
        started = last = time.monotonic()
        for done, item in enumerate(items, 1):
            yield item
            now = time.monotonic()
            if now - last >= PLAIN_EVERY_S:
                last = now
                log(f"{description}: {done}/{total if total is not None else '?'} after {now - started:.0f} s")
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)


@contextmanager
def heartbeat(description: str) -> Iterator[None]:
    """For one long call that reports nothing (a whole batch of generation): off a terminal, a line
    every PLAIN_EVERY_S seconds that it is still running."""
    if console.is_terminal:
        yield
        return
    stop = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not stop.wait(PLAIN_EVERY_S):
            log(f"{description}: still running after {time.monotonic() - started:.0f} s")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
