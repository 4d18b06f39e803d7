"""One module per stage, each registering its entry point with the DAG (`dag.register`); importing
this package registers them all. A stage module is orchestration only: it asks its call
(`runner.StageCall`) for its inputs, keys its artifact and hands a `build` function to the runner;
the work is in the library (`jobs/engine_build.py`, `jobs/`, `model/`, `formats/`)."""

from qerl_pipe.stages import build_engine, calibrate, evaluate, export, import_model, quantize, train

__all__ = ["build_engine", "calibrate", "evaluate", "export", "import_model", "quantize", "train"]
