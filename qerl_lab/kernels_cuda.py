"""CUDA W4A16 kernel benchmark: the decode GEMM and dequantize + cuBLAS vs cuBLAS bf16.

`qerl-pipe bench kernels-cuda --out FILE.json` (a Hopper GPU with nvcc). For every Qwen2.5-7B/32B layer (q/k/v and gate/up fused, as the model runs them) and M:
- the decode GEMM (`cuda_ext.gemm`): the default config and its neighbours (other compiled
  variants with the same tokens per pass, half and double the K splits), each checked against
  `x @ dequantized W` in fp32 before it is timed; the fastest is reported with its config;
- dequantize + cuBLAS: our decode pass into bf16, then `torch.matmul` (the M >= 1024 and dX path);
- cuBLAS bf16 on a bf16 copy of the same weight, forward and dX;
- the fastest GEMM config again with a LoRA expand (r32 per projection) in its epilogue, next to
  bf16 with the expand as the engine adds it (matmul, then an in-place addmm).
Protocol, the same for every column: R distinct weight copies (codes and scales, or bf16) with
R x bytes > 4 x the 60 MB L2, one CUDA graph of R calls, median of 50 replays, divided by R. The
copy ceiling (device-to-device copy of 2 GiB, read + write bytes) is measured in the same run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from qerl_lab.kernels import LAYER_SHAPES
from qerl_lab.results import nulls_for_non_finite, results_file, target
from qerl_pipe.formats.nvfp4 import dequantize_nvfp4, quantize_nvfp4_in_row_chunks
from qerl_pipe.kernels import cuda_ext
from qerl_pipe.kernels.tiled import TiledNVFP4, tile_nvfp4
from qerl_pipe.kernels.tuning import rel_err, time_graph, weight_copies
from qerl_pipe.strict_json import write_json

REPS = 50
GEMM_MS = (1, 8, 16, 32, 64, 128, 256)
DEQUANT_MS = (64, 256, 1024, 4096)
ALL_MS = tuple(sorted(set(GEMM_MS) | set(DEQUANT_MS)))  # every M the benchmark measures


def copy_ceiling_tbps() -> float:
    """Device-to-device copy rate of 2 GiB (bytes read + written)."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = time_graph([lambda: dst.copy_(src)], REPS)
    del src, dst
    return 2 * 2 * 2**30 / t / 1e12


def candidates(m: int, n: int, k: int, sms: int) -> list[cuda_ext.GemmConfig]:
    """The default config, the other compiled variants with its tokens per pass (each with its
    own `choose_splits`), the wgmma variants from M = 33 on (at 1, 2 and 4 splits and their own
    `choose_splits`), and the default's K splits halved, doubled and off."""
    base = cuda_ext.default_config(m, n, k, sms)
    out = [base]
    for c in cuda_ext.compiled_configs():
        if c.mt == 1:  # wgmma: 64 or 128 tokens per pass, from M = 33 on
            if m > 32 and 8 * c.nb <= max(64, m):
                s = cuda_ext.choose_splits(m, n, k, c, sms, cuda_ext.blocks_per_sm(c))
                out += [replace(c, splits=v) for v in sorted({1, 2, 4, s})]
        elif c.nb == base.nb and replace(c, splits=base.splits) != base:
            s = cuda_ext.choose_splits(m, n, k, c, sms, cuda_ext.blocks_per_sm(c))
            out.append(replace(c, splits=s))
    for s in (1, base.splits // 2, base.splits * 2):
        if s >= 1:
            out.append(replace(base, splits=s))
    return list(dict.fromkeys(out))


def _copies(q: TiledNVFP4, r: int) -> list[TiledNVFP4]:
    return [q] + [TiledNVFP4(q.qweight.clone(), q.scales.clone(), q.global_scale.clone(), q.out_features,
                             q.in_features) for _ in range(r - 1)]


def layer_operands(model: str, layer: str, n: int, k: int, gen: torch.Generator) -> tuple:
    """A random `[n, k]` layer as the benchmarks time it: (its NVFP4 weight dequantized to fp32, the
    tiled NVFP4 copies, the bf16 copies), as many copies of each as keep the L2 cold."""
    w = torch.randn(n, k, device=gen.device, generator=gen) * 0.02
    wb = w.to(torch.bfloat16)
    q = quantize_nvfp4_in_row_chunks(w, name=f"{model} {layer}")
    del w
    dense = dequantize_nvfp4(q, torch.float32)
    tq = tile_nvfp4(q)
    r_q = weight_copies(tq.qweight.numel() * 4 + tq.scales.numel())
    r_b = weight_copies(wb.numel() * 2)
    return dense, _copies(tq, r_q), [wb] + [wb.clone() for _ in range(r_b - 1)]


def bench_layer(model: str, layer: str, n: int, k: int, sms: int, ms: tuple[int, ...]) -> list[dict]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n * 31 + k)
    dense, tqs, wbs = layer_operands(model, layer, n, k, gen)
    tq, r_q, r_b = tqs[0], len(tqs), len(wbs)
    rows = []
    for m in sorted(set(ALL_MS) & set(ms)):
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        ref = x.float() @ dense.T
        row: dict = {"model": model, "layer": layer, "N": n, "K": k, "M": m}
        row["bf16_us"] = time_graph([lambda i=i: torch.matmul(x, wbs[i].T) for i in range(r_b)], REPS) * 1e6
        row["dequant_matmul_rel_err"] = rel_err(x @ cuda_ext.dequantize(tq).T, ref)
        row["dequant_matmul_us"] = time_graph(
            [lambda i=i: torch.matmul(x, cuda_ext.dequantize(tqs[i]).T) for i in range(r_q)], REPS) * 1e6
        if m in GEMM_MS:
            row.update(_tune_gemm(x, tqs, ref, m, n, k, sms))
            if "gemm_config" in row:
                row.update(_lora_epilogue(layer, x, tqs, wbs, cuda_ext.GemmConfig(**row["gemm_config"]), gen))
        if m in DEQUANT_MS:
            dy = torch.randn(m, n, device=dev, generator=gen).to(torch.bfloat16)
            row["dx_rel_err"] = rel_err(dy @ cuda_ext.dequantize(tq), dy.float() @ dense)
            row["dx_bf16_us"] = time_graph([lambda i=i: torch.matmul(dy, wbs[i]) for i in range(r_b)], REPS) * 1e6
            row["dx_nvfp4_us"] = time_graph(
                [lambda i=i: torch.matmul(dy, cuda_ext.dequantize(tqs[i])) for i in range(r_q)], REPS) * 1e6
        _derive(row)
        rows.append(row)
        print(_fmt(row), flush=True)
    decode_us = time_graph([lambda i=i: cuda_ext.dequantize(tqs[i]) for i in range(r_q)], REPS) * 1e6
    for row in rows:
        row["decode_pass_us"] = decode_us
        row["decode_pass_tbps"] = n * k * (0.5 + 1 / 16 + 2) / decode_us / 1e6
    return rows


def _tune_gemm(x, tqs, ref, m: int, n: int, k: int, sms: int) -> dict:
    log, best = [], None
    for cfg in candidates(m, n, k, sms):
        try:
            err = rel_err(cuda_ext.gemm(x, tqs[0], config=cfg), ref)
            if err >= 1e-2:
                log.append({"config": asdict(cfg), "rel_err": err, "error": "wrong result"})
                continue
            t = time_graph([lambda i=i: cuda_ext.gemm(x, tqs[i], config=cfg) for i in range(len(tqs))], REPS)
        except RuntimeError as exc:
            log.append({"config": asdict(cfg), "error": str(exc)[:300]})
            continue
        log.append({"config": asdict(cfg), "rel_err": err, "us": t * 1e6})
        if best is None or t < best[1]:
            best = (cfg, t, err)
    out: dict = {"gemm_tuning": log, "gemm_default_us": log[0].get("us")}
    if best:
        out.update(gemm_us=best[1] * 1e6, gemm_config=asdict(best[0]), gemm_rel_err=best[2])
        # The same config without programmatic dependent launch: what the overlap of consecutive
        # launches in the graph is worth.
        no_pdl = replace(best[0], pdl=False)
        out["gemm_no_pdl_us"] = time_graph(
            [lambda i=i: cuda_ext.gemm(x, tqs[i], config=no_pdl) for i in range(len(tqs))], REPS) * 1e6
    return out


# LoRA rank per projection for the epilogue columns (the rollout benchmark's r32), and how many
# projections each fused layer holds (the stacked rank the epilogue multiplies).
LORA_RANK = 32
_PROJECTIONS = {"qkv": 3, "gate_up": 2}


def _lora_epilogue(layer: str, x, tqs, wbs, cfg: cuda_ext.GemmConfig, gen: torch.Generator) -> dict:
    """The best config again with the LoRA expand (+ u B^T, R = r32 x projections) in its epilogue,
    next to bf16 with the expand as the engine runs it there (the matmul, then an in-place addmm):
    what the epilogue costs at each M, under the same protocol."""
    m, n = x.shape[0], tqs[0].out_features
    rank = LORA_RANK * _PROJECTIONS.get(layer, 1)
    u = (torch.randn(m, rank, device=x.device, generator=gen) * 0.1).to(torch.bfloat16)
    b = (torch.randn(n, rank, device=x.device, generator=gen) * 0.1).to(torch.bfloat16)
    lora = (u, b)
    fp4 = time_graph([lambda i=i: cuda_ext.gemm(x, tqs[i], config=cfg, lora=lora) for i in range(len(tqs))], REPS)
    bf16 = time_graph([lambda i=i: torch.matmul(x, wbs[i].T).addmm_(u, b.T) for i in range(len(wbs))], REPS)
    return {"lora_rank": rank, "gemm_lora_us": fp4 * 1e6, "bf16_lora_us": bf16 * 1e6}


def _derive(row: dict) -> None:
    m, n, k = row["M"], row["N"], row["K"]
    act = 2 * (m * k + m * n)
    nvfp4_bytes = n * k * (0.5 + 1 / 16) + act
    if "gemm_us" in row:
        row["gemm_tbps"] = nvfp4_bytes / row["gemm_us"] / 1e6
        row["speedup_gemm"] = row["bf16_us"] / row["gemm_us"]
        if row.get("gemm_default_us"):
            row["speedup_gemm_default"] = row["bf16_us"] / row["gemm_default_us"]
    if "gemm_lora_us" in row:
        row["speedup_gemm_lora"] = row["bf16_lora_us"] / row["gemm_lora_us"]
    row["bf16_tbps"] = (2 * n * k + act) / row["bf16_us"] / 1e6
    row["speedup_dequant_matmul"] = row["bf16_us"] / row["dequant_matmul_us"]
    row["speedup_best"] = max(row["speedup_dequant_matmul"], row.get("speedup_gemm", 0.0))
    if "dx_nvfp4_us" in row:
        row["speedup_dx"] = row["dx_bf16_us"] / row["dx_nvfp4_us"]


def _fmt(r: dict) -> str:
    g = (f"gemm {r['gemm_us']:7.1f}us {r['speedup_gemm']:.2f}x {r['gemm_tbps']:.2f}TB/s "
         f"(no PDL {r['gemm_no_pdl_us']:7.1f}us) {tuple(r['gemm_config'].values())} | " if "gemm_us" in r else "")
    d = f" dX {r['speedup_dx']:.2f}x" if "speedup_dx" in r else ""
    if "speedup_gemm_lora" in r:
        d += f" | +lora gemm {r['gemm_lora_us']:7.1f}us bf16 {r['bf16_lora_us']:7.1f}us {r['speedup_gemm_lora']:.2f}x"
    return (f"{r['model']:>11} {r['layer']:>7} M={r['M']:<5} bf16 {r['bf16_us']:8.1f}us | {g}"
            f"deq+mm {r['dequant_matmul_us']:8.1f}us {r['speedup_dequant_matmul']:.2f}x{d}")


def _weighted(rows: list[dict], model: str, pred: Callable[[dict], bool], key: str = "speedup_best") -> float:
    """Speed-up over the layers of `model`, weighted by bytes: sum of bf16 times / sum of ours."""
    sel = [r for r in rows if r["model"] == model and pred(r) and key in r]
    if not sel:
        return float("nan")
    return sum(r["bf16_us"] for r in sel) / sum(r["bf16_us"] / r[key] for r in sel)


def _targets(rows: list[dict], ceiling: float) -> list[dict]:
    def worst(pred: Callable[[dict], bool], key: str = "speedup_best") -> float:
        vals = [r[key] for r in rows if pred(r) and key in r]
        return min(vals) if vals else float("nan")

    out: list[dict] = []
    for lo, hi, goal in ((1, 16, 2.0), (64, 64, 1.3), (256, 256, 1.0)):
        v = worst(lambda r: lo <= r["M"] <= hi)
        out.append(target(f"NVFP4 vs bf16, every layer, M {lo}-{hi}", f">= {goal}", v, "x (min)", v >= goal))
    for model, goal in (("qwen2.5-7b", 2.8), ("qwen2.5-32b", 3.1)):
        v = min(_weighted(rows, model, lambda r, m=m: r["M"] == m) for m in (1, 8, 16))
        out.append(target(f"NVFP4 vs bf16, {model} layer-weighted, M 1-16", f">= {goal}", v, "x (min over M)", v >= goal))
    for model in ("qwen2.5-7b", "qwen2.5-32b"):
        v = _weighted(rows, model, lambda r: r["M"] == 64)
        out.append(target(f"NVFP4 vs bf16, {model} layer-weighted, M 64", ">= 1.8", v, "x", v >= 1.8))
    v = worst(lambda r: r["M"] <= 16 and r["layer"] in ("gate_up", "down"), "gemm_tbps") / ceiling
    out.append(target("decode GEMM bandwidth, gate_up and down, M 1-16", ">= 0.8", v, "of the copy ceiling (min)", v >= 0.8))
    for m, goal in ((1024, 0.85), (4096, 0.92)):
        v = worst(lambda r, m=m: r["M"] == m, "speedup_dequant_matmul")
        out.append(target(f"NVFP4 vs bf16 forward, M {m}", f">= {goal}", v, "x (min)", v >= goal))
        v = worst(lambda r, m=m: r["M"] == m, "speedup_dx")
        out.append(target(f"NVFP4 vs bf16 dX, M {m}", f">= {goal}", v, "x (min)", v >= goal))
    # A run of some M only (--ms) leaves the other targets unmeasured: they are left out, not missed.
    return [t for t in out if t["measured"] == t["measured"]]


def tuned_table(rows: list[dict]) -> dict:
    """The fastest config per (M, N, K), keyed by `cuda_ext.table_key`, in the form of
    kernels/cuda/configs-h200.json: rows of a measured M (`cuda_ext.TABLE_MS`), above
    MAX_PASS_TOKENS only where the GEMM beat dequantize + cuBLAS."""
    return {cuda_ext.table_key(r["M"], r["N"], r["K"]): r["gemm_config"]
            for r in rows if "gemm_config" in r and r["M"] in cuda_ext.TABLE_MS
            and (r["M"] <= cuda_ext.MAX_PASS_TOKENS or r["gemm_us"] < r["dequant_matmul_us"])}


def run(shapes: list[str], out: Path | None, ms: tuple[int, ...] = ALL_MS) -> dict:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ceiling = copy_ceiling_tbps()
    print(f"copy ceiling {ceiling:.2f} TB/s, {sms} SMs", flush=True)
    rows: list[dict] = []
    result: dict = {}
    for model in shapes:
        for layer, (n, k) in LAYER_SHAPES[model].items():
            rows += bench_layer(model, layer, n, k, sms, ms)
            result = results_file(rows, _targets(rows, ceiling), torch=torch.__version__,
                                  copy_ceiling_tbps=ceiling, sms=sms, tuned_table=tuned_table(rows))
            if out:
                out.parent.mkdir(parents=True, exist_ok=True)
                write_json(out, nulls_for_non_finite(result), indent=1)
            torch.cuda.empty_cache()
    for t in result["targets"]:
        print(f"target {t['name']:58} {t['target']:<7} measured {t['measured']:.2f} {'MET' if t['met'] else 'MISSED'}")
    return result
