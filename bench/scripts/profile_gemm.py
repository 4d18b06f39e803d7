"""Run the decode GEMM on 7B gate_up at M = 1 and 16 a few times, for ncu to profile one launch."""
import torch

from qerl_pipe.formats.nvfp4 import quantize_nvfp4_in_row_chunks
from qerl_pipe.kernels import cuda_ext
from qerl_pipe.kernels.tiled import tile_nvfp4

tq = tile_nvfp4(quantize_nvfp4_in_row_chunks(torch.randn(37888, 3584, device="cuda") * 0.02, name="gate_up"))
for m in (1, 16):
    x = torch.randn(m, 3584, device="cuda").to(torch.bfloat16)
    for _ in range(3):
        cuda_ext.gemm(x, tq)
torch.cuda.synchronize()
print("profile run done")
