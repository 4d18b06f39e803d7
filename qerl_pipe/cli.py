"""The `qerl-pipe` command line: thin over `stages/`.

Stage commands print the artifact directory as the last line of stdout (logs and progress go to
stderr), so a Makefile or a shell can chain them. A user-facing error prints one line and exits 1.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated, Callable, Optional, TypeVar

import typer

from qerl_pipe.errors import QerlError

app = typer.Typer(
    name="qerl-pipe", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="NVFP4 quantization + LoRA RL (GRPO/DAPO with adaptive quantization noise) as a pipeline of versioned artifacts.",
)
bench_app = typer.Typer(no_args_is_help=True, help="GPU benchmarks; results are JSON with a targets block.")
app.add_typer(bench_app, name="bench")

F = TypeVar("F", bound=Callable)

RecipeOpt = Annotated[Optional[Path], typer.Option("--recipe", "-r", help="Recipe YAML file (defaults apply without one).")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override a recipe value: section.key=value (repeatable).")]
# Defaults that are not the value itself go in show_default: rich reads "[default: ...]" written in
# a help text as a markup tag and drops it (--help said "Artifact store directory .").
ArtifactsOpt = Annotated[Optional[Path], typer.Option("--artifacts", envvar="QERL_ARTIFACTS", help="Artifact store directory.", show_default="./artifacts")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Redo the stage even if an up-to-date artifact exists.")]
VerifyOpt = Annotated[bool, typer.Option("--verify", help="Re-hash every file of each artifact used (by default only files whose size or mtime changed since it was made).")]
BuildMissingOpt = Annotated[bool, typer.Option("--build-missing", help="Make the inputs the recipe describes that are not in the store (calibrate, quantize, ... as `run` would); without it a missing input is an error naming the command that makes it.")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Model source (sets model.source): HF directory, hub id, .gguf file or alias.")]


def _user_errors(fn: F) -> F:
    """Report QerlError (and OSError: disk full, permissions) as one line on stderr and exit 1, instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except QerlError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        except OSError as exc:  # a full disk, a read-only or missing path: the machine, not a bug
            from qerl_pipe.userfiles import describe_os_error

            typer.echo(f"error: {describe_os_error(exc)}", err=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            typer.echo("interrupted: no partial artifact was kept; the same command again reuses the finished "
                       "stages and resumes a train from its last checkpoint", err=True)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _recipe(recipe: Path | None, overrides: list[str] | None, model: str | None = None):
    from qerl_pipe.recipe import load_recipe

    overrides = list(overrides or [])
    if model is not None:
        overrides.append(f"model.source={json.dumps(model)}")
    return load_recipe(recipe, overrides)


def _run_stage(name: str, recipe, store, refs: dict[str, str | None], **options) -> None:
    """Run stage `name` through its entry point in the DAG, each input given on the command line
    (`refs`: keyword -> path or id) resolved in the store, and print the artifact's path."""
    from qerl_pipe.dag import stage

    inputs = {keyword: store.resolve(ref) for keyword, ref in refs.items() if ref}
    print(stage(name).entry_point()(recipe, store, **inputs, **options).path)


def _store(artifacts: Path | None, verify: bool = False):
    from qerl_pipe.artifacts import ArtifactStore

    return ArtifactStore(artifacts, full_verify=verify)


@app.command()
@_user_errors
def calibrate(recipe: RecipeOpt = None, set_: SetOpt = None, model: ModelOpt = None,
              artifacts: ArtifactsOpt = None, force: ForceOpt = False, verify: VerifyOpt = False) -> None:
    """Record activation amax and weight statistics of the unquantized model."""
    _run_stage("calibrate", _recipe(recipe, set_, model), _store(artifacts, verify), {}, force=force)


@app.command()
@_user_errors
def quantize(recipe: RecipeOpt = None, set_: SetOpt = None, model: ModelOpt = None,
             calibration: Annotated[Optional[str], typer.Option(help="Calibration artifact (path or id): gives NVFP4 with input scales; without it, W4A16_NVFP4.")] = None,
             output: Annotated[Optional[Path], typer.Option(help="Also copy the checkpoint to this new directory.")] = None,
             artifacts: ArtifactsOpt = None, force: ForceOpt = False, verify: VerifyOpt = False) -> None:
    """Quantize a model to an NVFP4 checkpoint (modelopt unified HF layout)."""
    _run_stage("quantize", _recipe(recipe, set_, model), _store(artifacts, verify), {"calibration": calibration},
               output=output, force=force)


@app.command("build-engine")
@_user_errors
def build_engine(recipe: RecipeOpt = None, set_: SetOpt = None, model: ModelOpt = None,
                 quantized: Annotated[Optional[str], typer.Option(help="Quantize artifact (path or id) to build an nvfp4 engine from; without it, the recipe's (found in the store; made with --build-missing).")] = None,
                 artifacts: ArtifactsOpt = None, force: ForceOpt = False, verify: VerifyOpt = False,
                 build_missing: BuildMissingOpt = False) -> None:
    """Store the model as the kernels run it, with KV-cache limits and (on CUDA) tuned kernels."""
    _run_stage("build-engine", _recipe(recipe, set_, model), _store(artifacts, verify), {"quantized": quantized},
               force=force, build_missing=build_missing)


@app.command()
@_user_errors
def train(recipe: RecipeOpt = None, set_: SetOpt = None, model: ModelOpt = None,
          engine: Annotated[Optional[str], typer.Option(help="Engine artifact (path or id) to train over; without it, the recipe's (found in the store; built with --build-missing).")] = None,
          artifacts: ArtifactsOpt = None, force: ForceOpt = False, verify: VerifyOpt = False,
          build_missing: BuildMissingOpt = False,
          nproc: Annotated[int, typer.Option("--nproc", min=1, help="Data-parallel processes (one per GPU), started through torchrun.")] = 1) -> None:
    """GRPO/DAPO of a LoRA adapter over the engine's frozen base, with AQN; resumes an interrupted run."""
    if nproc > 1:
        from qerl_pipe.launch import relaunch

        raise typer.Exit(relaunch(nproc, _train_args(recipe, set_, model, engine, artifacts, force, verify,
                                                     build_missing)))
    from qerl_pipe.rl.distributed import current_dist, group_lifetime
    from qerl_pipe.stages.train import run_train

    store = _store(artifacts, verify)
    parsed = _recipe(recipe, set_, model)
    parent = store.resolve(engine) if engine else None
    with group_lifetime():
        artifact = run_train(parsed, store, engine=parent, force=force, build_missing=build_missing)
        if current_dist().is_main:  # one artifact line on stdout, however many ranks
            print(artifact.path)


def _train_args(recipe: Path | None, set_: list[str] | None, model: str | None, engine: str | None,
                artifacts: Path | None, force: bool, verify: bool = False, build_missing: bool = False) -> list[str]:
    """`train`'s arguments without --nproc: what each torchrun worker is started with."""
    args = ["train"]
    for flag, value in (("--recipe", recipe), ("--model", model), ("--engine", engine), ("--artifacts", artifacts)):
        if value is not None:
            args += [flag, str(value)]
    for item in set_ or []:
        args += ["--set", item]
    flags = (("--force", force), ("--verify", verify), ("--build-missing", build_missing))
    return args + [flag for flag, on in flags if on]


@app.command()
@_user_errors
def export(recipe: RecipeOpt = None, set_: SetOpt = None, model: ModelOpt = None,
           run: Annotated[Optional[str], typer.Option("--run", help="Run artifact (path or id) to export; without it, the recipe's (found in the store; trained with --build-missing).")] = None,
           format_: Annotated[Optional[str], typer.Option("--format", help="peft, merged-bf16 or merged-nvfp4 (sets export.format; default peft).")] = None,
           artifacts: ArtifactsOpt = None, force: ForceOpt = False, verify: VerifyOpt = False,
           build_missing: BuildMissingOpt = False) -> None:
    """Export a run's LoRA adapter: a PEFT adapter, or merged into the base as a bf16 or NVFP4 model."""
    overrides = list(set_ or []) + ([f"export.format={json.dumps(format_)}"] if format_ is not None else [])
    _run_stage("export", _recipe(recipe, overrides, model), _store(artifacts, verify), {"run": run}, force=force,
               build_missing=build_missing)


@app.command("eval")
@_user_errors
def eval_(recipe: RecipeOpt = None, set_: SetOpt = None,
          model: Annotated[Optional[str], typer.Option("--model", "-m", help="Engine artifact (path or id); or a quantize artifact or model source, whose engine the recipe describes (found in the store; built with --build-missing). Default: the recipe's engine.")] = None,
          adapter: Annotated[Optional[str], typer.Option(help="LoRA adapter to apply: a train run (path or id), or a directory with adapter_model.safetensors + adapter_config.json. Default: none (the base model).")] = None,
          data: Annotated[Optional[str], typer.Option(help="Problems (sets eval.data): gsm8k:test, math500:test, arithmetic[:N], addition:test or FILE.jsonl.")] = None,
          k: Annotated[Optional[int], typer.Option("--k", help="Samples per problem (sets eval.k); pass@1 is averaged over them.")] = None,
          greedy: Annotated[bool, typer.Option("--greedy", help="Greedy decoding, one sample (sets eval.greedy).")] = False,
          limit: Annotated[Optional[int], typer.Option(help="Evaluate the first N problems (sets eval.limit).")] = None,
          artifacts: ArtifactsOpt = None, force: ForceOpt = False, verify: VerifyOpt = False,
          build_missing: BuildMissingOpt = False) -> None:
    """Accuracy (average pass@1 over k samples, or greedy) of a model with or without a LoRA adapter."""
    from qerl_pipe.stages.evaluate import run_eval

    overrides = list(set_ or [])
    if greedy and k is None:
        k = 1  # greedy gives one response per problem, whatever k the recipe samples
    for key, value in (("data", data), ("k", k), ("limit", limit), ("greedy", True if greedy else None)):
        if value is not None:
            overrides.append(f"eval.{key}={json.dumps(value)}")
    artifact = run_eval(_recipe(recipe, overrides), _store(artifacts, verify), model=model, adapter=adapter,
                        force=force, build_missing=build_missing)
    print(artifact.path)


@app.command()
@_user_errors
def run(recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")], set_: SetOpt = None,
        artifacts: ArtifactsOpt = None, force: ForceOpt = False, verify: VerifyOpt = False) -> None:
    """Run the recipe's stages in order, making what they need and reusing up-to-date artifacts."""
    from qerl_pipe.stages.pipeline import run_pipeline

    results = run_pipeline(_recipe(recipe, set_), _store(artifacts, verify), force=force)
    for stage, artifact in results.items():
        typer.echo(f"{stage}: {artifact.path}", err=True)
    print(list(results.values())[-1].path)


@app.command("ls")
@_user_errors
def list_artifacts(artifacts: ArtifactsOpt = None) -> None:
    """List the artifacts in the store, oldest first; then damaged ones and unfinished temporary directories."""
    store = _store(artifacts)
    found, unfinished = store.list(), store.unfinished()
    if not found and not unfinished:
        typer.echo(f"no artifacts in {store.root}", err=True)
        return
    for a in found:
        print(f"{a.path.name:32} {a.kind:18} {a.manifest.get('created', ''):26} parents={','.join(a.manifest['parents']) or '-'}")
    for path, state in unfinished:
        print(f"{path.name:32} {state}")


@app.command()
@_user_errors
def show(ref: Annotated[str, typer.Argument(help="Artifact path, directory name or id prefix.")],
         artifacts: ArtifactsOpt = None) -> None:
    """Print an artifact's manifest."""
    artifact = _store(artifacts).resolve(ref, verify=False)
    print(json.dumps(artifact.manifest, indent=2))


@app.command()
@_user_errors
def verify(ref: Annotated[str, typer.Argument(help="Artifact path, directory name or id prefix.")],
           artifacts: ArtifactsOpt = None) -> None:
    """Re-hash every file of an artifact against its manifest."""
    from qerl_pipe.artifacts import find_problems
    from qerl_pipe.artifacts.manifest import repair_advice, stage_of

    artifact = _store(artifacts).resolve(ref, verify=False)
    problems = find_problems(artifact, full=True)
    for problem in problems:
        typer.echo(f"{artifact.path}: {problem}", err=True)
    if problems:
        advice = repair_advice(artifact.path, stage_of(artifact.path, artifact.manifest), problems)
        raise QerlError(f"{artifact.path} is damaged: {len(problems)} problem(s); {advice}")
    typer.echo(f"ok: {len(artifact.manifest['files'])} files match the manifest", err=True)
    print(artifact.path)


@bench_app.command("kernels")
@_user_errors
def bench_kernels(out: Annotated[Optional[Path], typer.Option(help="Write the JSON here as well as to stdout.")] = None,
                  shapes: Annotated[str, typer.Option(help="Comma-separated model shapes.")] = "qwen2.5-7b,qwen2.5-32b") -> None:
    """NVFP4 / NF4 W4A16 kernels vs cuBLAS bf16 and dequantize-then-matmul (needs a CUDA GPU)."""
    from qerl_pipe.bench.kernels import run_kernel_bench

    _emit(run_kernel_bench(shapes=_csv(shapes, str)), out)


@bench_app.command("kernels-cuda")
@_user_errors
def bench_kernels_cuda(out: Annotated[Optional[Path], typer.Option(help="Write the JSON here as well as to stdout.")] = None,
                       shapes: Annotated[str, typer.Option(help="Comma-separated model shapes.")] = "qwen2.5-7b,qwen2.5-32b") -> None:
    """The CUDA W4A16 kernels (decode GEMM, dequantize + cuBLAS) vs cuBLAS bf16 (needs a Hopper GPU and nvcc)."""
    from qerl_pipe.bench.kernels_cuda import run
    from qerl_pipe.kernels import cuda_ext

    why = cuda_ext.why_unavailable("cuda")
    if why is not None:
        raise QerlError(f"the CUDA W4A16 kernels do not run here ({why}); they need a Hopper GPU and nvcc. "
                        "`qerl-pipe bench kernels` measures the Triton kernels")
    _emit(run(_csv(shapes, str), None), out)


@bench_app.command("rollout")
@_user_errors
def bench_rollout(out: Annotated[Optional[Path], typer.Option(help="Write the JSON here as well as to stdout.")] = None,
                  shapes: Annotated[str, typer.Option(help="Comma-separated model shapes.")] = "qwen2.5-7b,qwen2.5-32b",
                  batches: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,8,64,256",
                  prompt_len: Annotated[int, typer.Option(help="Prompt tokens.")] = 256,
                  new_tokens: Annotated[int, typer.Option(help="Generated tokens per sequence (no early stop).")] = 512,
                  hf_new_tokens: Annotated[int, typer.Option(help="Tokens per sequence for HF generate (slow).")] = 64,
                  lora_rank: Annotated[int, typer.Option(help="LoRA rank attached to our model.")] = 32) -> None:
    """Rollout speed: HF generate vs our engine in bf16 and NVFP4 (random weights, needs a CUDA GPU)."""
    from qerl_pipe.bench.rollout import run_rollout_bench

    _emit(run_rollout_bench(_csv(shapes, str), _csv(batches, int), prompt_len, new_tokens, hf_new_tokens,
                            lora_rank=lora_rank), out)


@bench_app.command("train-step")
@_user_errors
def bench_train_step(shape: Annotated[Optional[list[str]], typer.Option("--shape", help="Model shape (repeatable or comma-separated): qwen2.5-7b, -14b, -32b, -72b.")] = None,
                     quant: Annotated[Optional[list[str]], typer.Option("--quant", help="Base format (repeatable or comma-separated): bf16, nf4, nvfp4.")] = None,
                     micro_batch: Annotated[Optional[int], typer.Option(help="Sequences per forward/backward.", show_default="8 for 7B/14B, 4 for 32B/72B")] = None,
                     kv_slots: Annotated[Optional[int], typer.Option(help="Engine slots (KV cache rows).", show_default="all 64 sequences at once")] = None,
                     response_len: Annotated[int, typer.Option(help="Sampled tokens per response (no early stop).")] = 1024,
                     memory_limit_gib: Annotated[Optional[float], typer.Option(help="Treat the GPU as having this much free memory.", show_default="what is free")] = None,
                     adapter: Annotated[str, typer.Option(help="lora, or full: every weight trains (with --quant bf16 only).")] = "lora",
                     memory_budget_gb: Annotated[Optional[float], typer.Option(help="Plan each --shape step to this budget (GB, 10^9 bytes) and cap the process to it.", show_default="no budget")] = None,
                     recipe: Annotated[Optional[list[Path]], typer.Option("--recipe", help="Run each recipe's step (recipes/ladder/*.yaml) under its train.memory_budget_gb (repeatable).")] = None,
                     unconstrained: Annotated[bool, typer.Option(help="Run the recipes without their budgets (the time with the whole GPU).")] = False,
                     append: Annotated[bool, typer.Option(help="Keep the rows already in --out.")] = False,
                     out: Annotated[Optional[Path], typer.Option(help="Rewritten after each configuration, and at the end.")] = None) -> None:
    """One full RL step (8 prompts x 8 samples, 256 + 1024 tokens, LoRA r32) per shape and base format, or per recipe; needs a CUDA GPU."""
    from qerl_pipe.bench.train_step import GIB, StepSettings, run_train_step_bench, split_values

    settings = StepSettings(micro_batch=micro_batch, kv_slots=kv_slots, response_len=response_len, adapter=adapter)
    limit = int(memory_limit_gib * GIB) if memory_limit_gib else None
    _emit(run_train_step_bench(split_values(shape or ([] if recipe else ["qwen2.5-7b"])),
                               split_values(quant or ["bf16", "nvfp4"]), settings, memory_limit_bytes=limit, out=out,
                               memory_budget_gb=memory_budget_gb, recipes=recipe or (), unconstrained=unconstrained,
                               append=append), out)


@bench_app.command("train-scaling")
@_user_errors
def bench_train_scaling(out: Annotated[Optional[Path], typer.Option(help="Write the JSON here as well as to stdout.")] = None,
                        shape: Annotated[str, typer.Option(help="Model shape (random weights): qwen2.5-7b, ... or tiny.")] = "qwen2.5-7b",
                        nproc: Annotated[str, typer.Option(help="Comma-separated process counts (one GPU each).")] = "1,2",
                        device: Annotated[str, typer.Option(help="cuda, or cpu (gloo; a smoke test).")] = "cuda",
                        prompts_per_step: Annotated[int, typer.Option(help="Global batch B (prompts per step).")] = 32,
                        group_size: Annotated[int, typer.Option(help="Samples per prompt G.")] = 8,
                        new_tokens: Annotated[int, typer.Option(help="Generated tokens per sample (no early stop).")] = 256,
                        steps: Annotated[int, typer.Option(help="Timed steps after one warm-up step.")] = 3) -> None:
    """RL steps/s on 1 vs N GPUs at the same global batch, through torchrun (target: 2 GPUs >= 1.8x)."""
    from qerl_pipe.bench.train_scaling import run_train_scaling_bench

    _emit(run_train_scaling_bench(shape, _csv(nproc, int), device, prompts_per_step, group_size,
                                  new_tokens=new_tokens, steps=steps), out)


@bench_app.command("quantize-methods")
@_user_errors
def bench_quantize_methods(model: Annotated[str, typer.Option(help="Model source.")] = "smollm2-135m-instruct",
                           methods: Annotated[str, typer.Option(help="Comma-separated quantize.method values.")] = "rtn,mse,act-mse",
                           out: Annotated[Optional[Path], typer.Option(help="Write the JSON here as well as to stdout.")] = None) -> None:
    """Perplexity over bf16 for each NVFP4 block-scale method (rtn, mse, act-mse); runs on CPU."""
    from qerl_pipe.bench.quantize import run_quantize_methods_bench

    _emit(run_quantize_methods_bench(model, _csv(methods, str)), out)


def _csv(text: str, kind: type) -> list:
    return [kind(s.strip()) for s in text.split(",") if s.strip()]


@bench_app.command("quantize")
@_user_errors
def bench_quantize(model: Annotated[str, typer.Option(help="Model source for the quality figures.")] = "smollm2-135m-instruct",
                   shard_mb: Annotated[int, typer.Option(help="Shard size of the synthetic multi-shard model.")] = 64,
                   out: Annotated[Optional[Path], typer.Option(help="Write the JSON here as well as to stdout.")] = None) -> None:
    """Quantize-stage time, peak host memory (streaming) and quality; runs on CPU."""
    from qerl_pipe.bench.quantize import run_quantize_bench

    _emit(run_quantize_bench(model, shard_mb), out)


def _emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result, indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
