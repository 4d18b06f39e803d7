"""FP8 rollout rows against cuBLAS bf16 and our W4A16 GEMM, per 7B layer and M (issue 47).

`qerl-pipe bench fp8-rows --out FILE.json` (a GPU with FP8 tensor cores). For each Qwen2.5-7B
linear (q/k/v and gate/up fused, as the model runs them) and each M, under one protocol (L2-cold
weight copies, one CUDA graph, median of replays; `kernels.tuning.time_graph`):
- `bf16_us`: x @ W^T, cuBLAS bf16;
- `qerl_us`: our W4A16 CUDA GEMM on the NVFP4 weight (M <= 256);
- `fp8_us`: cuBLASLt's FP8 GEMM (torch's row-wise scaled matmul) on the FP8 copy the engine
  makes of the NVFP4 weight, activations already quantized (as the fused norm kernel hands them over);
- `fp8_quant_us`: the same plus one compiled quantization launch (o and down's inputs before the
  row kernel);
- `triton_us`: our Triton FP8 GEMM (`kernels.triton_fp8.fp8_gemm`, its default config) on the same
  copy and codes; `--sweep` also times a grid of its configs (`triton_best_us`, `triton_best`);
- `fp8_tensorwise_us`, `fp8_fast_accum_us`: torch's other FP8 GEMM paths (one scale per tensor;
  row-wise with fast accumulation), timed only: whether the library has a faster kernel there.
And the fused add + RMSNorm kernel (hidden 3584) with and without its FP8 output, and the E4M3
rows of o's input (3584) and of down's (the SiLU gate fused in, 18944) by our row kernel
(`triton_fp8.gated_rows`) against the compiled quantization (and gate). A layer-weighted ratio
counts a decoder layer: q/k/v and gate/up on norm-fused activations, o and down on a quantization
launch, the norm's extra time included; `engine_us` is the engine's path (our GEMM up to
`fp8.OURS_MAX_ROWS` rows, cuBLASLt's above, our row kernels), which the targets measure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qerl_lab.kernels import LAYER_SHAPES
from qerl_lab.results import nulls_for_non_finite, results_file, target
from qerl_pipe.errors import QerlError
from qerl_pipe.kernels import cuda_ext
from qerl_pipe.kernels.decode_ops import add_rms_norm
from qerl_pipe.kernels.dispatch_measure import REPS, inputs, operands
from qerl_pipe.kernels.fp8 import OURS_MAX_ROWS, Fp8Rows, Fp8Weight, quantize_rows, quantize_weight, row_codes, runs_fp8
from qerl_pipe.kernels.triton_fp8 import fp8_gemm, gemm_config, gated_rows
from qerl_pipe.kernels.tuning import rel_err, time_graph
from qerl_pipe.model.decoder import silu_gate
from qerl_pipe.strict_json import write_json

MS = (1, 8, 16, 32, 64, 128, 256, 512, 1024)
MODEL = "qwen2.5-7b"
# Issue 47: the layer-weighted FP8 rows (activation quantization included) over cuBLAS bf16.
LAYER_TARGETS = {64: 1.4, 256: 1.4}


def cublaslt(x: Fp8Rows, w: Fp8Weight) -> torch.Tensor:
    """The library's FP8 GEMM (torch's row-wise scaled matmul on cuBLASLt), which the engine ran
    before our Triton GEMM: the comparison's other FP8 column."""
    return torch._scaled_mm(x.codes, w.codes.t(), scale_a=x.scale, scale_b=w.scale, out_dtype=torch.bfloat16)


# The compiled quantization the engine ran before our row kernel (one inductor kernel).
quantize_fused = torch.compile(row_codes, dynamic=False)


def _sweep(m: int, n: int, k: int) -> list[dict[str, int]]:
    """Configs of the Triton FP8 GEMM worth timing at M tokens over [N, K]: no more than 4 programs an SM."""
    block_m = gemm_config(m, n, k)["BLOCK_M"]
    out = []
    for block_n in (64, 128):
        for block_k in (128, 256):
            for split in (1, 2, 4, 8):
                tiles = -(-n // block_n) * -(-m // block_m)
                if (split == 1 or tiles * split <= 4 * 132) and k // (block_k * split) >= 2:
                    out += [{"BLOCK_N": block_n, "BLOCK_M": block_m, "BLOCK_K": block_k, "SPLIT_K": split,
                             "STAGES": stages, "num_warps": 4} for stages in (4,)
                            if stages * (block_n + block_m) * block_k <= 200 * 1024]  # shared memory
    return out


def _layer_rows(layer: str, n: int, k: int, device: torch.device, ms: tuple[int, ...], sweep: bool) -> list[dict]:
    ops = operands(n, k, device, humming=False, bf16=True, label=f"{MODEL} {layer}")
    # The engine's copy: per-channel E4M3 of the NVFP4 weight dequantized to bf16.
    copies = [quantize_weight(cuda_ext.dequantize(t)) for t in ops.tiled]
    rows = []
    for m in ms:
        x, ref = inputs(ops, m)
        q = quantize_rows(x)
        row: dict[str, Any] = {"model": MODEL, "layer": layer, "N": n, "K": k, "M": m}
        row["bf16_us"] = time_graph([lambda w=w: x @ w.T for w in ops.bf16], REPS) * 1e6
        if m <= 256:
            row["qerl_us"] = time_graph([lambda t=t: cuda_ext.gemm(x, t) for t in ops.tiled], REPS) * 1e6
        row["fp8_us"] = time_graph([lambda w=w: cublaslt(q, w) for w in copies], REPS) * 1e6
        row["fp8_quant_us"] = time_graph([lambda w=w: cublaslt(Fp8Rows(*quantize_fused(x)), w) for w in copies],
                                         REPS) * 1e6
        # The library's other FP8 paths at the same sizes (timing only; the engine runs neither): one
        # scale per tensor (cuBLASLt's classic FP8 GEMM), and row-wise scales with fast accumulation.
        one = torch.ones((), device=device)
        row["fp8_tensorwise_us"] = time_graph([lambda w=w: torch._scaled_mm(q.codes, w.codes.t(), one, one,
                                                                            out_dtype=torch.bfloat16)
                                               for w in copies], REPS) * 1e6
        row["fp8_fast_accum_us"] = time_graph([lambda w=w: torch._scaled_mm(q.codes, w.codes.t(), q.scale, w.scale,
                                                                            out_dtype=torch.bfloat16,
                                                                            use_fast_accum=True)
                                               for w in copies], REPS) * 1e6
        row["triton_us"] = time_graph([lambda w=w: fp8_gemm(q, w) for w in copies], REPS) * 1e6
        row["triton_config"] = gemm_config(m, n, k)
        row["triton_rel_err"] = rel_err(fp8_gemm(q, copies[0]), ref)
        if sweep:
            timed = [(time_graph([lambda w=w: fp8_gemm(q, w, config=c) for w in copies], REPS) * 1e6, c)
                     for c in _sweep(m, n, k)]
            row["triton_best_us"], row["triton_best"] = min(timed, key=lambda t: t[0])
        row["fp8_rel_err"] = rel_err(cublaslt(q, copies[0]), ref)
        row["bf16_rel_err"] = rel_err(x @ ops.bf16[0].T, ref)
        rows.append(row)
        print(f"{layer:8} M {m:5}: bf16 {row['bf16_us']:8.1f} us, W4A16 {row.get('qerl_us', float('nan')):8.1f}, "
              f"fp8 {row['fp8_us']:8.1f} (+quant {row['fp8_quant_us']:8.1f}), triton {row['triton_us']:8.1f} "
              f"(best {row.get('triton_best_us', float('nan')):8.1f} {row.get('triton_best', '')}), "
              f"err {row['fp8_rel_err']:.2e} / {row['triton_rel_err']:.2e}", flush=True)
    return rows


def _producer_rows(device: torch.device, ms: tuple[int, ...]) -> list[dict]:
    """The fused norm's time with and without its FP8 output, and the row kernels' against the
    compiled quantization (o's input; down's with the gate), per M."""
    hidden = LAYER_SHAPES[MODEL]["o"][1]
    inter = LAYER_SHAPES[MODEL]["down"][1]
    gen = torch.Generator(device=device).manual_seed(3)
    weight = torch.rand(hidden, generator=gen, device=device).to(torch.bfloat16)
    noise = torch.zeros(hidden, device=device)
    rows = []
    for m in ms:
        x, r = (torch.randn(m, hidden, generator=gen, device=device).to(torch.bfloat16) for _ in range(2))
        gate_up = torch.randn(m, 2 * inter, generator=gen, device=device).to(torch.bfloat16)
        rows.append({
            "quant_o_compiled_us": time_graph([lambda: quantize_fused(x)], REPS) * 1e6,
            "quant_o_rows_us": time_graph([lambda: gated_rows(x)], REPS) * 1e6,
            "gate_quant_down_compiled_us": time_graph([lambda: quantize_fused(silu_gate(gate_up))], REPS) * 1e6,
            "gate_quant_down_rows_us": time_graph([lambda: gated_rows(gate_up, "silu")], REPS) * 1e6,
            "gate_down_us": time_graph([lambda: silu_gate(gate_up)], REPS) * 1e6,
            "M": m,
            "norm_us": time_graph([lambda: add_rms_norm(x, r, weight, noise, 1e-6)], REPS) * 1e6,
            "norm_fp8_us": time_graph([lambda: add_rms_norm(x, r, weight, noise, 1e-6, quantize=True)], REPS) * 1e6,
        })
    return rows


def _weighted(layers: list[dict], producers: list[dict], m: int) -> dict[str, float]:
    """bf16 layer time over the FP8 layer time as the engine runs it (see the module doc); and
    over our W4A16 GEMM's, where it ran."""
    by = {r["layer"]: r for r in layers if r["M"] == m}
    p = next(r for r in producers if r["M"] == m)
    bf16 = sum(r["bf16_us"] for r in by.values())
    fp8 = (by["qkv"]["fp8_us"] + by["gate_up"]["fp8_us"] + by["o"]["fp8_quant_us"] + by["down"]["fp8_quant_us"]
           + 2 * (p["norm_fp8_us"] - p["norm_us"]))
    out = {"M": m, "bf16_us": bf16, "fp8_us": fp8, "fp8_over_bf16": bf16 / fp8,
           "fp8_gemm_only_over_bf16": bf16 / sum(r["fp8_us"] for r in by.values())}
    # Our quantization: o's rows by the row kernel, down's by the gate + row kernel (in place of the
    # bf16 gate, so only its excess counts), the norm's extra output.
    extra = (p["quant_o_rows_us"] + p["gate_quant_down_rows_us"] - p["gate_down_us"]
             + 2 * (p["norm_fp8_us"] - p["norm_us"]))
    for key, column in (("triton", "triton_us"), ("triton_best", "triton_best_us")):
        if all(column in r for r in by.values()):
            ours = sum(r[column] for r in by.values()) + extra
            out[f"{key}_us"], out[f"{key}_over_bf16"] = ours, bf16 / ours
    # The engine's path: our GEMM up to OURS_MAX_ROWS rows, cuBLASLt's above, our quantization.
    engine = sum(r["triton_us" if m <= OURS_MAX_ROWS else "fp8_us"] for r in by.values()) + extra
    out["engine_us"], out["engine_over_bf16"] = engine, bf16 / engine
    if all("qerl_us" in r for r in by.values()):
        w4 = sum(r["qerl_us"] for r in by.values())
        out["w4a16_us"], out["w4a16_over_bf16"], out["fp8_over_w4a16"] = w4, bf16 / w4, w4 / fp8
    return out


def run(out: Path | None, ms: tuple[int, ...] = MS, sweep: bool = False) -> dict[str, Any]:
    if not torch.cuda.is_available() or not runs_fp8(torch.device("cuda")):
        raise QerlError("bench fp8-rows needs a CUDA GPU with FP8 tensor cores (Ada, Hopper or newer)")
    why = cuda_ext.why_unavailable("cuda")
    if why is not None:
        raise QerlError(f"the CUDA W4A16 kernels do not run here ({why}); the comparison needs a Hopper GPU and nvcc")
    device = torch.device("cuda", torch.cuda.current_device())
    layers = [row for layer, (n, k) in LAYER_SHAPES[MODEL].items()
              for row in _layer_rows(layer, n, k, device, ms, sweep)]
    producers = _producer_rows(device, ms)
    weighted = [_weighted(layers, producers, m) for m in ms]
    for w in weighted:
        print(f"M {w['M']:5}: cuBLASLt FP8 layer {w['fp8_over_bf16']:.3f}x bf16 (GEMMs alone "
              f"{w['fp8_gemm_only_over_bf16']:.3f}x), Triton FP8 layer {w['triton_over_bf16']:.3f}x, "
              f"the engine's {w['engine_over_bf16']:.3f}x"
              + (f" (best configs {w['triton_best_over_bf16']:.3f}x)" if "triton_best_over_bf16" in w else "")
              + (f", W4A16 {w['w4a16_over_bf16']:.3f}x" if "w4a16_over_bf16" in w else ""), flush=True)
    targets = [target(f"{MODEL} layer-weighted FP8 rows as the engine runs them over cuBLAS bf16 at M = {m}, "
                      "activation quantization included", f">= {want}x", round(w["engine_over_bf16"], 3), "x",
                      w["engine_over_bf16"] >= want)
               for m, want in LAYER_TARGETS.items() for w in weighted if w["M"] == m]
    result = results_file({"layers": layers, "producers": producers, "layer_weighted": weighted}, targets,
                          protocol=f"L2-cold weight copies, one CUDA graph, median of {REPS} replays")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, nulls_for_non_finite(result), indent=1)
    return result
