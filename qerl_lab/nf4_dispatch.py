"""The NF4 rows of the kernel dispatch: ours (Triton), bitsandbytes, dequantize + cuBLAS, cuBLAS bf16.

`qerl-pipe bench kernels-dispatch --formats nf4 --out FILE.json --table-out FILE.json` (a CUDA GPU
with the qlora extra). For every Qwen2.5 layer and table row M, forward (`nf4`) and dX (`nf4-dx`):
- `triton`: our Triton NF4 kernels with the config the default table gives that M (an engine
  built with tuning may do better at its own M buckets);
- `bnb`: bitsandbytes as `Linear4bit` runs it (`kernels.bnb_backend`: gemv_4bit at one row,
  dequantize_4bit + cuBLAS above; dX dequantize_4bit + cuBLAS);
- `dequant`: our Triton decode pass into bf16, then cuBLAS;
- `bf16`: cuBLAS on the bf16 weight (the ratio's denominator, never a table pick).
Same protocol as the NVFP4 rows (L2-cold weight copies, one CUDA graph, median of replays; each
backend checked against the fp32 product first). The winners of each op make the table's NF4
rows (both columns: all three are deterministic); then `nf4_linear` / `nf4_linear_dx` with that
table installed are timed the same way, to check the dispatch picks what it measured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qerl_lab.results import results_file, target
from qerl_pipe.errors import QerlError
from qerl_pipe.kernels.dequant_gemm import release_scratch
from qerl_pipe.formats.nf4 import dequantize_nf4, quantize_nf4
from qerl_pipe.kernels import bnb_backend, dispatch
from qerl_pipe.kernels.configs import get_config
from qerl_pipe.kernels.dispatch import NF4_BACKENDS, DispatchTable, nf4_row_key
from qerl_pipe.kernels.linear import NF4_DEQUANT_CONFIG, nf4_linear, nf4_linear_dx
from qerl_pipe.kernels.packing import PackedNF4, prepare_nf4
from qerl_pipe.kernels.triton_matmul import launch_dx, launch_forward
from qerl_pipe.kernels.tuning import rel_err, time_graph, weight_copies

REPS = 30
MAX_REL_ERR = 1e-2
# The dispatch's NF4 ops (table key prefixes, not base-format names): forward, and the backward's dX.
FORWARD, DX = dispatch.NF4_OPS


@dataclass
class NF4Operands:
    """One random [N, K] NF4 layer, as many copies of it (and of its bf16 weight) as keep L2 cold."""

    n: int
    k: int
    dense: Tensor  # the NF4 weight dequantized to fp32: the reference
    packed: list[PackedNF4]
    bf16: list[Tensor]


def nf4_operands(n: int, k: int, device: torch.device) -> NF4Operands:
    gen = torch.Generator(device=device).manual_seed(n * 31 + k)
    w = torch.randn(n, k, device=device, generator=gen) * 0.02
    q = quantize_nf4(w)
    wb = w.to(torch.bfloat16)
    del w
    packed = [prepare_nf4(q)]
    packed += [prepare_nf4(type(q)(q.packed.clone(), q.absmax.clone())) for _ in range(weight_copies(q.packed.numel()) - 1)]
    bf16 = [wb] + [wb.clone() for _ in range(weight_copies(wb.numel() * 2) - 1)]
    return NF4Operands(n, k, dequantize_nf4(q, torch.float32), packed, bf16)


def _calls(ops: NF4Operands, op: str, m: int) -> dict[str, Callable[[Tensor, int], Tensor]]:
    """backend -> f(a, i): the product on copy i (`a` is x for `nf4`, dY for `nf4-dx`)."""
    p, wb = ops.packed, ops.bf16
    if op == FORWARD:
        cfg = get_config("fwd", "nf4", m, ops.n, ops.k)
        return {"triton": lambda a, i: launch_forward(a, p[i % len(p)], cfg),
                "bnb": lambda a, i: bnb_backend.matmul(a, p[i % len(p)]),
                "dequant": lambda a, i: launch_forward(a, p[i % len(p)], NF4_DEQUANT_CONFIG),
                "bf16": lambda a, i: a @ wb[i % len(wb)].T}
    cfg = get_config("dx", "nf4", m, ops.n, ops.k)
    return {"triton": lambda a, i: launch_dx(a, p[i % len(p)], cfg),
            "bnb": lambda a, i: bnb_backend.matmul_dx(a, p[i % len(p)]),
            "dequant": lambda a, i: launch_dx(a, p[i % len(p)], NF4_DEQUANT_CONFIG),
            "bf16": lambda a, i: a @ wb[i % len(wb)]}


def _input(ops: NF4Operands, op: str, m: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator(device=ops.dense.device).manual_seed(ops.n * 7 + ops.k * 3 + m)
    width = ops.k if op == FORWARD else ops.n
    a = torch.randn(m, width, device=ops.dense.device, generator=gen).to(torch.bfloat16)
    return a, (a.float() @ ops.dense.T if op == FORWARD else a.float() @ ops.dense)


def measure_nf4_shape(ops: NF4Operands, ms: tuple[int, ...]) -> list[dict]:
    """One row per (op, M): each backend's µs and error, and the winner."""
    rows = []
    copies = max(len(ops.packed), len(ops.bf16))
    for op in (FORWARD, DX):
        for m in ms:
            a, ref = _input(ops, op, m)
            row: dict = {"op": op, "N": ops.n, "K": ops.k, "M": m}
            for name, f in _calls(ops, op, m).items():
                if name != "bf16":  # bf16 is the unquantized weight: its distance is the quantization's
                    err = row[f"{name}_rel_err"] = rel_err(f(a, 0), ref)
                    if err >= MAX_REL_ERR:
                        continue
                row[f"{name}_us"] = time_graph([lambda i=i, f=f: f(a, i) for i in range(copies)], REPS) * 1e6
            timed = {b: row[f"{b}_us"] for b in NF4_BACKENDS if f"{b}_us" in row}
            if timed:
                row["winner"] = min(timed, key=timed.get)
            rows.append(row)
    return rows


def nf4_table(rows: list[dict], device: torch.device) -> DispatchTable:
    props = torch.cuda.get_device_properties(device)
    picks = {nf4_row_key(r["op"], r["M"], r["N"], r["K"]): r["winner"] for r in rows if "winner" in r}
    return DispatchTable(props.name, props.multi_processor_count, deterministic=picks, fast=dict(picks))


def time_dispatch(ops: NF4Operands, row: dict) -> None:
    """`nf4_linear` / `nf4_linear_dx` under the installed table at the row's M: µs, error, pick."""
    op, m = row["op"], row["M"]
    a, ref = _input(ops, op, m)
    f = nf4_linear if op == FORWARD else nf4_linear_dx
    p = ops.packed
    row["dispatch_us"] = time_graph([lambda w=w: f(a, w) for w in p], REPS) * 1e6
    row["dispatch_rel_err"] = rel_err(f(a, p[0]), ref)
    row["dispatch_backend"] = dispatch.nf4_backend(op, m, ops.n, ops.k, a.device, bnb_backend.available(a.device))


def _summary(r: dict) -> str:
    cells = " ".join(f"{b} {r[f'{b}_us']:8.1f}" for b in (*NF4_BACKENDS, "bf16") if f"{b}_us" in r)
    return (f"{r['model']:>11} {r['layer']:>7} {r['op']:>6} M={r['M']:<5} {cells} | dispatch "
            f"{r.get('dispatch_us', float('nan')):8.1f} ({r.get('dispatch_backend')}) winner {r.get('winner')}")


def run_nf4(shapes: list[str], ms: tuple[int, ...], out: Path | None, table_out: Path | None) -> dict:
    """Every layer of `shapes` at every M, the table the winners make, and the dispatch timed under it."""
    from qerl_lab.kernels import LAYER_SHAPES
    from qerl_lab.kernels_dispatch import PARTIAL, write_outputs

    device = torch.device("cuda", torch.cuda.current_device())
    if not bnb_backend.available(device):
        raise QerlError(f"bitsandbytes does not run here ({bnb_backend.why_unavailable(device)}); "
                        "pip install 'qerl-pipe[qlora]'")
    layers = [(model, layer, n, k) for model in shapes for layer, (n, k) in LAYER_SHAPES[model].items()]
    source = f"qerl-pipe bench kernels-dispatch --formats nf4 ({', '.join(shapes)})"
    rows: list[dict] = []
    for model, layer, n, k in layers:
        ops = nf4_operands(n, k, device)
        shape_rows = measure_nf4_shape(ops, ms)
        for r in shape_rows:
            r.update(model=model, layer=layer,
                     **{f"{b}_vs_bf16": r["bf16_us"] / r[f"{b}_us"] for b in NF4_BACKENDS if f"{b}_us" in r})
        rows += shape_rows
        del ops
        release_scratch()
        torch.cuda.empty_cache()
        table = nf4_table(rows, device)
        write_outputs(table, source, results_file(rows, [], partial=PARTIAL, torch=torch.__version__,
                                                  bitsandbytes=_bnb_version(), table=table.to_json(),
                                                  rows_m=list(ms)), out, table_out)
    table = nf4_table(rows, device)
    dispatch.configure(table, deterministic=True)
    for model, layer, n, k in layers:  # the operands again (the same seed): their memory was freed
        ops = nf4_operands(n, k, device)
        for r in rows:
            if r["model"] == model and r["layer"] == layer:
                time_dispatch(ops, r)
                print(_summary(r), flush=True)
        del ops
        release_scratch()
        torch.cuda.empty_cache()
    over = [r["dispatch_us"] / min(r[f"{b}_us"] for b in NF4_BACKENDS if f"{b}_us" in r)
            for r in rows if "dispatch_us" in r and "winner" in r]
    worst = max(over) if over else float("nan")
    targets = [target("NF4 dispatch time over the fastest backend, every layer and M", "<= 1.03", worst, "x (max)",
                      worst <= 1.03)] if over else []
    result = results_file(rows, targets, torch=torch.__version__, bitsandbytes=_bnb_version(),
                          table=table.to_json(), rows_m=list(ms))
    write_outputs(table, source, result, out, table_out)
    return result


def _bnb_version() -> str:
    import bitsandbytes

    return bitsandbytes.__version__
