"""A Hugging Face model's config.json, read and checked in one place: a file that is not JSON, not
an object, or lacks a size key is one `ModelSourceError` naming the file. No torch: the CLI's
checks read it before any model work. See docs/formats.md, section "Formats: NVFP4, NF4 and the
checkpoint layouts" (the module table)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qerl_pipe.errors import ModelSourceError
from qerl_pipe.userfiles import read_user_json

CONFIG_NAME = "config.json"
# What every stage reads from a Llama-family config.json to size the model.
SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
REQUIRED_CONFIG_KEYS = ("model_type", *SIZE_KEYS)


def read_model_config(path: Path) -> dict[str, Any]:
    """The model's config.json as a dict; not JSON, not an object, or without a key every stage
    needs is one ModelSourceError naming the file, instead of a traceback deep in a stage."""
    config = read_user_json(path / "config.json", "model config", ModelSourceError)
    if not isinstance(config, dict):
        raise ModelSourceError(f"model config {path / 'config.json'} is not a JSON object; restore the model's "
                               "original config.json")
    missing = [key for key in REQUIRED_CONFIG_KEYS if key not in config]
    if missing:
        raise ModelSourceError(f"model config {path / 'config.json'} has no {', '.join(missing)}: it is incomplete; "
                               "restore the model's original config.json")
    # bool is an int to Python, and a size of True is as wrong as "abc"
    bad = [key for key in SIZE_KEYS if type(config[key]) is not int or config[key] < 1]
    if bad:
        raise ModelSourceError(f"model config {path / 'config.json'}: {bad[0]} is {config[bad[0]]!r}, not a positive "
                               "integer; restore the model's original config.json")
    return config
