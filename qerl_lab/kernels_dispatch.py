"""The kernel dispatch side by side: ours, humming, dequantize + cuBLAS, cuBLAS bf16, and the dispatch.

`qerl-pipe bench kernels-dispatch --out FILE.json` (a CUDA GPU our kernels run on). For every
Qwen2.5-7B/32B layer (q/k/v and gate/up fused, as the model runs them) and every table row M,
`dispatch_measure.measure_shape` times each backend under one protocol (L2-cold weight copies,
one CUDA graph, median of replays) with a cuBLAS bf16 column beside it; the winners make the
table (`--table-out` writes it as a file of the form `kernels/cuda/dispatch-<gpu>.json`). Then the
dispatch itself, `kernels.linear.nvfp4_linear` with that table installed and humming copies on
the weights, is timed the same way: within 3% of the fastest deterministic backend (the column
the dispatch uses by default) on every decode row is a target.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qerl_lab.kernels import LAYER_SHAPES
from qerl_lab.results import nulls_for_non_finite, results_file, target
from qerl_pipe.kernels import dispatch, humming_backend
from qerl_pipe.kernels.dispatch import BACKENDS, DETERMINISTIC_BACKENDS, ROWS_M, DispatchTable
from qerl_pipe.kernels.dispatch_measure import REPS, Operands, inputs, measure_shape, operands, table_from_rows
from qerl_pipe.kernels.linear import nvfp4_linear
from qerl_pipe.kernels.tuning import rel_err, time_graph
from qerl_pipe.strict_json import write_json


def _dispatch_row(ops: Operands, m: int) -> dict:
    """The dispatch as the model calls it (`nvfp4_linear`) at m rows: its time, error and pick."""
    x, ref = inputs(ops, m)
    t = time_graph([lambda w=w: nvfp4_linear(x, w) for w in ops.tiled], REPS) * 1e6
    return {"dispatch_us": t, "dispatch_rel_err": rel_err(nvfp4_linear(x, ops.tiled[0]), ref),
            "dispatch_backend": dispatch.backend(m, ops.n, ops.k, x.device, ops.tiled[0].humming is not None)}


def _weighted(rows: list[dict], model: str, m: int, key: str) -> float:
    """bf16 time over `key`'s time, summed over the model's layers at M (bytes-weighted speed-up)."""
    sel = [r for r in rows if r["model"] == model and r["M"] == m and "bf16_us" in r]
    if not sel or any(key not in r for r in sel):  # a layer without this column: no whole-model figure
        return float("nan")
    return sum(r["bf16_us"] for r in sel) / sum(r[key] for r in sel)


def _weighted_table(rows: list[dict], shapes: list[str]) -> dict:
    """Per model and M, the bytes-weighted speed-up over cuBLAS bf16 of the dispatch, of the best
    deterministic backend, of the best of all (the fast column) and of each backend alone."""
    out: dict = {}
    for r in rows:
        r["best_fast_us"] = min(r[f"{b}_us"] for b in BACKENDS if f"{b}_us" in r)
    keys = ("dispatch_us", "best_us", "best_fast_us", *(f"{b}_us" for b in BACKENDS))
    for model in shapes:
        out[model] = {m: {k.removesuffix("_us"): round(v, 3) for k in keys
                          if (v := _weighted(rows, model, m, k)) == v} for m in sorted({r["M"] for r in rows})}
    return out


def _targets(rows: list[dict]) -> list[dict]:
    out: list[dict] = []
    for m, goal in ((64, 1.15), (128, 0.95), (256, 0.78)):
        v = _weighted(rows, "qwen2.5-7b", m, "dispatch_us")
        out.append(target(f"7B layer-weighted dispatch vs cuBLAS bf16, M {m}", f">= {goal}", v, "x", v >= goal))
    over = [r["dispatch_us"] / r["best_us"] for r in rows if "dispatch_us" in r and r["M"] <= 256]
    v = max(over) if over else float("nan")
    out.append(target("dispatch time over the fastest deterministic backend, every layer, M <= 256", "<= 1.03", v,
                      "x (max)", v <= 1.03))
    return [t for t in out if t["measured"] == t["measured"]]


def _summary(r: dict) -> str:
    cells = " ".join(f"{b} {r[f'{b}_us']:8.1f}" for b in (*BACKENDS, "bf16") if f"{b}_us" in r)
    return (f"{r['model']:>11} {r['layer']:>7} M={r['M']:<5} {cells} | dispatch {r.get('dispatch_us', float('nan')):8.1f} "
            f"({r.get('dispatch_backend')}) det {r.get('deterministic_winner')} fast {r.get('fast_winner')}")


# Beside the rows of a file written before the last layer: what it holds and what it does not yet.
PARTIAL = "backends measured for the layers listed; the dispatch column is timed after the last layer"


def write_outputs(table: DispatchTable, source: str, result: dict, out: Path | None, table_out: Path | None) -> None:
    """The table (`--table-out`) and the results file (`--out`) as they stand. Also written after
    each layer, so a run cut off by a time limit keeps the table rows of the layers it measured
    (a whole model's layers take minutes: humming compiles, L2-cold copies, 11 row sizes)."""
    if table_out is not None:
        table_out.parent.mkdir(parents=True, exist_ok=True)
        write_json(table_out, {"source": source, **table.to_json()}, indent=1)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, nulls_for_non_finite(result), indent=1)


def run(shapes: list[str], ms: tuple[int, ...], out: Path | None, table_out: Path | None) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    humming = humming_backend.available(device)
    rows: list[dict] = []
    source = f"qerl-pipe bench kernels-dispatch ({', '.join(shapes)})"
    layers = [(model, layer, n, k) for model in shapes for layer, (n, k) in LAYER_SHAPES[model].items()]
    for model, layer, n, k in layers:
        for r in measure_shape(operands(n, k, device, humming, bf16=True, label=layer), ms):
            r.update(model=model, layer=layer,
                     best_us=min(r[f"{b}_us"] for b in DETERMINISTIC_BACKENDS if f"{b}_us" in r))
            rows.append(r)
        torch.cuda.empty_cache()
        table = table_from_rows(rows, device)
        write_outputs(table, source, results_file(rows, [], partial=PARTIAL, torch=torch.__version__, humming=humming,
                                                  table=table.to_json(), rows_m=list(ROWS_M)), out, table_out)
    table = table_from_rows(rows, device)
    dispatch.configure(table, deterministic=True)
    for model, layer, n, k in layers:  # the operands again (the same seed): their memory was freed
        ops = operands(n, k, device, humming)
        for r in rows:
            if r["model"] == model and r["layer"] == layer:
                r.update(_dispatch_row(ops, r["M"]))
                print(_summary(r), flush=True)
        del ops
        torch.cuda.empty_cache()
    result = results_file(rows, _targets(rows), torch=torch.__version__, humming=humming,
                          table=table.to_json(), rows_m=list(ROWS_M), weighted_vs_bf16=_weighted_table(rows, shapes))
    write_outputs(table, source, result, out, table_out)
    for t in result["targets"]:
        print(f"target {t['name']:70} {t['target']:<8} measured {t['measured']:.3f} {'MET' if t['met'] else 'MISSED'}")
    return result
