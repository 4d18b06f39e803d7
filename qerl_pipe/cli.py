"""The `qerl-pipe` command line: thin over `stages/`.

Stage commands print the artifact directory as the last line of stdout (logs and progress go to
stderr), so a Makefile or a shell can chain them. A user-facing error prints one line and exits 1.
"""

from __future__ import annotations

import functools
import shlex
import sys
from pathlib import Path
from typing import Annotated, Callable, Optional, TypeVar

import typer

from qerl_pipe.bench.cli import bench_app
from qerl_pipe.errors import QerlError
from qerl_pipe.strict_json import dumps

app = typer.Typer(
    name="qerl-pipe", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    help="NVFP4 quantization + LoRA RL (GRPO/DAPO with adaptive quantization noise) as a pipeline of versioned artifacts.",
)

F = TypeVar("F", bound=Callable)

RecipeOpt = Annotated[Optional[Path], typer.Option("--recipe", "-r", help="Recipe YAML file (defaults apply without one); `qerl-pipe keys` lists its keys.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override a recipe value: section.key=value (repeatable); `qerl-pipe keys` (or `qerl-pipe keys train`) lists every key, its type, default and meaning.")]
# Defaults that are not the value itself go in show_default: rich reads "[default: ...]" written in
# a help text as a markup tag and drops it (--help said "Artifact store directory .").
ArtifactsOpt = Annotated[Optional[Path], typer.Option("--artifacts", envvar="QERL_ARTIFACTS", help="Artifact store directory.", show_default="./artifacts")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Redo the stage even if an up-to-date artifact exists.")]
VerifyOpt = Annotated[bool, typer.Option("--verify", help="Re-hash every file of each artifact used (by default only files whose size or mtime changed since it was made).")]
BuildMissingOpt = Annotated[bool, typer.Option("--build-missing", help="Make the inputs the recipe describes that are not in the store (calibrate, quantize, ... as `run` would); without it a missing input is an error naming the command that makes it.")]
ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Model source (sets model.source): HF directory, hub id, .gguf file or alias.")]


def _flags_without_a_type() -> None:
    """typer 0.29 prints a flag's type in --help (`--force <bool>`), though a flag takes no value."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "flags_hidden", False):
        return

    def display_type_rich(self: TyperOption, ctx) -> str | None:
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.flags_hidden = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_without_a_type()


# The command line as typed (set by `main`), for the line that says how to resume a stopped command.
_COMMAND: list[str] | None = None


def _stopped_line(exc: KeyboardInterrupt) -> str:
    """One line for a stopped command: what was saved, and the same command to resume it."""
    from qerl_pipe.stops import Stopped

    name, detail = (exc.name, exc.detail) if isinstance(exc, Stopped) else ("SIGINT", "")
    again = f": {shlex.join(['qerl-pipe', *_COMMAND])}" if _COMMAND else ""
    if detail:
        return f"stopped by {name} {detail}; the same command resumes from there{again}"
    return (f"stopped by {name}: no partial artifact was kept; the same command again reuses the finished stages and "
            f"resumes a train from its last checkpoint{again}")


def _user_errors(fn: F) -> F:
    """Report QerlError (and OSError: disk full, permissions) as one line on stderr and exit 1, instead of a
    traceback; a SIGINT or SIGTERM as one line saying how to resume (`stops`), exit 128 + the signal."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from qerl_pipe.stops import stop_on_signals

        try:
            with stop_on_signals():
                return fn(*args, **kwargs)
        except QerlError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        except OSError as exc:  # a full disk, a read-only or missing path: the machine, not a bug
            from qerl_pipe.userfiles import describe_os_error

            typer.echo(f"error: {describe_os_error(exc)}", err=True)
            raise typer.Exit(1) from None
        except KeyboardInterrupt as exc:  # Stopped too (SIGTERM)
            typer.echo(_stopped_line(exc), err=True)
            raise typer.Exit(getattr(exc, "exit_code", 130)) from None

    return wrapper  # type: ignore[return-value]


def _recipe(recipe: Path | None, overrides: list[str] | None, model: str | None = None):
    from qerl_pipe.recipe import load_recipe

    overrides = list(overrides or [])
    if model is not None:
        overrides.append(f"model.source={dumps(model)}")
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
    overrides = list(set_ or []) + ([f"export.format={dumps(format_)}"] if format_ is not None else [])
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
            overrides.append(f"eval.{key}={dumps(value)}")
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


@app.command()
@_user_errors
def keys(section: Annotated[Optional[str], typer.Argument(help="A section (train, train.lora, engine, ...) or a key; default: every key.")] = None) -> None:
    """List the recipe keys (a recipe file's, and --set section.key=value's): type, default and meaning."""
    from qerl_pipe.recipe_keys import format_keys, recipe_keys

    print(format_keys(recipe_keys(section)))


@app.command("ls")
@_user_errors
def list_artifacts(artifacts: ArtifactsOpt = None) -> None:
    """List the artifacts in the store, oldest first and each under its parents; then damaged ones and unfinished temporary directories."""
    store = _store(artifacts)
    found, unfinished = store.survey()
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
    print(dumps(artifact.manifest, indent=2))


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


# The benchmarks (qerl_pipe/bench/cli.py), under this CLI's error policy.
for _command in bench_app.registered_commands:
    _command.callback = _user_errors(_command.callback)
app.add_typer(bench_app, name="bench")


def main() -> None:
    global _COMMAND
    _COMMAND = sys.argv[1:]
    app()


if __name__ == "__main__":
    sys.exit(main())
