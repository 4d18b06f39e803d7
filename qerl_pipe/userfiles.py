"""Reading files a user hands us (data, configs, recipes), and saying in one line what is wrong
with the machine when a read or write fails: a traceback of UnicodeDecodeError or ENOSPC tells a
user neither which file nor what to do."""

from __future__ import annotations

import errno
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qerl_pipe.errors import QerlError


def read_user_text(path: Path, what: str, error: type[QerlError] = QerlError) -> str:
    """`path` as UTF-8 text; a file that is not UTF-8, or cannot be read, is an `error` naming it
    (the caller's own kind, which its callers may catch)."""
    try:
        return path.read_text(encoding="utf-8-sig")  # a leading byte-order mark (some editors write one) is not text
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); re-save it as UTF-8") from None
    except OSError as exc:
        raise error(f"cannot read {what}: {describe_os_error(exc)}") from None


def read_user_json(path: Path, what: str, error: type[QerlError] = QerlError) -> Any:
    """`path` parsed as JSON; invalid JSON is an `error` with the line and column to look at."""
    text = read_user_text(path, what, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
                    "fix the file or restore the original") from None


def read_jsonl_objects(path: Path, what: str, error: type[QerlError] = QerlError) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSONL file; a line that is not a JSON
    object is an `error` naming the file and the line."""
    for lineno, line in enumerate(read_user_text(path, what, error).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise error(f"{path}:{lineno}: not valid JSON (one object per line expected)") from None
        if not isinstance(row, dict):
            raise error(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        yield lineno, row


# errno -> what the user can do about it; the file and the system's reason come from the error.
_FIX = {
    errno.ENOSPC: "free space, or pass --artifacts on a larger disk (nothing of the unfinished artifact was kept)",
    errno.EDQUOT: "free space, or pass --artifacts on another disk",
    errno.EACCES: "give this user access to it, or choose another path",
    errno.EPERM: "give this user access to it, or choose another path",
    errno.EROFS: "choose a path on a writable file system (--artifacts)",
    errno.ENOTDIR: "a part of the path is a file, not a directory; choose another path",
    errno.EISDIR: "a directory is where a file was expected; choose another path",
    errno.ENOENT: "check the path",
}


def describe_os_error(exc: OSError, fix: str | None = None) -> str:
    """One line: the file, the system's reason and the fix (`fix`, else the usual one for the errno)."""
    where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
    reason = exc.strerror or str(exc)
    text = f"{where}: {reason}" if where else reason
    fix = fix or _FIX.get(exc.errno or 0)
    return f"{text}; {fix}" if fix else text


@contextmanager
def resumable_on_full_disk(work_dir: Path, has_checkpoint: Callable[[], bool]) -> Iterator[None]:
    """A full disk while a resumable stage works in `work_dir`: unlike an artifact's temporary
    directory, the work directory stays, so the fix is space and the same command, which resumes
    from the last checkpoint (`has_checkpoint()` says whether one was written yet)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        then = (f"it resumes from the last checkpoint in {work_dir}, which is kept" if has_checkpoint() else
                f"it starts the run over in {work_dir} (no checkpoint was written before the disk filled)")
        raise QerlError(describe_os_error(exc, f"free space, then run the same command again: {then}")) from None


DATA_FILE_SUFFIXES = (".jsonl", ".txt")


def _data_file(spec: str | None) -> Path | None:
    """The file a recipe's data spec names; None for packaged data and generated tasks."""
    if spec is None or not spec.endswith(DATA_FILE_SUFFIXES) or not Path(spec).is_file():
        return None
    return Path(spec)


def data_file_key(spec: str | None) -> str | None:
    """The sha256 of a data file named by a recipe (None for packaged data and generated tasks):
    an artifact id keyed by the path alone would reuse results of data edited since."""
    path = _data_file(spec)
    if path is None:
        return None
    from qerl_pipe.artifacts.manifest import sha256_file

    return sha256_file(path)


def data_spec_key(spec: str | None) -> str | None:
    """A data spec as artifact ids name it: a file by its resolved path (`data.jsonl`,
    `./data.jsonl` and its absolute path are one input; its content enters the id through
    `data_file_key`), anything else as it is."""
    path = _data_file(spec)
    return str(path.resolve()) if path is not None else spec
