"""Stopping on SIGINT or SIGTERM: cleanly, and with one line that says how to resume.

While a command runs both raise `Stopped` (a KeyboardInterrupt); `stop_after_step` lets a training
step finish and be saved first, a second signal stops at once. See docs/pipeline.md, section
"The artifact store (`qerl_pipe/artifacts/`)", and docs/training.md, "Checkpoints and resume"."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Callable

from qerl_pipe.log import log

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """The process was asked to stop by `signum`; `detail` says what was saved (or is empty)."""

    def __init__(self, signum: int, detail: str = "") -> None:
        super().__init__(signum, detail)
        self.signum, self.detail = signum, detail

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


@contextmanager
def _handling(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """`handler` for SIGINT and SIGTERM while the block runs (the main thread alone may set one)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While a command runs: SIGINT and SIGTERM raise `Stopped` where the process is."""
    with _handling(_raise):
        yield


@dataclass
class StopRequest:
    """The signal that asked a loop to stop after its current step (None: none yet)."""

    signum: int | None = None


@contextmanager
def stop_after_step(what: str) -> Iterator[StopRequest]:
    """For a loop of steps: the first signal is recorded (the loop checks `signum` after each step,
    saves it, and raises `Stopped`); a second raises `Stopped` at once."""
    request = StopRequest()

    def handler(signum: int, frame: FrameType | None) -> None:
        if request.signum is not None:
            raise Stopped(signum)
        request.signum = signum
        log(f"{what}: {signal.Signals(signum).name}: stopping once the step in progress is done and saved "
            "(the same signal again stops at once, losing that step)")

    with _handling(handler):
        yield request
