"""Tune the decode GEMM's configs in the launch context of the decode step, not back to back.

`bench kernels-cuda` times R calls of one GEMM in a row: each launch's ramp and tail overlap its
neighbours' (programmatic dependent launch), so that protocol rewards configs that the decode
step, where a GEMM sits between a norm (or attention) kernel and the next norm, may not. Here each
candidate config is timed as the step runs it: the norm kernel (residual add + RMSNorm with the
next projection's LoRA shrink, launched with PDL) then the GEMM on its output, R distinct weight
copies so L2 stays cold, one CUDA graph, median of the replays. The pair's time per call is
reported for every candidate next to the norm alone.

`python3 bench/scripts/step_tune.py --out results.json --table configs-step.json [--ms 1,8]`
writes the measurements and a copy of the shipped table whose rows for these shapes hold the
fastest config in this context; `QERL_W4A16_TABLE=configs-step.json` makes the engine use it.
"""
import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from qerl_lab.kernels import LAYER_SHAPES
from qerl_lab.kernels_cuda import candidates, layer_operands
from qerl_pipe.kernels import cuda_ext, decode_ops
from qerl_pipe.kernels.tuning import rel_err, time_graph

LORA_ROWS = 96  # the stacked r32 shrink of q/k/v: the norm kernel's work in the step

ap = argparse.ArgumentParser()
ap.add_argument("--ms", default="1,8")
ap.add_argument("--shape", default="qwen2.5-7b")
ap.add_argument("--out", type=Path, required=True)
ap.add_argument("--table", type=Path, required=True)
args = ap.parse_args()
ms = [int(v) for v in args.ms.split(",")]
if any(cuda_ext.table_key(m, 1, 1) != f"m{m}:n1:k1" for m in ms):
    ap.error(f"--ms must be rows of the table (1, 8, 16, 32, 64, ...); got {args.ms}")

dev = torch.device("cuda")
sms = cuda_ext.sm_count(dev)
gen = torch.Generator(device="cuda").manual_seed(0)
table = json.loads(cuda_ext.table_path().read_text())  # the table default_config reads
rows = []
for layer, (n, k) in LAYER_SHAPES[args.shape].items():
    dense, tqs, wbs = layer_operands(args.shape, layer, n, k, gen)
    del wbs
    tq, r = tqs[0], len(tqs)
    norm_w = torch.rand(k, device=dev, generator=gen).to(torch.bfloat16)
    noise = torch.zeros(k, device=dev)
    shrink = (torch.randn(LORA_ROWS, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    for m in ms:
        x0 = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        normed = decode_ops.add_rms_norm(x0, None, norm_w, noise, 1e-6, shrink)[0]
        ref = normed.float() @ dense.T
        norm_us = time_graph([lambda: decode_ops.add_rms_norm(x0, None, norm_w, noise, 1e-6, shrink)] * r) * 1e6
        default = cuda_ext.default_config(m, n, k, sms)
        results = []
        for cfg in candidates(m, n, k, sms) + [replace(default, splits=s) for s in (2, 3, 4, 6, 8)]:
            if cfg.mt == 1 or cfg.splits * 32 > k or any(cfg == c["config_obj"] for c in results):
                continue
            try:
                err = rel_err(cuda_ext.gemm(normed, tq, config=cfg), ref)
                us = time_graph([lambda i=i, c=cfg: cuda_ext.gemm(
                    decode_ops.add_rms_norm(x0, None, norm_w, noise, 1e-6, shrink)[0], tqs[i], config=c)
                    for i in range(r)]) * 1e6
            except (RuntimeError, ValueError) as exc:
                results.append({"config_obj": cfg, "config": asdict(cfg), "error": str(exc)[:200]})
                continue
            results.append({"config_obj": cfg, "config": asdict(cfg), "pair_us": us, "rel_err": err})
        ok = [x for x in results if "pair_us" in x and x["rel_err"] < 1e-2]
        if not ok:
            raise SystemExit(f"{layer} m{m}: no candidate config ran correctly: {results}")
        best = min(ok, key=lambda x: x["pair_us"])
        base = next(x for x in results if x["config_obj"] == default)
        key = cuda_ext.table_key(m, n, k)
        table["configs"][key] = best["config"]
        print(f"{layer} m{m}: norm {norm_us:.2f} us; table {default} {base.get('pair_us', float('nan')):.2f} us; "
              f"best {best['config_obj']} {best['pair_us']:.2f} us", flush=True)
        rows.append({"layer": layer, "M": m, "N": n, "K": k, "norm_us": norm_us, "table_config": asdict(default),
                     "table_pair_us": base.get("pair_us"), "best_config": best["config"], "best_pair_us": best["pair_us"],
                     "candidates": [{k2: v for k2, v in x.items() if k2 != "config_obj"} for x in results]})
table["source"] = f"bench/scripts/step_tune.py on {args.shape}, M in {args.ms}; other rows from {cuda_ext.table_path().name}"
args.table.write_text(json.dumps(table, indent=1))
args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "shape": args.shape, "rows": rows}, indent=1))
