import torch
from qerl_pipe.formats.nvfp4 import quantize_nvfp4, dequantize_nvfp4
from qerl_pipe.kernels import cuda_ext
from qerl_pipe.kernels.tiled import tile_nvfp4
for n, k in ((100, 48), (333, 1088)):
    q = quantize_nvfp4(torch.randn(n, k, device="cuda"))
    tq = tile_nvfp4(q)
    for c in cuda_ext.compiled_configs(1) + cuda_ext.compiled_configs(3):
        for m in (1, 9, 70):
            cuda_ext.gemm(torch.randn(m, k, device="cuda").bfloat16(), tq, config=c)
    cuda_ext.dequantize(tq)
torch.cuda.synchronize(); print("sanitize run done")
