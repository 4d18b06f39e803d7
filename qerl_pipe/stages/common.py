"""What the stages share: the config keys of data files and models, and what the stages that
generate from an engine (train, eval) need: stop tokens and prompts. Devices and loading a model
through transformers are in `qerl_pipe.hf`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qerl_pipe.errors import ArtifactError, QerlError
from qerl_pipe.log import log
from qerl_pipe.rl.tasks import Problem, render_prompt
from qerl_pipe.sources import ResolvedModel


DATA_FILE_SUFFIXES = (".jsonl", ".txt")


def data_file_key(spec: str | None) -> str | None:
    """The sha256 of a data file named by a recipe (None for packaged data and generated tasks):
    an artifact id keyed by the path alone would reuse results of data edited since."""
    if spec is None or not spec.endswith(DATA_FILE_SUFFIXES) or not Path(spec).is_file():
        return None
    from qerl_pipe.artifacts.manifest import sha256_file

    return sha256_file(Path(spec))


def model_config_key(resolved: ResolvedModel, section: Any) -> dict[str, Any]:
    """The part of a stage's config that names the model: recipe values plus the content fingerprint."""
    return {"source": section.model_dump(), "content": resolved.fingerprint}


def stop_token_ids(tokenizer, engine_dir: Path) -> tuple[int, ...]:
    """The tokenizer's EOS and the generation config's eos_token_id(s)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    config = engine_dir / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not ids:
        raise QerlError(f"{engine_dir}: the tokenizer has no EOS token, so responses could never stop")
    return tuple(dict.fromkeys(int(i) for i in ids))


def fit_prompts(tokenizer, problems: list[Problem], instruction: str | None, max_seq_len: int, max_new_tokens: int,
                what: str, section: str) -> tuple[list[Problem], list[list[int]], list[Problem]]:
    """Rendered prompts that leave `max_new_tokens` in the engine's `max_seq_len`: (kept problems,
    their prompts, skipped problems). Skips are logged; none fitting is an error naming the keys."""
    room = max_seq_len - max_new_tokens
    kept, skipped = [], []
    for p in problems:
        ids = render_prompt(tokenizer, p, instruction)
        if len(ids) <= room:
            kept.append((p, ids))
        else:
            skipped.append(p)
    if skipped:
        log(f"{section}: {len(skipped)} of {len(problems)} {what} problems have prompts longer than {room} tokens "
            "(engine max_seq_len - max_new_tokens) and are skipped")
    if not kept and problems:
        raise QerlError(f"no {what} prompt fits in {room} tokens; lower {section}.max_new_tokens or build the engine "
                        "with a larger engine.max_seq_len")
    return [p for p, _ in kept], [ids for _, ids in kept], skipped


def engine_model_name(engine, store) -> str:
    """The model an engine artifact was made from, as the recipe named it (adapter configs, reports)."""
    base = engine.manifest.get("config", {}).get("base", {})
    model_key = base.get("model")
    if model_key is None and "quantized" in base:
        try:
            model_key = store.resolve(base["quantized"], verify=False).manifest["config"]["model"]
        except (ArtifactError, KeyError):
            model_key = None
    try:
        return str(model_key["source"]["source"])
    except (TypeError, KeyError):
        return str(engine.path)
