"""Running stage commands in-process, as the CLI tests of every stage do."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from qerl_pipe.cli import app

runner = CliRunner()


def cli(*args, ok: bool = True):
    """Invoke `qerl-pipe ARGS`; with ok, fail the test (showing stderr) on a non-zero exit."""
    result = runner.invoke(app, [str(a) for a in args])
    if ok:
        assert result.exit_code == 0, result.stderr + str(result.exception)
    return result


def last_line(result) -> Path:
    """The artifact directory a stage command prints last."""
    return Path(result.stdout.strip().splitlines()[-1])


def named(store: Path, prefix: str) -> list[str]:
    """Names in the store that start with `prefix` (none when the store does not exist)."""
    return sorted(p.name for p in store.iterdir() if p.name.startswith(prefix)) if store.exists() else []
