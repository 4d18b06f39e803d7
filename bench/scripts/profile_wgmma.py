"""Run the wgmma GEMM on 7B gate_up for ncu (two launches per config; profile the second).

`ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis
-k regex:wgmma_kernel python3 bench/scripts/profile_wgmma.py`: M = 64 and 256 at the configs the
engine launches there (`cuda_ext.default_config`: the shipped table's rows, which the sweep,
bench/scripts/wgmma_sweep.py, chose).
"""
import torch

from qerl_pipe.formats.nvfp4 import quantize_nvfp4_in_row_chunks
from qerl_pipe.kernels import cuda_ext
from qerl_pipe.kernels.tiled import tile_nvfp4

SMS = cuda_ext.sm_count(torch.device("cuda"))
RUNS = {m: cuda_ext.default_config(m, 37888, 3584, SMS) for m in (64, 256)}

tq = tile_nvfp4(quantize_nvfp4_in_row_chunks(torch.randn(37888, 3584, device="cuda") * 0.02, name="gate_up"))
for m, cfg in RUNS.items():
    x = torch.randn(m, 3584, device="cuda").to(torch.bfloat16)
    for _ in range(2):
        cuda_ext.gemm(x, tq, config=cfg)
    torch.cuda.synchronize()
    print(m, cfg, flush=True)
print("profile run done")
