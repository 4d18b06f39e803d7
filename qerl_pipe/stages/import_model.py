"""`qerl-pipe import`: a GGUF model source as a bf16 safetensors directory in the store.

Made on demand by the stages that read the model (`sources.resolve_model`); the command makes it
alone. A source that is no GGUF file has nothing to import. See docs/pipeline.md, section
"Chaining the stages"."""

from __future__ import annotations

from qerl_pipe.artifacts import Artifact
from qerl_pipe.dag import IMPORT, register
from qerl_pipe.errors import ModelSourceError
from qerl_pipe.runner import StageCall
from qerl_pipe.sources import gguf_file, import_gguf

STAGE = IMPORT


@register(STAGE)
def import_stage(call: StageCall) -> Artifact:
    """Import the recipe's GGUF model (found in the store when it was imported before)."""
    section = call.recipe.model
    gguf = gguf_file(section)
    if gguf is None:
        raise ModelSourceError(f"model source {section.source} is not a GGUF file: there is nothing to import (the "
                               "stages read it as it is)")
    return import_gguf(gguf, call.store, section, force=call.force, find_only=call.find_only)
