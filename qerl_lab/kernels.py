"""Kernel benchmark: NVFP4/NF4 Triton linears vs cuBLAS bf16 and dequantize-then-matmul.

Runs on a CUDA GPU: `qerl-pipe bench kernels --out FILE.json`. For every (model, layer, M) it
1. checks each candidate kernel config against x @ dequantized W in fp32 (rel err < 1e-2, else
   the config is dropped and the failure recorded), then times the survivors and keeps the best
   (the kept configs form the tuned table in the output);
2. times cuBLAS bf16, QeRL's training path (dequantize NVFP4 to bf16 in torch, then matmul), and
   dX = dY @ W both ways.
Timing: CUDA-graph replays of R calls over R distinct weight copies (R chosen so the copies
exceed 4x the 60 MB L2), median over replays, divided by R: no launch gaps, no warm L2.
The candidates, the check and the timing live in `kernels.tuning` (the engine stage uses them too).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from qerl_pipe.formats.nf4 import dequantize_nf4, quantize_nf4
from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from qerl_lab.results import nulls_for_non_finite, results_file, target
from qerl_pipe.kernels.base_formats import base_format
from qerl_pipe.kernels.configs import KernelConfig, get_config, table_key, table_to_json
from qerl_pipe.kernels.packing import prepare_nf4, prepare_nvfp4
from qerl_pipe.kernels.tuning import dx_candidates, fwd_candidates, rel_err, time_graph, tune_one, weight_copies
from qerl_pipe.strict_json import write_json

# (N, K) of each linear: qkv and gate_up are fused, as our model runs them.
LAYER_SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "qwen2.5-7b": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584),
                   "down": (3584, 18944)},
    "qwen2.5-32b": {"qkv": (7168, 5120), "o": (5120, 5120), "gate_up": (55296, 5120),
                    "down": (5120, 27648)},
}
def _time_eager(calls: list[Callable[[], object]], reps: int = 5) -> float:
    """Seconds per call, without graphs (for torch code that copies host data while running)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for c in calls:
            c()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / len(calls))
    return statistics.median(times)


def bench_layer(model: str, layer: str, n: int, k: int, ms: tuple[int, ...],
                tuned: dict[str, KernelConfig]) -> list[dict]:
    from qerl_pipe.kernels.triton_matmul import launch_dx, launch_forward

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n * 31 + k)
    w = torch.randn(n, k, device=dev, generator=gen) * 0.02
    wb = w.to(torch.bfloat16)
    q4, nf = quantize_nvfp4(w), quantize_nf4(w)
    del w
    dense = dequantize_nvfp4(q4, torch.float32)
    dense_nf = dequantize_nf4(nf, torch.float32)
    r_b = weight_copies(wb.numel() * 2)
    r_q = weight_copies(q4.packed.numel() + q4.block_scales.numel())
    wbs = [wb] + [wb.clone() for _ in range(r_b - 1)]
    p4 = prepare_nvfp4(q4)
    p4s = [p4] + [prepare_nvfp4(q4) for _ in range(r_q - 1)]
    pnf = prepare_nf4(nf)
    pnfs = [pnf] + [prepare_nf4(nf) for _ in range(r_q - 1)]
    # Dequantize-then-matmul is slow enough to time eagerly; a few copies keep W out of L2.
    q4s = [q4] + [type(q4)(q4.packed.clone(), q4.block_scales.clone(), q4.global_scale.clone())
                  for _ in range(min(r_b, 4) - 1)]
    decode_us = _time_decode_pass(p4s, n, k)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        dy = torch.randn(m, n, device=dev, generator=gen).to(torch.bfloat16)
        ref = x.float() @ dense.T
        ref_nf = x.float() @ dense_nf.T
        ref_dx = dy.float() @ dense
        row: dict = {"model": model, "layer": layer, "N": n, "K": k, "M": m,
                     "decode_pass_us": decode_us,
                     "decode_pass_tbps": (n * k * (0.5 + 1 / 16 + 2)) / decode_us / 1e6}
        row["bf16_us"] = time_graph([lambda i=i: torch.matmul(x, wbs[i].T) for i in range(r_b)]) * 1e6
        row["dequant_matmul_us"] = _time_eager(
            [lambda i=i: torch.matmul(x, dequantize_nvfp4(q4s[i], torch.bfloat16).T)
             for i in range(len(q4s))]) * 1e6

        cfg, t, err, log = tune_one(lambda c, i: launch_forward(x, p4s[i], c), ref,
                                    fwd_candidates(m), r_q)
        row.update(nvfp4_us=t * 1e6, nvfp4_config=asdict(cfg) if cfg else None,
                   nvfp4_rel_err=err, nvfp4_tuning=log)
        if cfg:
            tuned[table_key("fwd", "nvfp4", m, n, k)] = cfg
        # NF4 decodes through a table lookup: try the NVFP4 winner and the bucket's first pick.
        nf_cands = list(dict.fromkeys([c for c in (cfg, fwd_candidates(m)[0]) if c]))
        cfg_nf, t_nf, err_nf, _ = tune_one(lambda c, i: launch_forward(x, pnfs[i], c), ref_nf,
                                           nf_cands, r_q)
        row.update(nf4_us=t_nf * 1e6, nf4_config=asdict(cfg_nf) if cfg_nf else None,
                   nf4_rel_err=err_nf)
        if cfg_nf:
            tuned[table_key("fwd", "nf4", m, n, k)] = cfg_nf

        row["dx_bf16_us"] = time_graph([lambda i=i: torch.matmul(dy, wbs[i]) for i in range(r_b)]) * 1e6
        cfg_dx, t_dx, err_dx, log_dx = tune_one(lambda c, i: launch_dx(dy, p4s[i], c), ref_dx,
                                                dx_candidates(m), r_q)
        row.update(dx_nvfp4_us=t_dx * 1e6, dx_config=asdict(cfg_dx) if cfg_dx else None,
                   dx_rel_err=err_dx, dx_tuning=log_dx)
        if cfg_dx:
            tuned[table_key("dx", "nvfp4", m, n, k)] = cfg_dx
        if m >= 1024:
            row["dx_dequant_matmul_us"] = _time_eager(
                [lambda i=i: torch.matmul(dy, dequantize_nvfp4(q4s[i], torch.bfloat16))
                 for i in range(len(q4s))]) * 1e6
        _derive(row)
        rows.append(row)
        print(_fmt_row(row), flush=True)
        del x, dy, ref, ref_nf, ref_dx
    return rows


def _time_decode_pass(packed: list, n: int, k: int) -> float:
    """Microseconds of the `dequant` path's decode pass alone (default tile), W not in L2."""
    from qerl_pipe.kernels.dequant_gemm import dequantize_into, scratch
    from qerl_pipe.kernels.triton_matmul import _operands

    buf = scratch(n, k, torch.device("cuda"), torch.bfloat16)
    cfg = get_config("fwd", "nvfp4", 4096, n, k)
    return time_graph([lambda p=p: dequantize_into(*_operands(p), buf, cfg)
                        for p in packed]) * 1e6


def _derive(row: dict) -> None:
    m, n, k = row["M"], row["N"], row["K"]
    act = 2 * (m * k + m * n)
    flops = 2 * m * n * k
    for col, key in (("bf16", "bf16_us"), ("nvfp4", "nvfp4_us"), ("nf4", "nf4_us")):
        t = row[key] * 1e-6
        nbytes = int(n * k * base_format(col).weight_bytes(2)) + act  # the weight as stored, and x and y
        row[f"{col}_tbps"] = nbytes / t / 1e12
        row[f"{col}_tflops"] = flops / t / 1e12
    row["speedup_nvfp4"] = row["bf16_us"] / row["nvfp4_us"]
    row["speedup_nf4"] = row["bf16_us"] / row["nf4_us"]
    row["speedup_dx"] = row["dx_bf16_us"] / row["dx_nvfp4_us"]
    row["vs_dequant_matmul"] = row["dequant_matmul_us"] / row["nvfp4_us"]
    if "dx_dequant_matmul_us" in row:
        row["dx_vs_dequant_matmul"] = row["dx_dequant_matmul_us"] / row["dx_nvfp4_us"]


def _fmt_row(r: dict) -> str:
    dq = r.get("dx_vs_dequant_matmul")
    return (f"{r['model']:>11} {r['layer']:>7} M={r['M']:<5} bf16 {r['bf16_us']:9.1f}us "
            f"nvfp4 {r['nvfp4_us']:9.1f}us ({r['speedup_nvfp4']:.2f}x, {r['nvfp4_tbps']:.2f}TB/s) "
            f"nf4 {r['speedup_nf4']:.2f}x deq+mm {r['dequant_matmul_us']:9.1f}us "
            f"dX {r['speedup_dx']:.2f}x" + (f" dXvsDeq {dq:.2f}x" if dq else "") +
            f" err {r['nvfp4_rel_err']:.1e}/{r['nf4_rel_err']:.1e}/{r['dx_rel_err']:.1e}")


def check_correctness(n: int = 4608, k: int = 3584, ms: tuple[int, ...] = (1, 16, 64, 256, 1024)) -> list[dict]:
    """Each public op (default configs) vs the fp32 reference on one real layer shape."""
    from qerl_pipe.kernels import nf4_linear, nf4_linear_dx, nvfp4_linear, nvfp4_linear_dx

    dev = torch.device("cuda")
    w = torch.randn(n, k, device=dev) * 0.02
    q4, nf = quantize_nvfp4(w), quantize_nf4(w)
    d4, dnf = dequantize_nvfp4(q4, torch.float32), dequantize_nf4(nf, torch.float32)
    out = []
    for m in ms:
        x = torch.randn(3, m, k, device=dev).to(torch.bfloat16)[1]  # a view: offset storage
        dy = torch.randn(m, n, device=dev).to(torch.bfloat16)
        for name, got, ref in (
            ("nvfp4_linear", nvfp4_linear(x, q4), x.float() @ d4.T),
            ("nf4_linear", nf4_linear(x, nf), x.float() @ dnf.T),
            ("nvfp4_linear_dx", nvfp4_linear_dx(dy, q4), dy.float() @ d4),
            ("nf4_linear_dx", nf4_linear_dx(dy, nf), dy.float() @ dnf),
        ):
            err = rel_err(got, ref)
            out.append({"op": name, "N": n, "K": k, "M": m, "rel_err": err, "ok": err < 1e-2})
            print(f"check {name:16} M={m:<5} N={n} K={k} rel err {err:.2e}", flush=True)
    return out


def _targets(rows: list[dict]) -> list[dict]:
    def worst(key: str, pred: Callable[[dict], bool]) -> float:
        vals = [r[key] for r in rows if pred(r) and key in r]
        return min(vals) if vals else float("nan")

    spec = [
        ("nvfp4 speedup vs bf16, M<=16", 3.0, "speedup_nvfp4", lambda r: r["M"] <= 16),
        ("nvfp4 speedup vs bf16, M=64", 1.8, "speedup_nvfp4", lambda r: r["M"] == 64),
        ("nvfp4 speedup vs bf16, M=256", 1.0, "speedup_nvfp4", lambda r: r["M"] == 256),
        ("nvfp4 speedup vs bf16, M>=1024", 0.85, "speedup_nvfp4", lambda r: r["M"] >= 1024),
        ("nvfp4 speedup vs dequantize-then-matmul, M>=1024", 2.0, "vs_dequant_matmul",
         lambda r: r["M"] >= 1024),
        ("nvfp4 dX speedup vs bf16 dX, M>=1024", 0.85, "speedup_dx", lambda r: r["M"] >= 1024),
        ("nvfp4 dX speedup vs dequantize-then-matmul dX, M>=1024", 2.0, "dx_vs_dequant_matmul",
         lambda r: r["M"] >= 1024),
    ]
    return [target(name, f">= {goal}", worst(key, pred), "x (min over layers)",
                   worst(key, pred) >= goal) for name, goal, key, pred in spec]


def run_kernel_bench(shapes: list[str] | None = None,
                     ms: tuple[int, ...] = (1, 8, 16, 64, 256, 1024, 4096),
                     out: Path | None = None) -> dict:
    """Correctness check, then every (model, layer, M) row; the result dict (also written to
    `out` after each layer, so a run cut short still leaves its rows)."""
    shapes = shapes or ["qwen2.5-7b", "qwen2.5-32b"]
    versions = {"torch": torch.__version__, "triton": __import__("triton").__version__}
    correctness = check_correctness()
    tuned: dict[str, KernelConfig] = {}
    rows: list[dict] = []
    result: dict = {}
    for model in shapes:
        for layer, (n, k) in LAYER_SHAPES[model].items():
            rows += bench_layer(model, layer, n, k, ms, tuned)
            result = results_file(rows, _targets(rows), **versions, correctness=correctness,
                                  tuned_table=table_to_json(tuned))
            if out:
                out.parent.mkdir(parents=True, exist_ok=True)
                write_json(out, nulls_for_non_finite(result), indent=1)
            torch.cuda.empty_cache()
    for t in result["targets"]:
        print(f"target {t['name']:55} {t['target']:<7} measured {t['measured']:.2f} "
              f"{'MET' if t['met'] else 'MISSED'}")
    return result
