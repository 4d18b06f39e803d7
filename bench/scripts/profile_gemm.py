"""Run decode-GEMM configs on 7B layers for ncu to profile (two launches each; profile the second).

`ncu --clock-control none --section SpeedOfLight --section WarpStateStats -k regex:gemm_kernel
python3 bench/scripts/profile_gemm.py [--m 64]`: at M = 64 it runs, on 7B gate_up and o, the best
register-ring config of bench/results/kernels-cuda-h200.json (84544ba), and on o the same split in
two (the staged kernel it also profiled then was deleted: no table row picked it). `--defaults`
runs instead, on all four 7B layers, the config the engine launches at that M
(`cuda_ext.default_config`: the H200 table's), i.e. what a decode step profiles.
"""
import argparse

import torch

from qerl_pipe.formats.nvfp4 import quantize_nvfp4_in_row_chunks
from qerl_pipe.kernels import cuda_ext
from qerl_pipe.kernels.tiled import tile_nvfp4

RING = cuda_ext.GemmConfig(2, 8, 4, 4, 2, 1)
CONFIGS = {
    "gate_up": (37888, 3584, [RING]),
    "o": (3584, 3584, [RING, cuda_ext.GemmConfig(2, 8, 4, 4, 2, 2)]),
}
LAYERS_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}

ap = argparse.ArgumentParser()
ap.add_argument("--m", type=int, default=64)
ap.add_argument("--defaults", action="store_true", help="the engine's config for each 7B layer at this M")
args = ap.parse_args()
if args.defaults:
    sms = cuda_ext.sm_count(torch.device("cuda"))
    CONFIGS = {name: (n, k, [cuda_ext.default_config(args.m, n, k, sms)]) for name, (n, k) in LAYERS_7B.items()}
for name, (n, k, configs) in CONFIGS.items():
    tq = tile_nvfp4(quantize_nvfp4_in_row_chunks(torch.randn(n, k, device="cuda") * 0.02, name=name))
    x = torch.randn(args.m, k, device="cuda").to(torch.bfloat16)
    for cfg in configs:
        for _ in range(2):
            cuda_ext.gemm(x, tq, config=cfg)
        torch.cuda.synchronize()
        print(name, cfg, flush=True)
print("profile run done")
