"""The runner: one call of a stage (`StageCall`), its inputs resolved by kind from the DAG, and the
artifact a recipe describes for any stage (`recipe_artifact`). A missing input is looked up when the
stage asks for it and built only with `build_missing`, after `preflight` has run the checks of
every stage it will build. See docs/pipeline.md, section "Chaining the stages"."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact
from qerl_pipe.dag import BY_NAME, MissingArtifact, Stage, check_recipe, entry_point, find_or_build
from qerl_pipe.errors import ArtifactError, QerlError
from qerl_pipe.recipe import Recipe
from qerl_pipe.sources import ResolvedModel, resolve_model

# What may be passed to an input: an artifact, or for a loose input also a reference the stage
# resolves itself (a path, an id, a model source).
Given = Artifact | str | Path


@dataclass(frozen=True)
class StageCall:
    """One call of `stage`'s entry point: what was passed to its declared inputs (by keyword) and the mode. `force`
    redoes this stage only; `build_missing` builds the inputs the recipe describes that the store lacks;
    `find_only` (a lookup for a stage further down) makes nothing."""

    stage: Stage
    recipe: Recipe
    store: ArtifactStore
    given: Mapping[str, Given | None] = field(default_factory=dict)
    force: bool = False
    build_missing: bool = False
    find_only: bool = False

    def __post_init__(self) -> None:
        for inp in self.stage.inputs:
            value = self.given.get(inp.keyword)
            if value is None or inp.loose:
                continue
            if not isinstance(value, Artifact):
                raise TypeError(f"{inp.option} takes an artifact here (`pipeline.run_stage` resolves references)")
            if value.kind != inp.stage.kind:
                raise ArtifactError(f"{value.path} is a '{value.kind}' artifact, not a {inp.stage.what} "
                                    f"('{inp.stage.kind}'); pass a `qerl-pipe {inp.stage.name}` artifact "
                                    f"({inp.stage.name}-<id>) to {inp.option}")

    @property
    def builds(self) -> bool:
        """Whether this call may build the artifacts the recipe describes that the store lacks."""
        return self.build_missing and not self.find_only

    def passed(self, keyword: str) -> Given | None:
        """What was passed to the input `keyword`, as it was: an artifact, or a loose input's reference."""
        self.stage.input(keyword)  # rejects a keyword the stage does not declare
        return self.given.get(keyword)

    def input(self, keyword: str) -> Artifact | None:
        """The input `keyword`'s artifact: the one passed; else, for a used, non-optional input, the recipe's (built
        only with `build_missing`; missing, an error naming the command that makes it); else None."""
        inp = self.stage.input(keyword)
        passed = self.given.get(keyword)
        if passed is not None:
            assert isinstance(passed, Artifact), "a loose input is read with passed()"
            return passed
        if inp.optional or inp.loose or not inp.used_by(self.recipe):
            return None
        if self.builds:
            preflight([inp.stage], self.recipe, self.store)
        try:
            return recipe_artifact(inp.stage, self.recipe, self.store, build=self.builds)
        except MissingArtifact as exc:
            if self.find_only:  # a lookup for a stage further down: the outermost command words the error
                raise
            maker = inp.stage.name
            raise QerlError(f"{self.stage.name} needs the recipe's {inp.stage.what} (made by `qerl-pipe {maker}`), "
                            f"which is not in {self.store.root}: run `qerl-pipe {maker}` with the same recipe"
                            f"{exc.first(maker)}, pass {inp.option} ARTIFACT, or add --build-missing (`qerl-pipe run RECIPE` "
                            "makes every stage)") from None

    def artifact_for(self, stage: Stage, recipe: Recipe, made: dict[str, Artifact]) -> Artifact:
        """`stage`'s artifact for another `recipe` (eval's engine of a checkpoint or model source), `made` standing
        in for its inputs; built only when this call builds, else MissingArtifact for the caller to word."""
        if self.builds:
            preflight([stage], recipe, self.store, made=tuple(made))
        return recipe_artifact(stage, recipe, self.store, build=self.builds, made=dict(made))

    def model(self) -> ResolvedModel:
        """The recipe's model source as a local directory; a GGUF source is imported (the `import`
        stage, made on demand by the stage that reads the model) unless this call only finds."""
        return resolve_model(self.recipe.model, self.store, find_only=self.find_only)

    def seal(self, *, config: dict[str, Any], parents: list[str], build: Callable[[PendingArtifact], None],
             kind: str | None = None) -> Artifact:
        """This stage's artifact for (config, parents), found or made by `build` (`dag.find_or_build`)."""
        return find_or_build(self.stage, self.store, config=config, parents=parents, build=build, force=self.force,
                             find_only=self.find_only, kind=kind)


def recipe_artifact(stage: Stage, recipe: Recipe, store: ArtifactStore, *, build: bool, force: bool = False,
                    made: dict[str, Artifact] | None = None) -> Artifact:
    """`stage`'s artifact as `run` makes it: each input the recipe uses from `made` (made already) or, recursively,
    from here. `build=False` finds only (MissingArtifact names the first stage missing); `force` redoes `stage`."""
    made = {} if made is None else made
    if stage.name in made:
        return made[stage.name]
    given = {inp.keyword: recipe_artifact(inp.stage_for(recipe), recipe, store, build=build, made=made)
             for inp in stage.inputs if inp.used_by(recipe)}
    call = StageCall(stage, recipe, store, given, force=force, build_missing=build, find_only=not build)
    try:
        made[stage.name] = entry_point(stage)(call)
    except MissingArtifact as exc:
        if exc.stage != stage.name and BY_NAME[exc.stage].on_demand:
            # The import a stage makes when it reads a GGUF source: that stage is what to run.
            raise MissingArtifact(stage.name, store.root) from None
        raise
    return made[stage.name]


def preflight(stages: list[Stage], recipe: Recipe, store: ArtifactStore, made: tuple[str, ...] = ()) -> None:
    """The check (`dag.check_recipe`) of every stage `recipe_artifact` visits for `stages` (each input the recipe
    uses, recursively, inputs first; not `made`, artifacts in hand, nor what only they need), before the first
    one starts: a bad value is refused before any of them spends minutes (a calibration, a GGUF import)."""
    order: list[Stage] = []

    def visit(stage: Stage) -> None:
        if stage in order or stage.name in made:
            return
        for inp in stage.inputs:
            if inp.used_by(recipe):
                visit(inp.stage_for(recipe))
        order.append(stage)

    for stage in stages:
        visit(stage)
    for stage in order:
        check_recipe(stage, recipe, store)
