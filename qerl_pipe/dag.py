"""The pipeline, declared once: every stage's name, version, artifact kind and inputs, the registry
of their entry points (`@register`), and `find_or_build`, the one reuse policy. The runner, the CLI
and `orchestration` all read it; no stage module imports another, and nothing here imports torch or
pydantic. See docs/pipeline.md, section "Chaining the stages"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from qerl_pipe.errors import QerlError
from qerl_pipe.log import log

if TYPE_CHECKING:  # annotations only
    from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact


class RecipeView(Protocol):
    """What the DAG reads of a recipe (`recipe.Recipe`, which imports this module for the stage
    order: the DAG names no recipe type, so there is no cycle, not even for annotations)."""

    stages: list[str]
    engine: Any
    train: Any

# A stage's entry point, `fn(call: runner.StageCall, **options) -> Artifact`, and its check, `fn(recipe, store)`:
# from the recipe and the model's config.json alone, what would fail hours into a `run` (data files, reward names,
# sequences past the model's positions, a train step over its budget), run by `runner.preflight`.
EntryPoint = Callable[..., "Artifact"]
Check = Callable[[RecipeView, "ArtifactStore"], Any]


@dataclass(frozen=True)
class Stage:
    """A stage: its command and artifact name (`<name>-<id>`), version (part of every id: bump it
    when the output for the same inputs changes), kind, the artifact in words (`what`, for
    messages), the command's help, and its inputs. An `on_demand` stage is never listed in a recipe
    nor chained: the stages that need its artifact make it (the import of a GGUF model source)."""

    name: str
    version: int
    kind: str
    what: str
    help: str
    inputs: tuple[Input, ...] = ()
    on_demand: bool = False

    def input(self, keyword: str) -> Input:
        for inp in self.inputs:
            if inp.keyword == keyword:
                return inp
        raise KeyError(f"stage {self.name} declares no input {keyword!r}")


@dataclass(frozen=True)
class Input:
    """One artifact a stage reads: the stage that makes it and the CLI option that takes it.
    `optional`: not looked up unless passed; `used`: whether `run` hands it over for a recipe and a
    stage command needs it (None: always); `made_by`: the stage whose artifact `run` hands over
    instead of `stage`'s; `loose`: the stage resolves more than an artifact (eval's --model, --adapter)."""

    stage: Stage
    option: str
    help: str
    optional: bool = False
    used: Callable[[RecipeView], bool] | None = None
    made_by: Callable[[RecipeView], Stage] | None = None
    loose: bool = False

    @property
    def keyword(self) -> str:
        """The input's name in the entry point's call (`--run` -> `run`)."""
        return self.option.removeprefix("--").replace("-", "_")

    def used_by(self, recipe: RecipeView) -> bool:
        return self.used is None or self.used(recipe)

    def stage_for(self, recipe: RecipeView) -> Stage:
        return self.made_by(recipe) if self.made_by is not None else self.stage


def full_run_eval(recipe: RecipeView) -> bool:
    """A full fine-tuning run has no adapter: `run` evaluates its merged-bf16 export (the trained
    model) with an engine built from it, instead of an adapter over the recipe's engine."""
    return recipe.train.adapter == "full" and "train" in recipe.stages


def _from_quantize_artifact(recipe: RecipeView) -> bool:
    """Whether the engine base is built from the quantize artifact (nvfp4; nf4 and bf16 read the original model).
    Imported here, with a recipe at hand: the registry imports torch, which reading the DAG does not."""
    from qerl_pipe.kernels.base_formats import base_format

    return base_format(recipe.engine.base_format).from_quantize_artifact


IMPORT = Stage("import", 1, "hf-model", "imported model",
               "Convert the recipe's GGUF model to a bf16 safetensors directory (the stages that read the model "
               "do it when they need it).", on_demand=True)
# Version 2: per-channel mean squares of each linear's input.
CALIBRATE = Stage("calibrate", 2, "calibration", "calibration",
                  "Record activation amax and weight statistics of the unquantized model.")
QUANTIZE = Stage("quantize", 1, "nvfp4-checkpoint", "quantize checkpoint",
                 "Quantize a model to an NVFP4 checkpoint (modelopt unified HF layout).",
                 (Input(CALIBRATE, "--calibration", "Calibration artifact (path or id): gives NVFP4 with input scales; "
                        "without it, W4A16_NVFP4.", optional=True,
                        used=lambda r: CALIBRATE.name in r.stages),))
BUILD_ENGINE = Stage("build-engine", 1, "engine", "engine",
                     "Store the model as the kernels run it, with KV-cache limits and (on Hopper) a measured dispatch.",
                     # an nf4 or bf16 engine reads the original model, not a quantize checkpoint
                     (Input(QUANTIZE, "--quantized", "Quantize artifact (path or id) to build an nvfp4 engine from; "
                            "without it, the recipe's (found in the store; made with --build-missing).",
                            used=_from_quantize_artifact),))
# Version 2: an arithmetic expression no longer grades as a numeric answer.
TRAIN = Stage("train", 2, "run", "run",
              "GRPO/DAPO of a LoRA adapter over the engine's frozen base, with AQN; resumes an interrupted run.",
              (Input(BUILD_ENGINE, "--engine", "Engine artifact (path or id) to train over; without it, the recipe's "
                     "(found in the store; built with --build-missing)."),))
# export's kind is export-<format> (export-peft, export-merged-bf16, export-merged-nvfp4)
EXPORT = Stage("export", 1, "export-peft", "export",
               "Export a run's LoRA adapter: a PEFT adapter, or merged into the base as a bf16 or NVFP4 model.",
               (Input(TRAIN, "--run", "Run artifact (path or id) to export; without it, the recipe's (found in the "
                      "store; trained with --build-missing)."),))
# eval's --model is the engine (not a model source), or after a full run the trained model's export;
# its adapter is the train run when there is one. Version 2: as train's.
EVAL = Stage("eval", 2, "eval", "evaluation report",
             "Accuracy (average pass@1 over k samples, or greedy) of a model with or without a LoRA adapter.",
             (Input(BUILD_ENGINE, "--model", "Engine artifact (path or id); or a quantize artifact or model source, "
                    "whose engine the recipe describes (found in the store; built with --build-missing). Default: "
                    "the recipe's engine.", made_by=lambda r: EXPORT if full_run_eval(r) else BUILD_ENGINE, loose=True),
              Input(TRAIN, "--adapter", "LoRA adapter to apply: a train run (path or id), or a directory with "
                    "adapter_model.safetensors + adapter_config.json. Default: none (the base model).", optional=True,
                    used=lambda r: "train" in r.stages and not full_run_eval(r), loose=True)))

STAGES: tuple[Stage, ...] = (IMPORT, CALIBRATE, QUANTIZE, BUILD_ENGINE, TRAIN, EXPORT, EVAL)
BY_NAME: dict[str, Stage] = {s.name: s for s in STAGES}
# The stages a recipe lists and the Makefile and Airflow DAG chain, in pipeline order.
STAGE_ORDER: tuple[str, ...] = tuple(s.name for s in STAGES if not s.on_demand)


def stage(name: str) -> Stage:
    if name not in BY_NAME:
        raise ValueError(f"unknown stage {name!r}; known stages, in order: {list(STAGE_ORDER)}")
    return BY_NAME[name]


# --- the registry -------------------------------------------------------------------------------

_ENTRY_POINTS: dict[str, EntryPoint] = {}
_CHECKS: dict[str, Check] = {}


def register(stage_: Stage, *, check: Check | None = None) -> Callable[[EntryPoint], EntryPoint]:
    """Decorator: the function runs `stage_` (and `check`, if given, checks a recipe for it)."""

    def add(entry: EntryPoint) -> EntryPoint:
        if stage_.name in _ENTRY_POINTS:
            raise ValueError(f"stage {stage_.name} already has an entry point")
        _ENTRY_POINTS[stage_.name] = entry
        if check is not None:
            _CHECKS[stage_.name] = check
        return entry

    return add


def entry_point(stage_: Stage) -> EntryPoint:
    if stage_.name not in _ENTRY_POINTS:
        raise QerlError(f"stage {stage_.name} has no entry point: import qerl_pipe.stages, which registers them")
    return _ENTRY_POINTS[stage_.name]


def check_recipe(stage_: Stage, recipe: RecipeView, store: "ArtifactStore") -> None:
    if stage_.name in _CHECKS:
        _CHECKS[stage_.name](recipe, store)


# --- finding, reusing or making an artifact ------------------------------------------------------

class MissingArtifact(QerlError):
    """A stage's artifact is not in the store and building it was not asked for."""

    def __init__(self, stage_name: str, root: Any) -> None:
        super().__init__(f"the recipe's {stage_name} artifact is not in {root}")
        self.stage = stage_name

    def first(self, maker: str) -> str:
        """' (which needs `qerl-pipe STAGE` first)' when the first missing artifact is not `maker`'s."""
        return f" (which needs `qerl-pipe {self.stage}` first)" if self.stage != maker else ""


def find_or_build(stage_: Stage, store: "ArtifactStore", *, config: dict[str, Any], parents: list[str],
                  build: Callable[["PendingArtifact"], None], force: bool = False, find_only: bool = False,
                  kind: str | None = None) -> "Artifact":
    """The artifact of `stage_` for (config, parents): reused when up to date (the store's verification policy), else
    made by `build(pending)` into `pending.dir` and `pending.summary`, sealed by the store. `force` makes it
    again; `find_only` makes nothing and raises MissingArtifact instead."""
    if find_only:
        existing = store.find_existing(stage_.name, store.artifact_id_for(stage_.name, stage_.version, config, parents))
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
