"""The stage commands that recipes/Makefile and recipes/airflow_dag.py chain: which artifact each
stage reads through which option, in what order, quoted for the shell; the DAG's tasks, edges and
rendered commands when Airflow is importable."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest

from qerl_pipe.orchestration import STAGE_INPUTS, airflow_command, last_line_only, stage_words, upstream
from qerl_pipe.recipe import STAGE_ORDER

ROOT = Path(__file__).parents[2]


def path_of(stage: str) -> str:
    return f"/store/{stage}-0123"


def test_each_stage_reads_its_parents_artifact_through_the_cli_option():
    words = {stage: stage_words(stage, path_of) for stage in STAGE_ORDER}
    assert words["calibrate"] == ["qerl-pipe", "calibrate"]
    assert words["quantize"][-2:] == ["--calibration", "/store/calibrate-0123"]
    assert words["build-engine"][-2:] == ["--quantized", "/store/quantize-0123"]
    assert words["train"][-2:] == ["--engine", "/store/build-engine-0123"]
    assert words["export"][-2:] == ["--run", "/store/train-0123"]
    assert words["eval"][-4:] == ["--model", "/store/build-engine-0123", "--adapter", "/store/train-0123"]
    assert [upstream(s) for s in STAGE_ORDER] == [[], ["calibrate"], ["quantize"], ["build-engine"], ["train"],
                                                  ["build-engine", "train"]]
    # every option named here exists on its command
    from typer.main import get_command

    from qerl_pipe.cli import app

    commands = get_command(app).commands
    for stage, inputs in STAGE_INPUTS.items():
        options = {o for p in commands[stage].params for o in p.opts}
        assert {"--recipe", "--artifacts", "--set"} <= options and {o for o, _ in inputs} <= options, stage


def test_shared_options_and_the_model_source_skips_eval():
    options = dict(cli=["python3", "-m", "qerl_pipe"], recipe="my recipe.yaml", artifacts="store", model="./tiny",
                   sets=["train.steps=2", "eval.data='a b'"])
    assert stage_words("train", path_of, **options) == [
        "python3", "-m", "qerl_pipe", "train", "--recipe", "my recipe.yaml", "--artifacts", "store", "--model",
        "./tiny", "--set", "train.steps=2", "--set", "eval.data='a b'", "--engine", "/store/build-engine-0123"]
    assert stage_words("eval", path_of, **options) == [
        "python3", "-m", "qerl_pipe", "eval", "--recipe", "my recipe.yaml", "--artifacts", "store", "--set",
        "train.steps=2", "--set", "eval.data='a b'", "--model", "/store/build-engine-0123", "--adapter",
        "/store/train-0123"]


def test_an_unknown_stage_is_refused():
    with pytest.raises(ValueError, match="unknown stage 'deploy'"):
        stage_words("deploy", path_of)


def test_last_line_only_keeps_the_path_after_late_stderr_and_fails_with_the_command():
    import subprocess

    noisy = "{ echo log >&2; echo /store/x; echo late-log >&2; }"
    done = subprocess.run(["bash", "-c", last_line_only(noisy)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "/store/x\n"
    merged = subprocess.run(["bash", "-c", last_line_only(noisy) + " 2>&1"], capture_output=True, text=True)
    assert merged.stdout.splitlines()[-1] == "/store/x"
    assert subprocess.run(["bash", "-c", last_line_only("echo /store/x; exit 3")]).returncode != 0


def render(template: str, params: dict, xcom: dict[str, str]) -> str:
    """Render a task's command as Airflow does: Jinja with the DAG's `shquote` filter."""
    import jinja2

    from qerl_pipe.orchestration import SHELL_FILTERS

    class TaskInstance:
        def xcom_pull(self, task_ids: str) -> str:
            return xcom[task_ids]

    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters.update(SHELL_FILTERS)
    return env.from_string(template).render(params=params, ti=TaskInstance())


def unwrapped(command: str) -> list[str]:
    """The stage command inside `last_line_only`, as words."""
    prefix, suffix = "out=$(", ') && printf "%s\\n" "$out" | tail -n 1'
    assert command.startswith(prefix) and command.endswith(suffix), command
    return shlex.split(command[len(prefix):-len(suffix)])


@pytest.mark.parametrize("model", ["", "/models/tiny llama"])
def test_airflow_commands_render_to_the_stage_commands(model):
    pytest.importorskip("jinja2")
    params = {"recipe": "/r/my recipe.yaml", "artifacts": "/store", "model": model,
              "set": ["train.steps=2", "eval.data='x y'"]}
    xcom = {stage: path_of(stage) for stage in STAGE_ORDER}
    for stage in STAGE_ORDER:
        rendered = render(airflow_command(stage, ["python3", "-m", "qerl_pipe"]), params, xcom)
        expected = stage_words(stage, path_of, cli=["python3", "-m", "qerl_pipe"], recipe=params["recipe"],
                               artifacts=params["artifacts"], model=model or None, sets=params["set"])
        assert unwrapped(rendered) == expected, stage


def test_the_airflow_dag_has_one_bash_task_per_stage_chained_through_xcom():
    pytest.importorskip("airflow")
    spec = importlib.util.spec_from_file_location("qerl_airflow_dag", ROOT / "recipes" / "airflow_dag.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dag = module.dag
    assert dag.dag_id == "qerl_pipe" and [t.task_id for t in dag.tasks] == list(STAGE_ORDER)
    for stage in STAGE_ORDER:
        task = dag.get_task(stage)
        assert type(task).__name__ == "BashOperator" and task.do_xcom_push
        assert sorted(task.upstream_task_ids) == sorted(upstream(stage))
    params = {"recipe": "/r.yaml", "artifacts": "/store", "model": "", "set": ["train.steps=1"]}
    env = dag.get_template_env()  # the DAG's own environment: its user-defined `shquote` filter
    eval_task = dag.get_task("eval")
    rendered = env.from_string(eval_task.bash_command).render(
        params=params, ti=type("TI", (), {"xcom_pull": lambda self, task_ids: path_of(task_ids)})())
    assert unwrapped(rendered) == [*module.CLI, "eval", "--recipe", "/r.yaml", "--artifacts", "/store",
                                   "--set", "train.steps=1", "--model", path_of("build-engine"),
                                   "--adapter", path_of("train")]
    assert {k: dag.params[k] for k in ("model", "set")} == {"model": "", "set": []}
