"""Every JSON text qerl-pipe writes goes through here, so every one is strict JSON.

A NaN or infinity (which Python's `json` writes bare) is refused with the key that holds it, before
the file is written. See docs/architecture.md, section "Where each kind of change goes"."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from qerl_pipe.errors import QerlError


class NonFiniteError(QerlError):
    """A value about to be written as JSON holds NaN or an infinity."""


def _first_non_finite(value: Any, where: str = "") -> tuple[str, float] | None:
    """(key path, value) of the first NaN or infinity in `value`, depth first."""
    if isinstance(value, float) and not math.isfinite(value):
        return where or "(the value itself)", value
    if isinstance(value, dict):
        items = ((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for path, item in items:
        found = _first_non_finite(item, path)
        if found is not None:
            return found
    return None


def dumps(value: Any, **kwargs: Any) -> str:
    """`json.dumps` with `allow_nan=False`; a NaN or infinity is a NonFiniteError naming its key."""
    try:
        return json.dumps(value, allow_nan=False, **kwargs)
    except ValueError:
        found = _first_non_finite(value)
        if found is None:  # another ValueError (a circular reference): not ours to word
            raise
        raise NonFiniteError(f"{found[0]} is {found[1]}, which strict JSON cannot hold; nothing was written "
                             "(a NaN here means a computation failed upstream)") from None


def write_json(path: Path, value: Any, indent: int | None = 2, **kwargs: Any) -> None:
    """`value` as strict JSON in `path`, with a final newline (the text is made before the file is opened,
    so a refused value leaves no file behind)."""
    Path(path).write_text(dumps(value, indent=indent, **kwargs) + "\n")

