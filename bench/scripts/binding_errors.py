"""Each bad call to the CUDA W4A16 binding in its own process: it must raise, not crash.

`python3 bench/scripts/binding_errors.py` on a Hopper GPU prints one line per case with the
child's exit code (0: a RuntimeError was raised and caught) and the error's first line.
"""

import subprocess
import sys

CASES = {
    "x float32": "cuda_ext.gemm(x.float(), tq)",
    "nb=0": "cuda_ext.gemm(x, tq, config=cuda_ext.GemmConfig(4, 0, 4, 1, 4, 3))",
    "wk=0": "cuda_ext.gemm(x, tq, config=cuda_ext.GemmConfig(4, 1, 4, 0, 4, 3))",
    "warps%wk": "cuda_ext.gemm(x, tq, config=cuda_ext.GemmConfig(4, 1, 6, 4, 4, 3))",
    "mt=3": "cuda_ext.gemm(x, tq, config=cuda_ext.GemmConfig(3, 1, 4, 1, 4, 1))",
    "depth=0": "cuda_ext.gemm(x, tq, config=cuda_ext.GemmConfig(4, 1, 4, 1, 0, 1))",
    "cpu bias": "cuda_ext.gemm(x, tq, torch.zeros(256, dtype=torch.bfloat16))",
}
PRELUDE = """
import torch
from qerl_pipe.formats.nvfp4 import quantize_nvfp4
from qerl_pipe.kernels import cuda_ext
from qerl_pipe.kernels.tiled import tile_nvfp4
tq = tile_nvfp4(quantize_nvfp4(torch.randn(256, 512, device="cuda") * 0.02))
x = torch.randn(4, 512, device="cuda").to(torch.bfloat16)
try:
    {call}
    print("no error raised")
except RuntimeError as exc:
    print("RuntimeError:", str(exc).splitlines()[0][:160])
"""

for name, call in CASES.items():
    proc = subprocess.run([sys.executable, "-c", PRELUDE.format(call=call)], capture_output=True, text=True)
    print(f"{name:10s} exit {proc.returncode}: {(proc.stdout or proc.stderr).strip().splitlines()[-1:]}", flush=True)
