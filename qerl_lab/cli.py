"""`qerl-pipe bench ...`: the one entry point of every benchmark (docs/benchmarks.md).

Each command prints its results file (JSON: command, commit, gpu, date, results, targets) to
stdout and, with --out, writes it there too; the long-running ones also rewrite --out after each
row, so a run cut short still leaves data. Lists take commas or repeated options alike. The
commands import their benchmark only when run, so `qerl-pipe --help` stays cheap. The main CLI
adds its error policy (a QerlError is one line and exit 1) to every command here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from qerl_lab.results import nulls_for_non_finite
from qerl_pipe.errors import QerlError
from qerl_pipe.strict_json import dumps

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks; results are JSON with a targets block.")

OutOpt = Annotated[Optional[Path], typer.Option(help="Write the JSON here as well as to stdout.")]
ShapesOpt = Annotated[list[str], typer.Option("--shapes", help="Model shapes (comma-separated or repeated): qwen2.5-7b, -14b, -32b, -72b.")]


def values(items: list[str] | None, kind: type = str) -> list:
    """`a,b`, `a b` and repeated options alike, each value once, in first-seen order."""
    words = (w.strip() for item in items or [] for w in item.replace(",", " ").split())
    return [kind(w) for w in dict.fromkeys(w for w in words if w)]


def emit(result: dict, out: Path | None) -> None:
    text = dumps(nulls_for_non_finite(result), indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


@bench_app.command("kernels-cuda")
def bench_kernels_cuda(out: OutOpt = None, shapes: ShapesOpt = ["qwen2.5-7b,qwen2.5-32b"],
                       ms: Annotated[list[str], typer.Option("--ms", help="M values (rows of x); the targets of M not run are left out.")] = ["1,8,16,32,64,128,256,1024,4096"]) -> None:
    """The CUDA W4A16 kernels (decode GEMM, dequantize + cuBLAS) vs cuBLAS bf16 (needs a Hopper GPU and nvcc)."""
    from qerl_lab.kernels_cuda import ALL_MS, run
    from qerl_pipe.kernels import cuda_ext

    unknown = sorted(set(values(ms, int)) - set(ALL_MS))
    if unknown:
        raise QerlError(f"--ms {unknown}: this benchmark measures M in {list(ALL_MS)}")
    why = cuda_ext.why_unavailable("cuda")
    if why is not None:
        raise QerlError(f"the CUDA W4A16 kernels do not run here ({why}); they need a Hopper GPU and nvcc")
    emit(run(values(shapes), out, tuple(values(ms, int))), out)


@bench_app.command("kernels-dispatch")
def bench_kernels_dispatch(out: OutOpt = None, shapes: ShapesOpt = ["qwen2.5-7b,qwen2.5-32b"],
                           ms: Annotated[list[str], typer.Option("--ms", help="M values (rows of x): rows of the dispatch table.")] = ["1,8,16,32,64,128,256,512,1024,4096,16384"],
                           table_out: Annotated[Optional[Path], typer.Option(help="Write the measured dispatch table here (the form of kernels/cuda/dispatch-<gpu>.json).")] = None) -> None:
    """Each NVFP4 backend and cuBLAS bf16 per layer and M, and the dispatch over them (needs a Hopper GPU and nvcc)."""
    from qerl_lab.kernels_dispatch import run
    from qerl_pipe.kernels import cuda_ext
    from qerl_pipe.kernels.dispatch import ROWS_M

    unknown = sorted(set(values(ms, int)) - set(ROWS_M))
    if unknown:
        raise QerlError(f"--ms {unknown}: the dispatch table has rows at M in {list(ROWS_M)}")
    why = cuda_ext.why_unavailable("cuda")
    if why is not None:
        raise QerlError(f"the CUDA W4A16 kernels do not run here ({why}); the dispatch needs a Hopper GPU and nvcc")
    emit(run(values(shapes), tuple(values(ms, int)), out, table_out), out)


@bench_app.command("fp8-rows")
def bench_fp8_rows(out: OutOpt = None,
                   ms: Annotated[list[str], typer.Option("--ms", help="M values (rows of x); the targets of M not run are left out.")] = ["1,8,16,32,64,128,256,512,1024"],
                   sweep: Annotated[bool, typer.Option(help="Also time a grid of the Triton FP8 GEMM's configs per row.")] = False) -> None:
    """FP8 rollout rows (fused activation quantization) vs cuBLAS bf16 and our W4A16 GEMM, per 7B layer and M (needs a Hopper GPU and nvcc)."""
    from qerl_lab.fp8_rows import run

    emit(run(out, tuple(values(ms, int)), sweep), out)


@bench_app.command("attention")
def bench_attention(out: OutOpt = None,
                    shapes: Annotated[list[str], typer.Option("--shapes", help="Model shapes (comma-separated or repeated): their head counts and head size.")] = ["qwen2.5-7b,qwen2.5-32b"],
                    batches: Annotated[list[str], typer.Option(help="Sequences decoded together.")] = ["1,64,256"],
                    context: Annotated[int, typer.Option(help="Cache positions each sequence has already.")] = 3712,
                    sweep: Annotated[bool, typer.Option(help="Also warps, pipeline stages, swapped dots, INT8 by exponent bits.")] = False) -> None:
    """The decode attention kernel, bf16 vs coded KV caches, per tiling (needs a CUDA GPU)."""
    import torch

    from qerl_lab.attention import run
    from qerl_pipe.model.shapes import SHAPES

    chosen = values(shapes)
    if not set(chosen) <= set(SHAPES):
        raise QerlError(f"--shapes takes {', '.join(sorted(SHAPES))}; got {', '.join(chosen)}")
    if not torch.cuda.is_available():
        raise QerlError("bench attention times CUDA kernels and needs a CUDA GPU; none is visible here")
    emit(run(chosen, values(batches, int), context, sweep), out)


@bench_app.command("rollout")
def bench_rollout(out: OutOpt = None,
                  shapes: Annotated[list[str], typer.Option("--shapes", help="Model shapes (comma-separated or repeated): qwen2.5-7b, -14b, -32b, -72b, qwen3-30b-a3b.")] = ["qwen2.5-7b"],
                  batches: Annotated[list[str], typer.Option(help="Batch sizes of our engine.")] = ["1,8,64,256"],
                  hf_batches: Annotated[Optional[list[str]], typer.Option(help="Batch sizes for HF generate; '' skips HF.", show_default="--batches")] = None,
                  prompt_len: Annotated[int, typer.Option(help="Prompt tokens.")] = 256,
                  new_tokens: Annotated[int, typer.Option(help="Generated tokens per sequence (no early stop).")] = 512,
                  hf_new_tokens: Annotated[int, typer.Option(help="Tokens per sequence for HF generate (slow).")] = 64,
                  lora_rank: Annotated[int, typer.Option(help="LoRA rank attached to our model.")] = 32,
                  formats: Annotated[list[str], typer.Option(help="Base formats of our engine: bf16, nvfp4, nf4; '+fp8' after one (nvfp4+fp8) runs FP8 activations (engine.activations=fp8), '+fp8kv' / '+int8kv' an E4M3 / INT8 KV cache (engine.kv_cache=fp8 / int8).")] = ["bf16,nvfp4"],
                  hbm_tbps: Annotated[float, typer.Option(help="HBM bandwidth (TB/s) of the lower bound.")] = 4.2,
                  kernels: Annotated[str, typer.Option(help="NVFP4 kernel dispatch: deterministic, or fast (humming's stream-K rows too).")] = "deterministic",
                  kernel_copies: Annotated[bool, typer.Option(help="humming's copies of NVFP4 weights; --no-kernel-copies measures what a run whose memory plan leaves them out gets (a MoE's experts then decode from their 4-bit stacks).")] = True) -> None:
    """Rollout speed: HF generate vs our engine (random weights, needs a CUDA GPU)."""
    from qerl_lab.rollout import run_rollout_bench
    from qerl_pipe.model.shapes import SHAPES

    unknown = [s for s in values(shapes) if s not in SHAPES]
    if unknown:
        raise QerlError(f"unknown shapes {unknown}; choose from {sorted(SHAPES)}")
    emit(run_rollout_bench(values(shapes), values(batches, int), prompt_len, new_tokens, hf_new_tokens,
                           None if hf_batches is None else values(hf_batches, int), lora_rank,
                           tuple(values(formats)), hbm_tbps, partial=out, kernels=kernels,
                           kernel_copies=kernel_copies), out)


@bench_app.command("train-step")
def bench_train_step(shape: Annotated[Optional[list[str]], typer.Option("--shape", help="Model shapes (comma-separated or repeated): qwen2.5-7b, -14b, -32b, -72b, qwen3-30b-a3b.", show_default="qwen2.5-7b, none with --recipe")] = None,
                     quant: Annotated[list[str], typer.Option("--quant", help="Base formats of the --shape steps (comma-separated or repeated): bf16, nf4, nvfp4.")] = ["bf16,nvfp4"],
                     micro_batch: Annotated[Optional[int], typer.Option(help="Sequences per forward/backward (under a budget: at most).", show_default="8 for 7B/14B/30B-A3B, 4 for 32B/72B")] = None,
                     kv_slots: Annotated[Optional[int], typer.Option(help="Engine slots (KV cache rows; under a budget: at most).", show_default="all 64 sequences at once")] = None,
                     response_len: Annotated[int, typer.Option(help="Sampled tokens per response (no early stop).")] = 1024,
                     memory_limit_gib: Annotated[Optional[float], typer.Option(help="Treat the GPU as having this much free memory.", show_default="what is free")] = None,
                     adapter: Annotated[str, typer.Option(help="lora, or full: every weight trains (with --quant bf16 only).")] = "lora",
                     memory_budget_gb: Annotated[Optional[float], typer.Option(help="Plan each --shape step to this budget (GB, 10^9 bytes) and cap the process to it.", show_default="no budget")] = None,
                     recipe: Annotated[Optional[list[str]], typer.Option("--recipe", help="Recipe files (comma-separated or repeated; recipes/ladder/*.yaml): run each one's step under its train.memory_budget_gb.")] = None,
                     unconstrained: Annotated[bool, typer.Option(help="Run the --recipe steps without their budgets (the time with the whole GPU).")] = False,
                     append: Annotated[bool, typer.Option(help="Keep the rows already in --out, and the settings that describe them.")] = False,
                     kernels: Annotated[str, typer.Option(help="NVFP4 kernel dispatch: deterministic, or fast (humming's stream-K rows too; not the same bits run to run).")] = "deterministic",
                     profile_train: Annotated[bool, typer.Option(help="Run one more step with torch.profiler around its training phase; its kernel time by kind goes in the row.")] = False,
                     timed_steps: Annotated[int, typer.Option(help="Steps timed in a row (at least 1); a row's times are the median of those after the first (which is reported beside them).")] = 3,
                     one_wave: Annotated[bool, typer.Option(help="Run one wave of the planned KV slots' prompts; the plan and the engine stay the full step's (the row says what was lowered).")] = False,
                     stop_at: Annotated[Optional[int], typer.Option(help="Stop each response at this many tokens; the plan and the engine keep the full length.", show_default="the full length")] = None,
                     out: Annotated[Optional[Path], typer.Option(help="Rewritten after each configuration, and at the end.")] = None) -> None:
    """One full RL step (8 prompts x 8 samples, 256 + 1024 tokens, LoRA r32) per shape and base format, or per recipe (--recipe); needs a CUDA GPU."""
    from qerl_lab.train_step import GIB, StepSettings, run_train_step_bench

    if kernels not in ("deterministic", "fast"):
        raise QerlError(f"--kernels {kernels!r}: choose deterministic or fast")
    if timed_steps < 1:
        raise QerlError(f"--timed-steps {timed_steps}: time at least one step (3 gives a steady state beside the first)")
    if stop_at is not None and stop_at < 1:
        raise QerlError(f"--stop-at {stop_at}: stop responses after at least one token")
    settings = StepSettings(micro_batch=micro_batch, kv_slots=kv_slots, response_len=response_len, adapter=adapter,
                            kernels=kernels, profile_train=profile_train, timed_steps=timed_steps,
                            one_wave=one_wave, stop_at=stop_at)
    limit = int(memory_limit_gib * GIB) if memory_limit_gib else None
    recipes = [Path(p) for p in dict.fromkeys(p.strip() for item in recipe or [] for p in item.split(",")) if p]
    shapes = values(shape) if shape is not None else ([] if recipes else ["qwen2.5-7b"])
    emit(run_train_step_bench(shapes, values(quant), settings, memory_limit_bytes=limit, out=out,
                              memory_budget_gb=memory_budget_gb, recipes=recipes, unconstrained=unconstrained,
                              append=append), out)


@bench_app.command("train-scaling")
def bench_train_scaling(out: OutOpt = None,
                        shape: Annotated[str, typer.Option(help="Model shape (random weights): qwen2.5-7b, ... or tiny.")] = "qwen2.5-7b",
                        nproc: Annotated[list[str], typer.Option(help="Process counts (one GPU each).")] = ["1,2"],
                        device: Annotated[str, typer.Option(help="cuda, or cpu (gloo; a smoke test).")] = "cuda",
                        prompts_per_step: Annotated[int, typer.Option(help="Global batch B (prompts per step).")] = 32,
                        group_size: Annotated[int, typer.Option(help="Samples per prompt G.")] = 8,
                        prompt_len: Annotated[int, typer.Option(help="Prompt tokens.")] = 128,
                        new_tokens: Annotated[int, typer.Option(help="Generated tokens per sample (no early stop).")] = 256,
                        steps: Annotated[int, typer.Option(help="Timed steps after the warm-up.")] = 3,
                        warmup: Annotated[int, typer.Option(help="Warm-up steps (not timed).")] = 1,
                        lora_rank: Annotated[int, typer.Option(help="LoRA rank.")] = 32,
                        micro_batch_size: Annotated[int, typer.Option(help="Sequences per forward/backward.")] = 32) -> None:
    """RL steps/s on 1 vs N GPUs at the same global batch, through torchrun (target: 2 GPUs >= 1.8x)."""
    from qerl_lab.train_scaling import run_train_scaling_bench

    emit(run_train_scaling_bench(shape, values(nproc, int), device, prompts_per_step, group_size, prompt_len,
                                 new_tokens, steps, warmup, lora_rank, micro_batch_size), out)


@bench_app.command("memory")
def bench_memory(out: OutOpt = None) -> None:
    """GPU memory of a Qwen2.5-32B-shaped model built directly in NVFP4 (target: under 20 GiB; needs a CUDA GPU)."""
    from qerl_lab.memory import run_memory_bench

    emit(run_memory_bench(), out)


@bench_app.command("decode-profile")
def bench_decode_profile(shape: Annotated[str, typer.Option(help="Model shape: qwen2.5-7b, -14b, -32b, -72b, qwen3-30b-a3b (its experts grouped, as the engine runs them).")] = "qwen2.5-7b",
                         formats: Annotated[list[str], typer.Option("--formats", help="Base formats (comma-separated or repeated): bf16, nvfp4, nf4, each with '+fp8' (FP8 activations) and '+fp8kv' / '+int8kv' (a coded KV cache) as in bench rollout; 'LABEL@B' runs at batch B only.")] = ["bf16,nvfp4"],
                         batches: Annotated[list[str], typer.Option("--batch", help="Sequences decoded together (comma-separated or repeated: each batch with every format).")] = ["8"],
                         context: Annotated[int, typer.Option(help="Cache positions each sequence has already.")] = 512,
                         steps: Annotated[int, typer.Option(help="Decode steps profiled.")] = 8,
                         out: OutOpt = None) -> None:
    """Kernels per decode step and per layer, and GPU time per kernel kind (needs a CUDA GPU)."""
    from qerl_lab.decode_profile import run
    from qerl_pipe.model.shapes import SHAPES

    import torch

    from qerl_pipe.kernels.base_formats import NAMES

    from qerl_lab.rollout import parse_label

    chosen = values(formats)
    if shape not in SHAPES or not {parse_label(label.split("@")[0])[0] for label in chosen} <= set(NAMES):
        raise QerlError(f"--shape is one of {sorted(SHAPES)} and --formats of {', '.join(NAMES)}, each with "
                        "+fp8 (FP8 activations) and +fp8kv or +int8kv (a coded KV cache) if wanted")
    if not torch.cuda.is_available():
        raise QerlError("bench decode-profile profiles CUDA kernels and needs a CUDA GPU; none is visible here")
    emit(run(shape, chosen, values(batches, int), context, steps, partial=out), out)


@bench_app.command("quantize")
def bench_quantize(model: Annotated[str, typer.Option(help="Model source for the quality figures.")] = "smollm2-135m-instruct",
                   shard_mb: Annotated[int, typer.Option(help="Shard size of the synthetic multi-shard model.")] = 64,
                   out: OutOpt = None) -> None:
    """Quantize-stage time, peak host memory (streaming) and quality; runs on CPU."""
    from qerl_lab.quantize import run_quantize_bench

    emit(run_quantize_bench(model, shard_mb), out)


@bench_app.command("quantize-methods")
def bench_quantize_methods(model: Annotated[str, typer.Option(help="Model source.")] = "smollm2-135m-instruct",
                           methods: Annotated[list[str], typer.Option(help="quantize.method values.")] = ["rtn,mse,act-mse"],
                           out: OutOpt = None) -> None:
    """Perplexity over bf16 for each NVFP4 block-scale method (rtn, mse, act-mse); runs on CPU."""
    from qerl_lab.quantize import run_quantize_methods_bench

    emit(run_quantize_methods_bench(model, values(methods)), out)


@bench_app.command("arms")
def bench_arms(arm: Annotated[list[str], typer.Option("--arm", help="NAME=RUN_DIR or NAME=RUN.log (repeat; order = legend order).")],
               out_dir: Annotated[Path, typer.Option(help="Where arms.json and the plots go.")],
               title: Annotated[str, typer.Option(help="Plot title.")] = "arms",
               full: Annotated[str, typer.Option(help="The unquantized LoRA arm.")] = "bf16",
               quantized: Annotated[str, typer.Option(help="Quantized arms without AQN, comma-separated.")] = "nvfp4,nf4",
               aqn_pairs: Annotated[str, typer.Option(help="WITH:WITHOUT arms that differ only in AQN, comma-separated.")] = "qerl:nvfp4,bf16-aqn:bf16",
               qlora_pairs: Annotated[str, typer.Option(help="ARM:QLORA pairs, each arm checked against the QLoRA (NF4) arm.")] = "qerl:nf4,nvfp4:nf4",
               full_ft_pairs: Annotated[str, typer.Option(help="ARM:FULL pairs, each arm's greedy accuracy after training checked against the full fine-tuning arm's (within 1 point).")] = "qerl:full,qerl-act-mse:full",
               calibrated_pairs: Annotated[str, typer.Option(help="CALIBRATED:RTN pairs that differ only in quantize.method.")] = "qerl-act-mse:qerl",
               note: Annotated[str, typer.Option(help="Stored in the results file (how the arms were run).")] = "",
               gpu: Annotated[Optional[str], typer.Option(help="The GPU the arms ran on, when summarised elsewhere.")] = None) -> None:
    """Training arms side by side (bf16 LoRA, QLoRA, NVFP4, NVFP4 + AQN, full fine-tuning, calibrated NVFP4, ...): plots and the QeRL paper's claims."""
    from qerl_lab.arms import summarize_arms

    emit(summarize_arms(arm, out_dir, title, full, quantized, aqn_pairs, qlora_pairs, note, gpu, full_ft_pairs,
                        calibrated_pairs), None)


@bench_app.command("seeds")
def bench_seeds(arms: Annotated[list[Path], typer.Argument(help="arms.json of each seed, in seed order.")],
                out: Annotated[Path, typer.Option(help="The results file.")],
                note: Annotated[str, typer.Option(help="Stored in the results file (what the seeds are).")] = "",
                gpu: Annotated[Optional[str], typer.Option(help="The GPU the arms ran on, when summarised elsewhere.")] = None) -> None:
    """The arms of several seeds side by side: each arm's figures over the seeds, how often each claim held."""
    from qerl_lab.seeds import summarize_seeds

    emit(summarize_seeds(arms, out, note, gpu), None)
