"""Whether a kernel backend that may not run everywhere (our CUDA kernels, humming-kernels,
bitsandbytes) runs on a device: asked once per device, and said once, in one line, when it does
not (other kernels then serve its rows)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import lru_cache

import torch

log = logging.getLogger(__name__)


def availability(why_unavailable: Callable[[torch.device], str | None], what: str,
                 fallback: str) -> Callable[[torch.device | str], bool]:
    """An `available(device)` for a backend: `why_unavailable(device)` (None when it runs) is asked once per
    device (no index: the current one), and a refusal is logged as "`what` off on DEVICE (why); `fallback`"."""

    @lru_cache(maxsize=None)
    def _available(device: torch.device) -> bool:
        why = why_unavailable(device)
        if why is not None:
            log.warning("%s off on %s (%s); %s", what, device, why, fallback)
        return why is None

    def available(device: torch.device | str) -> bool:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        return _available(device)

    return available


def failure(exc: BaseException) -> str:
    """An exception as the one-line reason a backend's log line gives: its type and first line."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"
