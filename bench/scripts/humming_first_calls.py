"""Host time of humming's first call at each M after its compile (`HummingNVFP4.compile` at M = 1):
whether a new M, or a new M interval, costs more than a launch.

python3 bench/scripts/humming_first_calls.py --out FILE.json
"""
import argparse
import json
import time
from pathlib import Path

import torch

from qerl_lab.results import results_file
from qerl_pipe.formats.nvfp4 import quantize_nvfp4
from qerl_pipe.kernels.humming_backend import HummingNVFP4

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=4608)
ap.add_argument("--k", type=int, default=3584)
ap.add_argument("--ms", default="64,2304,10240,10240,9984,10112,16384,2304")
ap.add_argument("--out", type=Path, required=True)
args = ap.parse_args()

w = quantize_nvfp4(torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16) * 0.02)
t0 = time.perf_counter()
h = HummingNVFP4(w)
h.compile("humming")
torch.cuda.synchronize()
rows = [{"what": "build + compile at M = 1", "s": time.perf_counter() - t0}]
for m in (int(v) for v in args.ms.split(",")):
    x = torch.randn(m, args.k, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    h.matmul(x, "humming")
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    rows.append({"m": m, "host_s": host, "with_gpu_s": time.perf_counter() - t0})
    print(json.dumps(rows[-1]), flush=True)
args.out.write_text(json.dumps(results_file(rows, [], settings=vars(args) | {"out": None}), indent=1) + "\n")
