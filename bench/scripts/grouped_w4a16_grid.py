"""Probe: our grouped W4A16 GEMM on a Qwen3-30B-A3B layer's NVFP4 expert stacks, with its grid over
the routed experts only (`active`, as the routing kernel lists them) or over all 128, against
torch's bf16 grouped GEMM on the same routed rows; 1, 8 and 64 tokens (k = 8), in CUDA graphs.

The grid question: CTAs of experts that got no rows exit at once, but a batch-1 step routes to 8
of 128 experts, so a grid over all of them launches 16x the CTAs that work. With --sweep, every
compiled variant of the grouped kernel is timed too (`sweep`, µs by config): the
default takes tokens per pass from the most rows an expert can get (T), which at T = 64 and about
4 rows per expert spends most MMAs on empty token columns, where a smaller pass would not (at
the cost of more passes in the grid, which exit where an expert has no rows left).

python3 bench/scripts/grouped_w4a16_grid.py --out FILE.json [--sweep]
"""
import argparse
import json
import time
from pathlib import Path

import torch

from qerl_lab.results import results_file
from qerl_pipe.formats.nvfp4 import quantize_nvfp4
from qerl_pipe.kernels import cuda_ext, triton_moe
from qerl_pipe.model.kernel_copies import stack_expert_buffers
from qerl_pipe.model.linear import QuantLinear

ap = argparse.ArgumentParser()
ap.add_argument("--out", type=Path, required=True)
ap.add_argument("--sweep", action="store_true", help="time every compiled variant that fits a grouped launch")
args = ap.parse_args()
torch.manual_seed(0)
E, K_TOP = 128, 8


def timeit(fn, n: int = 50) -> float:
    """Microseconds per call, replayed from a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


stacks = {}
for name, n, kd in (("gate_up", 1536, 2048), ("down", 2048, 768)):
    linears = [QuantLinear(kd, [n], ["w"], "nvfp4", torch.bfloat16, "cuda") for _ in range(E)]
    for lin in linears:
        lin.set_base(quantize_nvfp4(torch.randn(n, kd, device="cuda") * 0.02))
    stacks[name] = (stack_expert_buffers(linears), n, kd)
results = {}
for tokens in (1, 8, 64):
    logits = torch.randn(tokens, E, device="cuda", dtype=torch.bfloat16)
    _, _, source, _, offsets, active = triton_moe.launch_route(logits, K_TOP, True, torch.bfloat16)
    for name, (st, n, kd) in stacks.items():
        rows = torch.randn(tokens * K_TOP, kd, device="cuda", dtype=torch.bfloat16)

        def ours(active=active):
            return cuda_ext.grouped_gemm(rows, st.qweight, st.scales, st.global_scale, offsets, n, kd, tokens, active)

        w = torch.randn(E, kd, n, device="cuda", dtype=torch.bfloat16) * 0.02
        ends = offsets[1:].to(torch.int32)
        results[f"T{tokens}:{name}"] = {
            "ours_active_us": round(timeit(ours), 2), "ours_all_experts_grid_us": round(timeit(lambda: ours(None)), 2),
            "bf16_grouped_mm_us": round(timeit(lambda: torch._grouped_mm(rows, w, offs=ends)), 2)}
        del w
        if args.sweep:
            sweep, reference = {}, ours().float()
            for config in cuda_ext.grouped_configs():

                def run(c=config):
                    return cuda_ext.grouped_gemm(rows, st.qweight, st.scales, st.global_scale, offsets, n, kd, tokens,
                                                 active, c)

                error = float((run().float() - reference).norm() / reference.norm())
                sweep[str(config)] = {"us": round(timeit(run), 2), "rel_diff_from_default": error}
            results[f"T{tokens}:{name}"]["sweep"] = sweep
            results[f"T{tokens}:{name}"]["sweep_best"] = min(sweep.items(), key=lambda kv: kv[1]["us"])
        print(tokens, name, {k: v for k, v in results[f"T{tokens}:{name}"].items() if k != "sweep"}, flush=True)
args.out.write_text(json.dumps(results_file(results, []), indent=1) + "\n")
