"""Prompts for an engine: the token ids that end a response, and the problems whose rendered
prompts leave room for the response in the engine's sequence length. Train and eval both
generate from an engine artifact, so both start here."""

from __future__ import annotations

import json
from pathlib import Path

from qerl_pipe.errors import QerlError
from qerl_pipe.log import log
from qerl_pipe.rl.task.tasks import Problem, render_prompt


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
