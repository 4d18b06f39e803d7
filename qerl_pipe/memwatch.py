"""Host memory: peak resident memory over a region of code, and keeping freed tensors from pinning it.

`ru_maxrss` is the peak over the whole process lifetime, so it cannot tell what one stage used
after an earlier one loaded a whole model; sampling the current RSS during the region can."""

from __future__ import annotations

import gc
import os
import threading
from types import TracebackType

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
_MMAP_THRESHOLD_BYTES = 1 << 20


def return_freed_tensors_to_os() -> None:
    """Serve allocations of 1 MiB and more with mmap, so freeing a tensor gives its memory back: glibc
    raises its threshold after the first large free, and streamed shards grew RSS to the whole model
    (110 MB for 97 MB in 6 MB shards; 33 MB with a fixed threshold). The heap earlier work left free
    is handed back too, or a stage's `PeakRSS` read "+0 MB" by reusing it."""
    gc.collect()  # a model freed in a reference cycle still holds its tensors until collected
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def current_rss_bytes() -> int:
    """Resident memory the process owns (anonymous RSS: resident minus file-backed pages): shards are
    read through mmap, and their pages are page cache the kernel can drop, not the stage's memory."""
    try:
        with open("/proc/self/statm") as fh:
            fields = fh.read().split()
        return (int(fields[1]) - int(fields[2])) * _PAGE
    except OSError:  # not Linux: fall back to the lifetime peak
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS:
    """`with PeakRSS() as m: ...` then `m.start_bytes`, `m.peak_bytes`, `m.peak_increase_bytes`."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.start_bytes = self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())

    def __enter__(self) -> "PeakRSS":
        self.start_bytes = self.peak_bytes = current_rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, current_rss_bytes())

    @property
    def peak_increase_bytes(self) -> int:
        return self.peak_bytes - self.start_bytes
