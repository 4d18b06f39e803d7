"""`qerl-pipe train --nproc N`: the same command again on N processes through torchrun.

PyTorch's launcher, `--standalone` on a free local port, with NVLink multicast off in the workers'
environment; rank 0 alone prints the artifact path. See docs/training.md, section "Several GPUs"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from qerl_pipe.errors import QerlError
from qerl_pipe.rl.loop.distributed import disable_nvls, launched_by_torchrun
from qerl_pipe.stops import Stopped


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """The torchrun invocation of `qerl-pipe ARGS` on `nproc` local processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "qerl_pipe", *args]


def relaunch(nproc: int, args: list[str]) -> int:
    """Run `qerl-pipe ARGS` on `nproc` processes; returns torchrun's exit status."""
    if launched_by_torchrun():
        raise QerlError("--nproc was given inside a torchrun worker; pass --nproc or use torchrun, not both")
    proc = subprocess.Popen(torchrun_command(nproc, args), env=disable_nvls(dict(os.environ)))
    try:
        return proc.wait()
    except Stopped as exc:
        # A Ctrl-C reaches the whole process group; a SIGTERM only this process, so it is passed on
        # (torchrun hands it to the workers, which save their step). Never killed: workers would
        # train on, orphaned.
        if exc.signum == signal.SIGTERM:
            proc.send_signal(signal.SIGTERM)
        proc.wait()
        raise
