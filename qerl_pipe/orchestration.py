"""The pipeline as a chain of stage commands, for schedulers that run shell commands.

`qerl-pipe run` chains the stages in one process; `recipes/Makefile` and `recipes/airflow_dag.py`
chain the stage *commands*, each handing the artifact path the previous one printed to the next.
Which stage reads which artifact through which option comes from the one declared DAG
(`qerl_pipe.dag`), so the Makefile (checked against it by a test) and the Airflow DAG (built from
it) cannot drift from what `qerl-pipe run` does.
Nothing here imports Airflow or runs anything: it only builds command strings.
"""

from __future__ import annotations

import shlex
from typing import Callable, Mapping, Sequence

from qerl_pipe.dag import STAGE_ORDER, STAGES

# stage -> ((option, upstream stage whose artifact path the option takes), ...), in STAGE_ORDER:
# a chain of commands hands every input over, optional ones included.
# eval's --model is the engine (not a model source) and its adapter is the train run.
STAGE_INPUTS: dict[str, tuple[tuple[str, str], ...]] = {
    s.name: tuple((i.option, i.stage) for i in s.inputs) for s in STAGES
}

# Stages whose --model option names the model source; eval's --model names the engine instead.
TAKES_MODEL_SOURCE = frozenset(STAGE_ORDER) - {"eval"}


class Raw(str):
    """A shell fragment put into a command as it is: already quoted, or a template that renders quoted."""


def _word(value: str) -> str:
    return value if isinstance(value, Raw) else shlex.quote(value)


def upstream(stage: str) -> list[str]:
    """The stages whose artifacts `stage` reads, in pipeline order."""
    if stage not in STAGE_INPUTS:
        raise ValueError(f"unknown stage {stage!r}; known stages, in order: {list(STAGE_ORDER)}")
    return sorted({parent for _, parent in STAGE_INPUTS[stage]}, key=STAGE_ORDER.index)


def input_words(stage: str, artifact_of: Callable[[str], str]) -> list[str]:
    """`stage`'s artifact inputs as options, e.g. ['--calibration', artifact_of('calibrate')].

    `artifact_of(parent)` gives what to pass for a parent's artifact: a path, or a shell/template
    fragment (a `Raw`) that yields one when the command runs.
    """
    upstream(stage)  # rejects an unknown stage
    return [word for option, parent in STAGE_INPUTS[stage] for word in (option, artifact_of(parent))]


def option_words(stage: str, *, recipe: str | None = None, artifacts: str | None = None,
                 model: str | None = None, sets: Sequence[str] = ()) -> list[str]:
    """The options every stage command shares. `model` is dropped for eval, whose --model is the
    engine: there the engine and the adapter name the model."""
    words: list[str] = []
    if recipe is not None:
        words += ["--recipe", recipe]
    if artifacts is not None:
        words += ["--artifacts", artifacts]
    if model is not None and stage in TAKES_MODEL_SOURCE:
        words += ["--model", model]
    for item in sets:
        words += ["--set", item]
    return words


def stage_words(stage: str, artifact_of: Callable[[str], str], *, cli: Sequence[str] = ("qerl-pipe",),
                **options) -> list[str]:
    """One stage command as words: the CLI, the stage, the shared options (`option_words`), then
    its artifact inputs (`input_words`)."""
    return [*cli, stage, *option_words(stage, **options), *input_words(stage, artifact_of)]


def stage_command(stage: str, artifact_of: Callable[[str], str], **options) -> str:
    """`stage_words` as one shell command line; `Raw` words go in unquoted."""
    return " ".join(_word(w) for w in stage_words(stage, artifact_of, **options))


def chain_commands(artifact_of: Callable[[str], str], stages: Sequence[str] = STAGE_ORDER,
                   **options) -> list[tuple[str, str]]:
    """(stage, command) for each of `stages` in pipeline order; every stage's inputs must be among them."""
    ordered = sorted(stages, key=STAGE_ORDER.index)
    for stage in ordered:
        missing = [p for p in upstream(stage) if p not in ordered]
        if missing:
            raise ValueError(f"stage {stage} reads the artifact of {missing}, which is not in the chain")
    return [(stage, stage_command(stage, artifact_of, **options)) for stage in ordered]


def last_line_only(command: str) -> str:
    """`command` wrapped so that its output ends with the artifact path alone.

    Airflow's BashOperator pushes the last line of the output, and it merges stderr into it: the
    path is captured from stdout and printed after the command has exited, so a log line written
    at exit can never take its place. The command's failure still fails the whole line.
    """
    return f'out=$({command}) && printf "%s\\n" "$out" | tail -n 1'


# Airflow: templates rendered by the DAG's Jinja environment, which has `shquote` = shlex.quote.
SHELL_FILTERS: Mapping[str, Callable[[str], str]] = {"shquote": shlex.quote}


def xcom_artifact(task_id: str) -> Raw:
    """The artifact path an upstream task pushed to XCom (its last output line), shell-quoted."""
    return Raw("{{ ti.xcom_pull(task_ids=%r) | shquote }}" % task_id)


def airflow_command(stage: str, cli: Sequence[str] = ("qerl-pipe",)) -> str:
    """The templated bash command of `stage`'s task: DAG params `recipe`, `artifacts`, `model`
    (empty: the recipe's) and `set` (a list of section.key=value), upstream paths from XCom.

    The optional params are Jinja loops and conditions, so a trigger's params can add or drop
    them without a new DAG; this is `stage_command` with the params as they are at run time.
    """
    words = [*cli, stage, *option_words(stage, recipe=Raw("{{ params.recipe | shquote }}"),
                                        artifacts=Raw("{{ params.artifacts | shquote }}"))]
    if stage in TAKES_MODEL_SOURCE:
        words.append(Raw("{% if params.model %}--model {{ params.model | shquote }}{% endif %}"))
    words.append(Raw("{% for item in params.set %}--set {{ item | shquote }} {% endfor %}"))
    words += input_words(stage, xcom_artifact)
    return last_line_only(" ".join(_word(w) for w in words))
