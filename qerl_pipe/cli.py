"""The `qerl-pipe` command line: thin over the pipeline (`pipeline.py`).

Stage commands are generated from `dag.STAGES` (plus `EXTRAS`); each prints its artifact directory as
the last line of stdout (logs go to stderr), and a user-facing error prints one line and exits 1.
See docs/pipeline.md, section "Chaining the stages"."""

from __future__ import annotations

import functools
import inspect
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional, TypeVar

import typer
from typer.core import TyperGroup

from qerl_pipe.dag import EVAL, EXPORT, QUANTIZE, STAGES, TRAIN, Stage
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
RefArg = Annotated[str, typer.Argument(help="Artifact path, directory name or id prefix.")]
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
    command = _COMMAND[0] if _COMMAND else "run"
    then = {"run": "reuses the finished stages and resumes a train from its last checkpoint",
            "train": "resumes the run from its last checkpoint, if one was written"}.get(command, "makes it anew")
    return f"stopped by {name}: no partial artifact was kept; the same command again {then}{again}"


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


def _recipe(recipe: Path | None, overrides: list[str] | None):
    from qerl_pipe.recipe import load_recipe

    return load_recipe(recipe, list(overrides or []))


def _store(artifacts: Path | None, verify: bool = False):
    from qerl_pipe.artifacts import ArtifactStore

    return ArtifactStore(artifacts, full_verify=verify)


# --- the stage commands, generated from the DAG ---------------------------------------------------


@dataclass(frozen=True)
class Extra:
    """A stage command's option beyond the shared ones and its declared inputs: a recipe override
    (`sets`: the key it sets when given) or, without one, a keyword of the stage's entry point."""

    name: str
    annotation: Any
    default: Any = None
    sets: str | None = None


# Each stage command's own options; everything else about the commands comes from dag.STAGES.
EXTRAS: dict[Stage, tuple[Extra, ...]] = {
    QUANTIZE: (Extra("output", Annotated[Optional[Path], typer.Option(
        help="Also copy the checkpoint to this new directory.")]),),
    TRAIN: (Extra("nproc", Annotated[int, typer.Option(
        "--nproc", min=1, help="Data-parallel processes (one per GPU), started through torchrun.")], 1),),
    EXPORT: (Extra("format_", Annotated[Optional[str], typer.Option(
        "--format", help="peft, merged-bf16 or merged-nvfp4 (sets export.format; default peft).")],
        sets="export.format"),),
    EVAL: (
        Extra("data", Annotated[Optional[str], typer.Option(
            help="Problems (sets eval.data): gsm8k:test, math500:test, arithmetic[:N], addition:test or FILE.jsonl.")],
            sets="eval.data"),
        Extra("k", Annotated[Optional[int], typer.Option(
            "--k", help="Samples per problem (sets eval.k); pass@1 is averaged over them.")], sets="eval.k"),
        Extra("greedy", Annotated[bool, typer.Option(
            "--greedy", help="Greedy decoding, one sample (sets eval.greedy).")], False, sets="eval.greedy"),
        Extra("limit", Annotated[Optional[int], typer.Option(
            help="Evaluate the first N problems (sets eval.limit).")], sets="eval.limit"),
    ),
}
SHARED_FIRST = (Extra("recipe", RecipeOpt), Extra("set_", SetOpt))
MODEL_SOURCE = Extra("model", ModelOpt, sets="model.source")
SHARED_LAST = (Extra("artifacts", ArtifactsOpt), Extra("force", ForceOpt, False), Extra("verify", VerifyOpt, False))
NPROC = "nproc"


def _options(stage: Stage) -> tuple[Extra, ...]:
    """The command's options, in --help order: recipe and overrides, the model source (unless an
    input takes --model), the declared inputs, the stage's own, the store and the mode."""
    inputs = tuple(Extra(inp.keyword, Annotated[Optional[str], typer.Option(
        inp.option, *(("-m",) if inp.option == "--model" else ()), help=inp.help)]) for inp in stage.inputs)
    model = () if any(inp.option == "--model" for inp in stage.inputs) else (MODEL_SOURCE,)
    # an input it may find, or build when asked
    build = (Extra("build_missing", BuildMissingOpt, False),) if any(not i.optional for i in stage.inputs) else ()
    return (*SHARED_FIRST, *model, *inputs, *EXTRAS.get(stage, ()), *SHARED_LAST, *build)


def _flag(extra: Extra) -> str:
    """The option's long flag: the one its typer.Option names, else the one typer derives from the name."""
    info = extra.annotation.__metadata__[0]
    named = [d for d in (info.default, *(info.param_decls or ())) if isinstance(d, str) and d.startswith("--")]
    return named[0] if named else "--" + extra.name.rstrip("_").replace("_", "-")


def _argv(stage: Stage, options: tuple[Extra, ...], values: dict[str, Any]) -> list[str]:
    """The command line that gives `values`, without --nproc: what each torchrun worker runs."""
    args = [stage.name]
    for extra in options:
        value = values[extra.name]
        if extra.name == NPROC or value is None or value is False:
            continue
        items = value if isinstance(value, list) else [value]
        args += [_flag(extra)] if value is True else [w for item in items for w in (_flag(extra), str(item))]
    return args


def _run_command(stage: Stage, options: tuple[Extra, ...], values: dict[str, Any]) -> None:
    from qerl_pipe.pipeline import run_stage
    from qerl_pipe.rl.loop.distributed import current_dist, group_lifetime

    if values.get(NPROC, 1) > 1:
        from qerl_pipe.launch import relaunch

        raise typer.Exit(relaunch(values[NPROC], _argv(stage, options, values)))
    if values.get("greedy") and values.get("k") is None:  # eval's --greedy
        values["k"] = 1  # greedy gives one response per problem, whatever k the recipe samples
    overrides = list(values["set_"] or [])
    # An option left out (None, a flag's False) sets nothing; `is not False`: `--limit 0` (0 == False) is a value.
    overrides += [f"{e.sets}={dumps(values[e.name])}" for e in options
                  if e.sets is not None and values[e.name] is not None and values[e.name] is not False]
    recipe = _recipe(values["recipe"], overrides)
    given = {inp.keyword: values[inp.keyword] for inp in stage.inputs}
    entry_options = {e.name: values[e.name] for e in EXTRAS.get(stage, ()) if e.sets is None and e.name != NPROC}
    with group_lifetime():
        artifact = run_stage(stage, recipe, _store(values["artifacts"], values["verify"]), force=values["force"],
                             build_missing=values.get("build_missing", False), **given, **entry_options)
        if current_dist().is_main:  # one artifact line on stdout, however many ranks
            print(artifact.path)


def _stage_command(stage: Stage) -> Callable[..., None]:
    """`qerl-pipe <stage>`: a function whose signature typer reads as the command's options."""
    options = _options(stage)

    def command(**values: Any) -> None:
        _run_command(stage, options, values)

    params = [inspect.Parameter(e.name, inspect.Parameter.KEYWORD_ONLY, default=e.default, annotation=e.annotation)
              for e in options]
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {e.name: e.annotation for e in options}
    command.__name__ = command.__qualname__ = stage.name.replace("-", "_")
    command.__doc__ = stage.help
    return command


for _stage in STAGES:
    app.command(_stage.name)(_user_errors(_stage_command(_stage)))


@app.command()
@_user_errors
def run(recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")], set_: SetOpt = None,
        artifacts: ArtifactsOpt = None, force: ForceOpt = False, verify: VerifyOpt = False) -> None:
    """Run the recipe's stages in order, making what they need and reusing up-to-date artifacts."""
    from qerl_pipe.pipeline import run_recipe

    results = run_recipe(_recipe(recipe, set_), _store(artifacts, verify), force=force)
    # Each artifact's path on stdout in stage order (the last line is the last stage's, as a stage
    # command's is), each labelled with its stage on stderr.
    for stage, artifact in results.items():
        typer.echo(f"{stage}: {artifact.path}", err=True)
        print(artifact.path)


@app.command()
@_user_errors
def keys(section: Annotated[Optional[str], typer.Argument(help="A section (train, train.lora, engine, ...) or a key; default: every key.")] = None) -> None:
    """List the recipe keys (a recipe file's, and --set section.key=value's): type, default and meaning."""
    from qerl_pipe.recipe_keys import format_keys, recipe_keys

    print(format_keys(recipe_keys(section)))


@app.command()
@_user_errors
def compare(arms: Annotated[list[str], typer.Argument(help="Arms: train runs (artifact or .runs/ directory) or eval artifacts of their adapters, each PATH or NAME=PATH.")],
            out_dir: Annotated[Optional[Path], typer.Option(help="Also write compare.json and compare.png (reward, accuracy, entropy, response length against steps) here.")] = None,
            reference: Annotated[Optional[list[str]], typer.Option(help="A reference figure per arm, ARM=FIGURE (say the paper's: qerl='GSM8K 90.8'); repeatable.")] = None,
            title: Annotated[str, typer.Option(help="The figure's title.")] = "arms") -> None:
    """Put training arms side by side: a Markdown table on stdout (reward, greedy accuracy and pass@1, entropy, steps, GPU hours, peak memory) and, with --out-dir, its JSON and one figure."""
    from qerl_pipe import compare as cmp

    references = cmp.parse_references(reference or [])
    read = [cmp.read_arm(path, name) for name, path in map(cmp.parse_arm, arms)]
    names = [arm.name for arm in read]
    if len(set(names)) != len(names):
        raise QerlError(f"two arms share a name ({', '.join(names)}); name them: NAME=PATH")
    unknown = sorted(set(references) - set(names))
    if unknown:
        raise QerlError(f"--reference names {unknown}, which are not arms ({', '.join(names)})")
    rows = [cmp.summarize(arm, references.get(arm.name)) for arm in read]
    print(cmp.table(rows))
    if out_dir is not None:
        from qerl_pipe.strict_json import write_json

        out_dir.mkdir(parents=True, exist_ok=True)
        write_json(out_dir / "compare.json", {"arms": rows}, indent=1)
        if not cmp.plot(read, out_dir / "compare.png", title):
            typer.echo("compare: matplotlib is not installed, so no figure (pip install matplotlib)", err=True)
        typer.echo(f"compare: {out_dir / 'compare.json'}", err=True)


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
def show(ref: RefArg, artifacts: ArtifactsOpt = None) -> None:
    """Print an artifact's manifest."""
    artifact = _store(artifacts).resolve(ref, verify=False)
    print(dumps(artifact.manifest, indent=2))


@app.command()
@_user_errors
def verify(ref: RefArg, artifacts: ArtifactsOpt = None) -> None:
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


class _Lab(TyperGroup):
    """`qerl-pipe bench`: the benchmarks of qerl_lab/cli.py under this CLI's error policy, imported when a bench
    command or their list is first asked for, never at start-up (the product imports nothing of the lab)."""

    def _load(self) -> None:
        if self.commands:
            return
        try:
            from qerl_lab.cli import bench_app  # the one place the product reaches the lab (tests/pipeline/test_layers.py)
        except ModuleNotFoundError as exc:
            if exc.name != "qerl_lab":
                raise
            # An install made before the lab became qerl_lab (its editable finder maps only the packages it had).
            typer.echo("error: `qerl-pipe bench` needs the package qerl_lab (qerl_lab/ beside qerl_pipe/), which this "
                       "install does not have; install the repository again (pip install -e . or pip install .)", err=True)
            raise typer.Exit(1) from None

        for name, command in typer.main.get_command(bench_app).commands.items():
            command.callback = _user_errors(command.callback)
            self.commands[name] = command

    def list_commands(self, ctx):
        self._load()
        return super().list_commands(ctx)

    def get_command(self, ctx, cmd_name):
        self._load()
        return super().get_command(ctx, cmd_name)


app.add_typer(typer.Typer(cls=_Lab, no_args_is_help=True, help="Benchmarks; results are JSON with a targets block."),
              name="bench")


def main() -> None:
    global _COMMAND
    _COMMAND = sys.argv[1:]
    app()


if __name__ == "__main__":
    sys.exit(main())
