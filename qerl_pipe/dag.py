"""The pipeline, declared once: every stage's name, version, artifact kind, inputs and entry point,
and the one runner that finds, reuses or builds a stage's artifact.

Everything that chains stages reads this module: `qerl-pipe run` (`run_pipeline`), each stage
command's default inputs (`input_artifact`), the Makefile and Airflow command strings
(`orchestration`), and the error a stage command gives when its input is missing. A stage module
imports its own `Stage` from here and never another stage module.

Nothing here imports torch, so `orchestration` (and an Airflow scheduler) can read the DAG cheaply;
a stage's entry point is named as `module:function` and imported only when the stage runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qerl_pipe.errors import ArtifactError, QerlError
from qerl_pipe.log import log

if TYPE_CHECKING:  # the recipe module needs pydantic; the DAG is read where it may be missing
    from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact
    from qerl_pipe.recipe import Recipe


@dataclass(frozen=True)
class Input:
    """One artifact a stage reads: the CLI option and keyword that take it, and the stage that makes it.

    `used` says whether `qerl-pipe run` hands it over for a recipe (None: always): an optional
    input (the calibration of quantize, the adapter of eval) is used when its stage is in the
    recipe; the quantize checkpoint is read only by an nvfp4 engine. `made_by`, when given, names
    the stage whose artifact `run` hands over for a recipe instead of `stage` (which is what a
    chain of stage commands passes)."""

    option: str
    stage: str
    used: Callable[["Recipe"], bool] | None = None
    made_by: Callable[["Recipe"], str] | None = None

    @property
    def keyword(self) -> str:
        """The entry point's keyword argument for this input (`--run` -> `run`)."""
        return self.option.removeprefix("--").replace("-", "_")

    def used_by(self, recipe: "Recipe") -> bool:
        return self.used is None or self.used(recipe)

    def stage_for(self, recipe: "Recipe") -> str:
        return self.made_by(recipe) if self.made_by is not None else self.stage


@dataclass(frozen=True)
class Stage:
    """A stage: its command and artifact name (`<name>-<id>`), version (part of every id: bump it
    when the output for the same inputs changes), kind, inputs and entry point (`module:function`,
    called as `fn(recipe, store, *, <input keywords>, force, build_missing, find_only)`). `check`
    (`module:function`, called as `fn(recipe, store)`) refuses, from the recipe and the model's
    config.json alone, what would fail hours into a `run` (data files, reward names, sequences
    longer than the model's positions, a train step no plan fits into train.memory_budget_gb);
    `run` and `--build-missing` call it for every stage they will build, before the first one."""

    name: str
    version: int
    kind: str
    what: str  # the artifact in words, for messages
    inputs: tuple[Input, ...]
    entry: str
    check: str | None = None

    def entry_point(self) -> Callable[..., "Artifact"]:
        return _named(self.entry)

    def check_recipe(self, recipe: "Recipe", store: "ArtifactStore") -> None:
        if self.check is not None:
            _named(self.check)(recipe, store)


def _named(entry: str) -> Callable[..., Any]:
    """The function `module:function` names, imported now (the DAG itself imports no stage)."""
    module, _, function = entry.partition(":")
    return getattr(importlib.import_module(module), function)


def _in_recipe(stage: str) -> Callable[["Recipe"], bool]:
    return lambda recipe: stage in recipe.stages


def full_run_eval(recipe: "Recipe") -> bool:
    """A full fine-tuning run has no adapter: `run` evaluates its merged-bf16 export (the trained
    model) with an engine built from it, instead of an adapter over the recipe's engine."""
    return recipe.train.adapter == "full" and "train" in recipe.stages


CALIBRATE = Stage("calibrate", 2, "calibration", "calibration", (), "qerl_pipe.stages.calibrate:run_calibrate",
                  check="qerl_pipe.stages.calibrate:check_calibrate_recipe")
QUANTIZE = Stage("quantize", 1, "nvfp4-checkpoint", "quantize checkpoint",
                 (Input("--calibration", "calibrate", used=_in_recipe("calibrate")),),
                 "qerl_pipe.stages.quantize:run_quantize", check="qerl_pipe.stages.quantize:check_quantize_recipe")
BUILD_ENGINE = Stage("build-engine", 1, "engine", "engine",
                     # an nf4 or bf16 engine reads the original model, not a quantize checkpoint
                     (Input("--quantized", "quantize", used=lambda r: r.engine.base_format == "nvfp4"),),
                     "qerl_pipe.stages.build_engine:run_build_engine",
                     check="qerl_pipe.stages.build_engine:check_engine_recipe")
TRAIN = Stage("train", 2, "run", "run", (Input("--engine", "build-engine"),), "qerl_pipe.stages.train:run_train",
              check="qerl_pipe.stages.train:check_train_recipe")
# export's kind is export-<format> (export-peft, export-merged-bf16, export-merged-nvfp4)
EXPORT = Stage("export", 1, "export-peft", "export", (Input("--run", "train"),), "qerl_pipe.stages.export:run_export")
# eval's --model is the engine (not a model source), or after a full run the trained model's export;
# its adapter is the train run when there is one
EVAL = Stage("eval", 2, "eval", "evaluation report",
             (Input("--model", "build-engine", made_by=lambda r: "export" if full_run_eval(r) else "build-engine"),
              Input("--adapter", "train", used=lambda r: "train" in r.stages and not full_run_eval(r))),
             "qerl_pipe.stages.evaluate:run_eval", check="qerl_pipe.stages.evaluate:check_eval_recipe")

STAGES: tuple[Stage, ...] = (CALIBRATE, QUANTIZE, BUILD_ENGINE, TRAIN, EXPORT, EVAL)
BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}
STAGE_ORDER: tuple[str, ...] = tuple(s.name for s in STAGES)


def stage(name: str) -> Stage:
    if name not in BY_NAME:
        raise ValueError(f"unknown stage {name!r}; known stages, in order: {list(STAGE_ORDER)}")
    return BY_NAME[name]


class MissingArtifact(QerlError):
    """A stage's artifact is not in the store and building it was not asked for."""

    def __init__(self, stage_name: str, root: Any) -> None:
        super().__init__(f"the recipe's {stage_name} artifact is not in {root}")
        self.stage = stage_name


# --- the runner ---------------------------------------------------------------------------------

def find_or_build(stage_: Stage, store: "ArtifactStore", *, config: dict[str, Any], parents: list[str],
                  build: Callable[["PendingArtifact"], None], force: bool = False, find_only: bool = False,
                  kind: str | None = None) -> "Artifact":
    """The artifact of `stage_` for (config, parents): reused when up to date (checked by the store's
    verification policy), else made by `build(pending)`, which writes into `pending.dir` and fills
    `pending.summary`; the store seals it. `force` makes it again; `find_only` makes nothing and
    raises MissingArtifact instead."""
    if find_only:
        from qerl_pipe.artifacts import artifact_id

        existing = store.find_existing(stage_.name, artifact_id(stage_.name, stage_.version, config, parents))
        if existing is None:
            raise MissingArtifact(stage_.name, store.root)
        log(f"{stage_.name}: up to date, reusing {existing.path}")
        return existing
    with store.create(stage=stage_.name, stage_version=stage_.version, kind=kind or stage_.kind, config=config,
                      parents=parents, force=force) as (pending, existing):
        if existing is not None:
            log(f"{stage_.name}: up to date, reusing {existing.path}")
            return existing
        build(pending)
    # Just written and hashed into its manifest: no need to read every byte again.
    return store.sealed(stage_.name, pending.id)


def upstream(names: list[str], recipe: "Recipe", made: tuple[str, ...] = ()) -> list[str]:
    """The stages `recipe_artifact` visits for `names` (each input it uses, recursively), inputs
    first, leaving out `made` (artifacts already in hand) and what only they need."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order or name in made:
            return
        for inp in stage(name).inputs:
            if inp.used_by(recipe):
                visit(inp.stage_for(recipe))
        order.append(name)

    for name in names:
        visit(name)
    return order


def preflight(names: list[str], recipe: "Recipe", store: "ArtifactStore", made: tuple[str, ...] = ()) -> None:
    """Every check of the stages that building `names` runs, before the first one starts: a bad
    value is refused before any of them spends minutes (a calibration, an import, a quantize)."""
    for name in upstream(names, recipe, made):
        stage(name).check_recipe(recipe, store)


def recipe_artifact(name: str, recipe: "Recipe", store: "ArtifactStore", *, build: bool, force: bool = False,
                    made: dict[str, "Artifact"] | None = None) -> "Artifact":
    """Stage `name`'s artifact as `qerl-pipe run` makes it for `recipe`: each input it uses comes
    from `made` (what this run made already) or, recursively, from this function. `build=False`
    finds only (MissingArtifact names the first stage not in the store); `force` redoes `name` only."""
    made = {} if made is None else made
    if name in made:
        return made[name]
    s = stage(name)
    inputs = {inp.keyword: recipe_artifact(inp.stage_for(recipe), recipe, store, build=build, made=made)
              for inp in s.inputs if inp.used_by(recipe)}
    # build_missing: eval pointed at a full run's export builds that model's engine itself
    made[name] = s.entry_point()(recipe, store, **inputs, force=force, build_missing=build, find_only=not build)
    return made[name]


def input_artifact(for_stage: str, option: str, recipe: "Recipe", store: "ArtifactStore", *,
                   build_missing: bool, find_only: bool = False) -> "Artifact":
    """The default for a stage command's input that was not passed: the artifact the recipe
    describes, found in the store, or built with its own missing inputs only when `build_missing`
    (`qerl-pipe run`, `--build-missing`). A stage command never starts upstream work unasked; a
    missing input is one error naming the command that makes it."""
    inp = next(i for i in stage(for_stage).inputs if i.option == option)
    if build_missing and not find_only:
        preflight([inp.stage], recipe, store)
    try:
        return recipe_artifact(inp.stage, recipe, store, build=build_missing and not find_only)
    except MissingArtifact as exc:
        if find_only:  # a lookup for a stage further down: the outermost command words the error
            raise
        first = f" (which needs `qerl-pipe {exc.stage}` first)" if exc.stage != inp.stage else ""
        raise QerlError(f"{for_stage} needs the recipe's {stage(inp.stage).what} (made by `qerl-pipe {inp.stage}`), "
                        f"which is not in {store.root}: run `qerl-pipe {inp.stage}` with the same recipe{first}, "
                        f"pass {option} ARTIFACT, or add --build-missing (`qerl-pipe run RECIPE` makes every stage)"
                        ) from None


def check_kind(artifact: "Artifact", stage_name: str, option: str) -> None:
    """Refuse an artifact passed to `option` that `stage_name` did not make."""
    made_by = stage(stage_name)
    if artifact.kind != made_by.kind:
        raise ArtifactError(f"{artifact.path} is a '{artifact.kind}' artifact, not a {made_by.what} "
                            f"('{made_by.kind}'); pass a `qerl-pipe {stage_name}` artifact ({stage_name}-<id>) to {option}")


def run_pipeline(recipe: "Recipe", store: "ArtifactStore", *, force: bool = False) -> dict[str, "Artifact"]:
    """`qerl-pipe run`: the recipe's stages in DAG order, each handed its inputs, building what they
    need; `force` redoes every stage the recipe lists. Returns each listed stage's artifact.
    The `check` of every stage it will build runs first (`preflight`), so a bad data file or an
    engine longer than the model's positions fails before the first stage."""
    preflight(list(recipe.stages), recipe, store)
    made: dict[str, "Artifact"] = {}
    for name in recipe.stages:
        recipe_artifact(name, recipe, store, build=True, force=force, made=made)
    return {name: made[name] for name in recipe.stages}
