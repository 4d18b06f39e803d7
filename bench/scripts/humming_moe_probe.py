"""Probe: humming-kernels' grouped MoE GEMM against our per-expert loop, at Qwen3-30B-A3B's expert shapes.

The per-expert path (`model/moe.py`, `run_experts`) sorts the (token, choice) rows by expert and
runs each expert's slice through the per-linear kernels: one host sync per layer, a launch per
expert and linear, no CUDA graph. The grouped path (`run_grouped`, the engine's for NVFP4 MoE
inference) gives the same sorted rows and the experts' offsets as a device tensor ([E + 1]) to
humming's `grouped_contiguous` GEMM in one launch. This answers, per linear (gate_up, down) and
row count, with the engine's own wrapper (`kernels.humming_experts.HummingExperts`): does it run
on our NVFP4 weights, match the loop, repeat and replay in a graph, and how fast is it against
the loop.

Beside it, four other ways to drop the host sync, timed at the same shapes:
- the NVFP4 stack (`kernels.torch_grouped.StackedExperts`): every expert dequantized in one launch,
  then torch's grouped GEMM (the training path, and prefills where humming's copies are not made);
- our grouped W4A16 GEMM on the same stack (`cuda_ext.grouped_gemm`: decode steps, up to 64 rows
  per expert), its grid over the routed experts only;
- dense over all experts: every token through every expert's linear as one NVFP4 GEMM (gate_up:
  the experts stacked along N, [E * N, K] at M = tokens; down: stacked along K, [N, E * K], the
  non-routed experts' inputs zeroed), our kernels as the dispatch picks them: E / k times the
  arithmetic, fixed shapes (a CUDA graph), no new kernel;
- the bf16 baseline's own: the same per-expert loop on bf16 weights and torch's grouped GEMM
  (`torch._grouped_mm`, bf16 on sm_90).

python3 bench/scripts/humming_moe_probe.py --out FILE.json [--tokens 1,8,64] [--experts 128]
"""
import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from qerl_lab.results import results_file
from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from qerl_pipe.kernels import cuda_ext
from qerl_pipe.kernels.humming_experts import HummingExperts
from qerl_pipe.kernels.linear import nvfp4_linear
from qerl_pipe.kernels.tiled import tile_nvfp4
from qerl_pipe.kernels.torch_grouped import StackedExperts
from qerl_pipe.kernels.tuning import time_graph

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", default="1,8,64")
ap.add_argument("--experts", type=int, default=128)
ap.add_argument("--top-k", type=int, default=8)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--width", type=int, default=768)
ap.add_argument("--out", type=Path, required=True)
args = ap.parse_args()
dev = torch.device("cuda")
E, top_k = args.experts, args.top_k


def experts(n: int, k: int, seed: int):
    gen = torch.Generator(device=dev).manual_seed(seed)
    qs = [quantize_nvfp4(torch.randn(n, k, device=dev, generator=gen) * 0.02) for _ in range(E)]
    return qs, [tile_nvfp4(q) for q in qs]


def routed(t: int, k: int, seed: int):
    """Rows sorted by expert ([t * top_k, k] bf16), the experts' row offsets [E + 1] and bounds."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.randn(t, E, device=dev, generator=gen).topk(top_k, dim=-1).indices.reshape(-1)
    order = ids.argsort(stable=True)
    x = torch.randn(t, k, device=dev, generator=gen).to(torch.bfloat16)
    counts = torch.bincount(ids, minlength=E)
    return x[order // top_k], F.pad(counts.cumsum(0), (1, 0)), counts.cumsum(0).tolist()


def loop(rows, bounds, tiled):
    """Our path today: the host knows each expert's rows, one GEMM per expert that got some."""
    outs, start = [], 0
    for w, end in zip(tiled, bounds):
        if end > start:
            outs.append(cuda_ext.gemm(rows[start:end], w))
        start = end
    return torch.cat(outs)


def loop_with_sync(rows, layout, tiled):
    return loop(rows, layout[1:].tolist(), tiled)  # the host sync the engine pays per layer


_STACKED: dict = {}


def _dense_all(row: dict, name: str, n: int, k: int, t: int, seed: int) -> None:
    """Time every token through all experts as one NVFP4 GEMM (random stacked weight of the shape)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    shape = (E * n, k) if name == "gate_up" else (n, E * k)
    if _STACKED.get("shape") != shape:  # one stacked weight per linear, kept across the row counts
        _STACKED.clear()
        _STACKED.update(shape=shape, w=tile_nvfp4(quantize_nvfp4(torch.randn(*shape, device=dev, generator=gen) * 0.02)))
    w = _STACKED["w"]
    x = torch.randn(t, shape[1], device=dev, generator=gen).to(torch.bfloat16)
    row["dense_all_shape"] = list(shape)
    row["dense_all_us"] = time_graph([lambda: nvfp4_linear(x, w)], 20) * 1e6


def _bf16(row: dict, rows, bounds, dense) -> None:
    """The bf16 baseline's loop and torch's grouped GEMM on the same routed rows."""
    w = torch.stack([d.to(torch.bfloat16) for d in dense])  # [E, N, K]

    def bf16_loop():
        return torch.cat([rows[s:e] @ w[i].T for i, (s, e) in enumerate(zip([0, *bounds[:-1]], bounds)) if e > s])

    row["bf16_loop_us"] = time_graph([bf16_loop], 20) * 1e6
    offs = torch.tensor(bounds, dtype=torch.int32, device=dev)
    wt = w.transpose(1, 2)  # [E, K, N], as torch._grouped_mm takes its second operand
    try:
        out = torch._grouped_mm(rows, wt, offs=offs)
        row["bf16_grouped_rel_err"] = float((out.float() - bf16_loop().float()).norm() / bf16_loop().float().norm())
        row["bf16_grouped_us"] = time_graph([lambda: torch._grouped_mm(rows, wt, offs=offs)], 20) * 1e6
    except Exception as exc:  # noqa: BLE001
        row["bf16_grouped_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    del w


def _stacked(row: dict, rows, layout, stacked, ref) -> None:
    """The NVFP4 stack dequantized in one launch and torch's grouped GEMM (the training path, and
    the rollouts' where humming's copies are not made)."""
    with torch.no_grad():
        out = stacked.matmul(rows, layout)
        row["stacked_rel_err"] = float((out.float() - ref).norm() / ref.norm())
        row["stacked_repeats"] = all(torch.equal(out, stacked.matmul(rows, layout)) for _ in range(5))
        row["stacked_us"] = time_graph([lambda: stacked.matmul(rows, layout)], 20) * 1e6


def _grouped_w4a16(row: dict, rows, layout, stacked, ref, tokens: int) -> None:
    """Our grouped W4A16 GEMM on the 4-bit stack, its grid over the experts that got rows."""
    with_rows = torch.nonzero(layout.diff()).flatten()
    active = torch.cat([with_rows, with_rows.new_full((E - len(with_rows),), -1)]).to(torch.int32)
    if tokens > cuda_ext.MAX_PASS_TOKENS:
        return

    def grouped():
        return cuda_ext.grouped_gemm(rows, stacked.qweight, stacked.scales, stacked.global_scale, layout,
                                     stacked.out_features, stacked.in_features, tokens, active)

    first = grouped()
    row["grouped_w4a16_rel_err"] = float((first.float() - ref).norm() / ref.norm())
    row["grouped_w4a16_repeats"] = all(torch.equal(first, grouped()) for _ in range(5))
    row["grouped_w4a16_us"] = time_graph([grouped], 20) * 1e6


rows_out = []
for name, n, k, seed in (("gate_up", 2 * args.width, args.hidden, 1), ("down", args.hidden, args.width, 2)):
    qs, tiled = experts(n, k, seed)
    t0 = time.perf_counter()
    try:
        layer = HummingExperts(qs)  # the engine's grouped experts (kernels.humming_experts)
        build = {"humming_build_s": time.perf_counter() - t0}
    except Exception as exc:  # noqa: BLE001 (a probe: report what failed and go on)
        layer, build = None, {"humming_error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    dense = [dequantize_nvfp4(q, torch.float32) for q in qs]
    stacked = StackedExperts(n, k, qweight=torch.stack([w.qweight for w in tiled]),
                             scales=torch.stack([w.scales for w in tiled]),
                             global_scale=torch.stack([w.global_scale for w in tiled]))
    for t in (int(v) for v in args.tokens.split(",")):
        rows, layout, bounds = routed(t, k, seed + t)
        ref = torch.cat([rows[s:e].float() @ dense[i].T for i, (s, e) in enumerate(zip([0, *bounds[:-1]], bounds)) if e > s])
        ours = loop(rows, bounds, tiled)
        row = {"linear": name, "N": n, "K": k, "tokens": t, "rows": t * top_k,
               "active_experts": sum(1 for s, e in zip([0, *bounds[:-1]], bounds) if e > s), **build,
               "loop_rel_err": float((ours.float() - ref).norm() / ref.norm()),
               "loop_us": time_graph([lambda: loop(rows, bounds, tiled)], 20) * 1e6,
               "loop_with_sync_us": None}
        start = time.perf_counter()
        for _ in range(10):
            loop_with_sync(rows, layout, tiled)
        torch.cuda.synchronize()
        row["loop_with_sync_us"] = (time.perf_counter() - start) / 10 * 1e6  # eager, as the engine runs MoE
        if layer is not None:
            for schedule, invariant in (("invariant", True), ("stream-k", False)):
                try:
                    def grouped(invariant=invariant):
                        return layer.matmul(rows, layout, deterministic=invariant)
                    first = grouped()
                    row[f"humming_{schedule}_rel_err"] = float((first.float() - ref).norm() / ref.norm())
                    row[f"humming_{schedule}_repeats"] = all(torch.equal(first, grouped()) for _ in range(5))
                    row[f"humming_{schedule}_us"] = time_graph([grouped], 20) * 1e6
                except Exception as exc:  # noqa: BLE001
                    row[f"humming_{schedule}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        _dense_all(row, name, n, k, t, seed)
        _bf16(row, rows, bounds, dense)
        _stacked(row, rows, layout, stacked, ref)
        _grouped_w4a16(row, rows, layout, stacked, ref, t)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    del qs, tiled, dense, layer, stacked
    torch.cuda.empty_cache()
args.out.write_text(json.dumps(results_file(rows_out, [], settings=vars(args) | {"out": None}), indent=1) + "\n")
