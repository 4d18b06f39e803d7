"""`qerl-pipe train --nproc N`: start the same command on N processes through torchrun.

The command runs again as `python -m torch.distributed.run --standalone --nproc-per-node N -m
qerl_pipe train ...` (PyTorch's own launcher, with a free local rendezvous port), in this
directory, with NVLink multicast switched off in the workers' environment (rl/loop/distributed.py says
why). Rank 0 prints the artifact path, so the last line of stdout is what one process prints.
"""

from __future__ import annotations

import os
import subprocess
import sys

from qerl_pipe.errors import QerlError
from qerl_pipe.rl.loop.distributed import disable_nvls, launched_by_torchrun


def torchrun_command(nproc: int, args: list[str]) -> list[str]:
    """The torchrun invocation of `qerl-pipe ARGS` on `nproc` local processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "qerl_pipe", *args]


def relaunch(nproc: int, args: list[str]) -> int:
    """Run `qerl-pipe ARGS` on `nproc` processes; returns torchrun's exit status."""
    if launched_by_torchrun():
        raise QerlError("--nproc was given inside a torchrun worker; pass --nproc or use torchrun, not both")
    env = disable_nvls(dict(os.environ))
    return subprocess.run(torchrun_command(nproc, args), env=env).returncode
