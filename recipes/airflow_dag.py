"""The qerl-pipe pipeline as an Airflow DAG: one BashOperator per stage it chains.

Each task runs one stage command (`qerl_pipe.dag.STAGE_ORDER`, each after the stages it reads);
the command prints its artifact directory as its last output line, which the BashOperator pushes
to XCom, and the next task pulls it (`--calibration`, `--quantized`, `--engine`, `--run`,
`--model` + `--adapter`). A re-run task reuses the artifact when its inputs are unchanged, so
clearing and re-running a DAG run costs only what changed. The tasks, their edges and commands
are built from the declared pipeline (`qerl_pipe.dag`, through `qerl_pipe.orchestration`), as the
Makefile is.

Trigger params: `recipe` and `artifacts` (absolute paths: tasks run in a temporary directory
unless QERL_WORKDIR is set), `model` (a model source; empty = the recipe's) and `set` (a list of
section.key=value overrides). Their defaults, read when the DAG file is parsed: QERL_RECIPE,
QERL_ARTIFACTS, QERL_PIPE_CLI (how to call the CLI, default `qerl-pipe`), QERL_WORKDIR (the
tasks' working directory). Airflow 2.x and 3.x both load this file; qerl-pipe must be installed
where the scheduler parses it and where the tasks run.
"""

from __future__ import annotations

import os
import shlex
from datetime import datetime
from pathlib import Path

try:  # Airflow 3
    from airflow.providers.standard.operators.bash import BashOperator
    from airflow.sdk import DAG, Param
except ImportError:  # Airflow 2
    from airflow import DAG
    from airflow.models.param import Param
    from airflow.operators.bash import BashOperator

from qerl_pipe.dag import STAGE_ORDER
from qerl_pipe.orchestration import SHELL_FILTERS, airflow_command, upstream

# When this file sits in a checkout's recipes/, default to that checkout's recipe and store.
CHECKOUT = Path(__file__).resolve().parents[1]
IN_CHECKOUT = (CHECKOUT / "qerl_pipe").is_dir()
DEFAULT_RECIPE = os.environ.get("QERL_RECIPE", str(CHECKOUT / "recipes" / "quickstart.yaml"))
DEFAULT_ARTIFACTS = os.environ.get("QERL_ARTIFACTS", str(CHECKOUT / "artifacts"))
CLI = shlex.split(os.environ.get("QERL_PIPE_CLI", "qerl-pipe"))
WORKDIR = os.environ.get("QERL_WORKDIR") or (str(CHECKOUT) if IN_CHECKOUT else None)

with DAG(
    dag_id="qerl_pipe",
    description=", ".join(STAGE_ORDER) + " (qerl-pipe stage commands)",
    schedule=None,  # a pipeline run is started by hand or by another DAG
    start_date=datetime(2025, 1, 1),
    catchup=False,
    user_defined_filters=dict(SHELL_FILTERS),  # `shquote` quotes params and XCom paths for bash
    params={
        "recipe": Param(DEFAULT_RECIPE, type="string", description="Recipe YAML file (absolute path)."),
        "artifacts": Param(DEFAULT_ARTIFACTS, type="string", description="Artifact store directory (absolute path)."),
        "model": Param("", type="string", description="Model source for every stage; empty: the recipe's."),
        "set": Param([], type="array", description="Recipe overrides, section.key=value, one per item."),
    },
    tags=["qerl-pipe"],
) as dag:
    tasks = {
        stage: BashOperator(task_id=stage, bash_command=airflow_command(stage, CLI), cwd=WORKDIR,
                            do_xcom_push=True)  # the pushed last line is the artifact path
        for stage in STAGE_ORDER
    }
    for stage, task in tasks.items():
        for parent in upstream(stage):
            tasks[parent] >> task
