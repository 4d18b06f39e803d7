"""What the command line says besides errors: --help defaults, an interrupt, a wait on another process."""

from __future__ import annotations

import fcntl
import threading
import time

import pytest

from qerl_pipe.artifacts import ArtifactStore
from tests.stage_cli import cli


def test_help_shows_the_artifact_store_default():
    out = cli("quantize", "--help").stdout
    assert "./artifacts" in " ".join(out.split())  # rich dropped "[default: ./artifacts]" as markup


def test_ctrl_c_says_that_running_again_resumes(monkeypatch):
    import qerl_pipe.pipeline as pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(pipeline, "run_recipe", interrupted)
    result = cli("run", "recipes/quickstart.yaml", ok=False)
    assert result.exit_code == 130
    assert "stopped by SIGINT" in result.stderr and "resumes a train from its last checkpoint" in result.stderr


def test_sigterm_during_a_command_is_one_line_that_says_how_to_resume(monkeypatch):
    import os
    import signal

    import qerl_pipe.pipeline as pipeline

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler stops a job
        time.sleep(5)  # never reached: the handler raises at once
    def runner_hit(signum, frame):  # the command did not handle it: fail here, not end the test run
        raise RuntimeError("SIGTERM reached the test's own handler")
    monkeypatch.setattr(pipeline, "run_recipe", terminated)
    before = signal.signal(signal.SIGTERM, runner_hit)
    try:
        result = cli("run", "recipes/quickstart.yaml", ok=False)
        assert result.exit_code == 143 and signal.getsignal(signal.SIGTERM) is runner_hit, result.exception
    finally:
        signal.signal(signal.SIGTERM, before)
    assert result.stderr.strip() == ("stopped by SIGTERM: no partial artifact was kept; the same command again reuses "
                                     "the finished stages and resumes a train from its last checkpoint")


def test_a_training_loop_finishes_its_step_on_a_signal_and_stops_at_once_on_a_second():
    import os
    import signal

    import pytest

    from qerl_pipe.stops import Stopped, stop_after_step

    with stop_after_step("train") as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT  # recorded: the step in progress goes on
        with pytest.raises(Stopped) as now:
            os.kill(os.getpid(), signal.SIGTERM)
    assert now.value.exit_code == 143 and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_process_waiting_for_another_ones_lock_says_so(tmp_path, capsys):
    store = ArtifactStore(tmp_path)
    (tmp_path / ".locks").mkdir()
    held = (tmp_path / ".locks" / "demo-1.lock").open("w")
    fcntl.flock(held, fcntl.LOCK_EX)  # another process making demo-1
    release = threading.Timer(0.3, lambda: fcntl.flock(held, fcntl.LOCK_UN))
    release.start()
    started = time.monotonic()
    with store._lock("demo-1"):
        waited = time.monotonic() - started
    held.close()
    assert waited >= 0.2
    assert "waiting for another process that is making demo-1" in capsys.readouterr().err


def test_off_a_terminal_long_work_still_prints_a_line_now_and_then(monkeypatch, capsys):
    import qerl_pipe.log as qlog

    assert not qlog.console.is_terminal  # pytest captures stderr, as a log file or a scheduler would
    monkeypatch.setattr(qlog, "PLAIN_EVERY_S", 0.05)
    for _ in qlog.progress(range(4), "quantize", 4):
        time.sleep(0.06)
    with qlog.heartbeat("generating 8 responses"):
        time.sleep(0.13)
    err = capsys.readouterr().err
    assert "quantize: 1/4 after 0 s" in err and "quantize: 4/4" in err
    assert err.count("generating 8 responses: still running after") >= 2


def test_bench_kernels_cuda_refuses_an_m_it_does_not_measure():
    result = cli("bench", "kernels-cuda", "--ms", "1,3", ok=False)
    assert result.exit_code == 1
    assert "--ms [3]" in result.stderr and "1024" in result.stderr


def test_stage_help_says_where_the_recipe_keys_are_and_shows_flags_without_a_type():
    for command in ("calibrate", "quantize", "build-engine", "train", "export", "eval", "run"):
        out = " ".join(cli(command, "--help").stdout.split())
        assert "qerl-pipe keys" in out, command
        assert "<bool>" not in out and "--force" in out, command  # a flag takes no value
    assert "<bool>" not in cli("bench", "quantize", "--help").stdout


def test_eval_limit_zero_is_one_rule_for_the_flag_and_the_key(tmp_path):
    """`--limit 0` is a value like `--set eval.limit=0` (it used to be dropped as if left out, so
    eval ran every problem): both are refused before any work, naming the key."""
    for args in (["--limit", "0"], ["--set", "eval.limit=0"]):
        result = cli("eval", "--artifacts", tmp_path, "--model", "missing-model", *args, ok=False)
        assert result.exit_code == 1, result.stderr
        assert "eval.limit" in result.stderr and "greater than or equal to 1" in result.stderr, result.stderr


@pytest.mark.parametrize(("command", "then"), [
    (["quantize", "--recipe", "r.yaml"], "makes it anew"),
    (["train", "--recipe", "r.yaml"], "resumes the run from its last checkpoint, if one was written"),
    (["run", "r.yaml"], "reuses the finished stages and resumes a train from its last checkpoint")])
def test_the_stopped_line_speaks_of_the_command_that_stopped(monkeypatch, command, then):
    import qerl_pipe.cli as qcli

    monkeypatch.setattr(qcli, "_COMMAND", command)
    line = qcli._stopped_line(KeyboardInterrupt())
    assert line.startswith(f"stopped by SIGINT: no partial artifact was kept; the same command again {then}: qerl-pipe "
                           f"{command[0]}"), line
    assert ("a train" in line) == (command[0] == "run")  # a quantize is no train
