"""The pipeline as a chain of stage commands, for schedulers: `recipes/Makefile` (written by
`python -m qerl_pipe.orchestration`; a test fails on a byte of difference) and `recipes/airflow_dag.py`,
both from the declared DAG, so neither can drift from `qerl-pipe run`. Imports no Airflow and runs
nothing: it only builds command strings. See docs/pipeline.md, sections "Makefile" and "Airflow"."""

from __future__ import annotations

import shlex
from typing import Callable, Mapping, Sequence

from qerl_pipe.dag import STAGE_ORDER, STAGES

# stage -> ((option, upstream stage whose artifact path the option takes), ...), in STAGE_ORDER:
# a chain of commands hands every input over, optional ones included. (The on-demand import is
# no step of a chain: the stage that reads a GGUF model source makes it.)
STAGE_INPUTS: dict[str, tuple[tuple[str, str], ...]] = {
    s.name: tuple((i.option, i.stage.name) for i in s.inputs) for s in STAGES if s.name in STAGE_ORDER
}

# Stages whose --model option names the model source: those with no input that takes --model
# (eval's --model names the engine instead).
TAKES_MODEL_SOURCE = frozenset(name for name, inputs in STAGE_INPUTS.items()
                               if all(option != "--model" for option, _ in inputs))


class Raw(str):
    """A shell fragment put into a command as it is: already quoted, or a template that renders quoted."""


def upstream(stage: str) -> list[str]:
    """The stages whose artifacts `stage` reads, in pipeline order."""
    if stage not in STAGE_INPUTS:
        raise ValueError(f"unknown stage {stage!r}; known stages, in order: {list(STAGE_ORDER)}")
    return sorted({parent for _, parent in STAGE_INPUTS[stage]}, key=STAGE_ORDER.index)


def input_words(stage: str, artifact_of: Callable[[str], str]) -> list[str]:
    """`stage`'s artifact inputs as options, e.g. ['--calibration', artifact_of('calibrate')]; `artifact_of(parent)`
    is a path, or a shell/template fragment (a `Raw`) that yields one when the command runs."""
    upstream(stage)  # rejects an unknown stage
    return [word for option, parent in STAGE_INPUTS[stage] for word in (option, artifact_of(parent))]


def option_words(stage: str, *, recipe: str | None = None, artifacts: str | None = None,
                 model: str | None = None, sets: Sequence[str] = ()) -> list[str]:
    """The options every stage command shares. `model` is dropped for eval, whose --model is the
    engine: there the engine and the adapter name the model."""
    pairs = [("--recipe", recipe), ("--artifacts", artifacts),
             ("--model", model if stage in TAKES_MODEL_SOURCE else None), *(("--set", item) for item in sets)]
    return [word for option, value in pairs if value is not None for word in (option, value)]


def stage_words(stage: str, artifact_of: Callable[[str], str], *, cli: Sequence[str] = ("qerl-pipe",),
                **options) -> list[str]:
    """One stage command as words: the CLI, the stage, the shared options (`option_words`), then
    its artifact inputs (`input_words`)."""
    return [*cli, stage, *option_words(stage, **options), *input_words(stage, artifact_of)]


def last_line_only(command: str) -> str:
    """`command` wrapped so that its output ends with the artifact path alone: Airflow's BashOperator
    pushes the last line and merges stderr into it, so the path is captured from stdout and printed
    after the command exits (no exit-time log line can take its place); a failure still fails."""
    return f'out=$({command}) && printf "%s\\n" "$out" | tail -n 1'


# Airflow: templates rendered by the DAG's Jinja environment, which has `shquote` = shlex.quote.
SHELL_FILTERS: Mapping[str, Callable[[str], str]] = {"shquote": shlex.quote}


def airflow_command(stage: str, cli: Sequence[str] = ("qerl-pipe",)) -> str:
    """The templated bash command of `stage`'s task: DAG params `recipe`, `artifacts`, `model` (empty:
    the recipe's), `set` (section.key=value list), upstream paths from XCom; `stage_words` with the
    params quoted at run time (Jinja loops and conditions: a trigger adds or drops them)."""
    words = [*cli, stage, *option_words(stage, recipe=Raw("{{ params.recipe | shquote }}"),
                                        artifacts=Raw("{{ params.artifacts | shquote }}"))]
    if stage in TAKES_MODEL_SOURCE:
        words.append(Raw("{% if params.model %}--model {{ params.model | shquote }}{% endif %}"))
    words.append(Raw("{% for item in params.set %}--set {{ item | shquote }} {% endfor %}"))
    # Each upstream path as its task pushed it to XCom (its last output line), shell-quoted.
    words += input_words(stage, lambda task_id: Raw("{{ ti.xcom_pull(task_ids=%r) | shquote }}" % task_id))
    return last_line_only(" ".join(w if isinstance(w, Raw) else shlex.quote(w) for w in words))


# --- recipes/Makefile ----------------------------------------------------------------------------

MAKEFILE_HEAD = """\
# The pipeline as make targets: {stages}.
# Written by `python -m qerl_pipe.orchestration > recipes/Makefile` from qerl_pipe/dag.py; do not edit
# (tests/pipeline/test_dag.py fails when this file differs from what that command prints).
#
#   make -f recipes/Makefile RECIPE=my.yaml ARTIFACTS=artifacts   # every stage; again: nothing to do
#   make -f recipes/Makefile train SET="train.steps=20 train.lr=1e-4"
#   make -f recipes/Makefile clean-stamps                          # forget the pointers, keep artifacts
#
# Each stage command prints its artifact directory as the last line of stdout; that path is kept
# in a pointer file, $(STAMPS)/<stage>, which is the target. Artifact ids are content hashes known
# only after a stage ran, so the pointers stand in for them; the next stage reads its input's path
# from its prerequisite's pointer. A pointer is replaced only after its command succeeded (temp
# file, then mv), so a failed or interrupted stage leaves the previous pointer and make retries it.
# A pointer is out of date when the recipe, MODEL or SET changed, when the pointer before it
# changed, or when its artifact is gone; a re-run stage command reuses an artifact whose inputs
# are unchanged, so out-of-date pointers cost little. An nf4 or bf16 recipe (engine.base_format)
# runs the same chain: build-engine leaves the quantize artifact unused.

PYTHON ?= python3
# From a checkout (run make in the repository root) `$(PYTHON) -m qerl_pipe` runs its code; with
# the package installed anywhere, QERL=qerl-pipe does the same.
QERL ?= $(PYTHON) -m qerl_pipe
RECIPE ?= recipes/quickstart.yaml
ARTIFACTS ?= artifacts
# A model source for every stage that reads one (empty: the recipe's model.source).
MODEL ?=
# Recipe overrides, section.key=value separated by spaces (values without spaces; put those in the recipe).
SET ?=
STAMPS ?= $(ARTIFACTS)/.make

STAGES := {stage_list}
OPTS = $(strip --recipe '$(RECIPE)' --artifacts '$(ARTIFACTS)' $(if $(MODEL),--model '$(MODEL)') $(foreach s,$(SET),--set '$(s)'))
# For the stages whose --model is an input ({modelless}), not the model source.
NO_MODEL_OPTS = $(strip --recipe '$(RECIPE)' --artifacts '$(ARTIFACTS)' $(foreach s,$(SET),--set '$(s)'))
path_of = "$$(cat $(STAMPS)/$(1))"

.DEFAULT_GOAL := all
.PHONY: all $(STAGES) clean-stamps help
all: {sinks}
$(STAGES): %: $(STAMPS)/%

# The variables that change what the stages make, kept in a file that is rewritten only when they
# change, so that changing them puts every pointer out of date (make sees no variable otherwise).
INPUTS := RECIPE=$(RECIPE) MODEL=$(MODEL) SET=$(SET)
$(shell mkdir -p '$(STAMPS)')
ifneq ($(file <$(STAMPS)/inputs),$(INPUTS))
$(file >$(STAMPS)/inputs,$(INPUTS))
endif

# A pointer whose artifact is gone (deleted, or the store moved) is out of date whatever its
# mtime: phony makes its stage run again (reusing or re-creating the artifact) and all after it.
GONE := $(foreach s,$(STAGES),$(if $(wildcard $(STAMPS)/$(s)),$(if $(wildcard $(file <$(STAMPS)/$(s))/manifest.json),,$(STAMPS)/$(s))))
ifneq ($(GONE),)
.PHONY: $(GONE)
endif

# $(call run_stage,STAGE,OPTIONS): run the stage command, keep the last line of its stdout (logs go
# to stderr, shown as usual) and make it the pointer only if it names an artifact with a manifest.
define run_stage
@mkdir -p '$(STAMPS)'
$(QERL) $(1) $(2) > '$@.out'
@tail -n 1 '$@.out' > '$@.tmp' && rm -f '$@.out'
@test -f "$$(cat '$@.tmp')/manifest.json" || {{ echo "make: $(1) printed no artifact path (see $@.tmp)" >&2; exit 1; }}
@mv -f '$@.tmp' '$@'
@echo "$(1): $$(cat '$@')"
endef

DEPS = $(RECIPE) $(STAMPS)/inputs
"""

MAKEFILE_TAIL = """
# Only the pointers (and a failed stage's leftovers): artifacts are never deleted here.
clean-stamps:
\tcd '$(STAMPS)' && rm -f $(STAGES) $(addsuffix .tmp,$(STAGES)) $(addsuffix .out,$(STAGES))

help:
\t@echo "targets: all (default) $(STAGES) clean-stamps"
\t@echo "variables: RECIPE=$(RECIPE) ARTIFACTS=$(ARTIFACTS) MODEL=$(MODEL) SET=$(SET) QERL=$(QERL)"
\t@echo "pointers (artifact paths): $(STAMPS)/<stage>"
"""


def _make_rule(stage: str) -> str:
    """`stage`'s rule: its pointer from its parents' pointers, its command handed their paths."""
    prerequisites = "".join(f"$(STAMPS)/{parent} " for parent in dict.fromkeys(p for _, p in STAGE_INPUTS[stage]))
    options = "$(OPTS)" if stage in TAKES_MODEL_SOURCE else "$(NO_MODEL_OPTS)"
    handed = "".join(f" {option} $(call path_of,{parent})" for option, parent in STAGE_INPUTS[stage])
    return f"$(STAMPS)/{stage}: {prerequisites}$(DEPS)\n\t$(call run_stage,{stage},{options}{handed})\n"


def makefile() -> str:
    """recipes/Makefile, written from the DAG: one pointer target per chained stage."""
    read = {parent for inputs in STAGE_INPUTS.values() for _, parent in inputs}
    head = MAKEFILE_HEAD.format(stages=", ".join(STAGE_ORDER), stage_list=" ".join(STAGE_ORDER),
                                modelless=", ".join(s for s in STAGE_ORDER if s not in TAKES_MODEL_SOURCE),
                                sinks=" ".join(s for s in STAGE_ORDER if s not in read))
    return head + "".join("\n" + _make_rule(stage) for stage in STAGE_ORDER) + MAKEFILE_TAIL


if __name__ == "__main__":
    print(makefile(), end="")
