"""Every compiled GEMM config (with and without split-K, bias and the LoRA expand) and the
dequantize pass on small odd shapes, for `compute-sanitizer --tool memcheck|racecheck`."""
import torch
from qerl_pipe.formats.nvfp4 import quantize_nvfp4
from qerl_pipe.kernels import cuda_ext
from qerl_pipe.kernels.tiled import tile_nvfp4
for n, k in ((100, 48), (333, 1088)):
    q = quantize_nvfp4(torch.randn(n, k, device="cuda"))
    tq = tile_nvfp4(q)
    bias = torch.randn(n, device="cuda").bfloat16()
    b = torch.randn(n, 32, device="cuda").bfloat16()
    for c in cuda_ext.compiled_configs(1) + cuda_ext.compiled_configs(3):
        for m in (1, 9, 70):
            x = torch.randn(m, k, device="cuda").bfloat16()
            cuda_ext.gemm(x, tq, config=c)
            cuda_ext.gemm(x, tq, bias, config=c, lora=(torch.randn(m, 32, device="cuda").bfloat16(), b))
    cuda_ext.dequantize(tq)
torch.cuda.synchronize(); print("sanitize run done")
