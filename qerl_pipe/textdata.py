"""Plain text for calibration and perplexity: the packaged GSM8K / MATH-500 files or a user file.

Texts are tokenized and packed into fixed-length sequences (documents joined with EOS), so every
token counts and no padding can leak into activation statistics."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from qerl_pipe.errors import RecipeError
from qerl_pipe.userfiles import read_jsonl_objects, read_user_text

# The packaged problem sets (rl.task.tasks reads them too): spec -> (file, question field, answer field,
# task kind); calibration and perplexity read the question field as text.
PACKAGED = {
    "gsm8k:train": ("gsm8k/train.jsonl", "question", "answer", "gsm8k"),
    "gsm8k:test": ("gsm8k/test.jsonl", "question", "answer", "gsm8k"),
    "math500:test": ("math500/test.jsonl", "problem", "answer", "math"),
}


def packaged_path(rel: str) -> Path:
    return Path(str(resources.files("qerl_pipe") / "data" / rel))


def load_texts(spec: str, field: str | None = None) -> list[str]:
    """Texts from a packaged dataset name or a .jsonl (one object per line) / .txt (blank-line separated) file."""
    if spec in PACKAGED:
        rel, default_field = PACKAGED[spec][:2]
        path, field = packaged_path(rel), field or default_field
    else:
        path = Path(spec)
        if not path.is_file():
            raise RecipeError(f"text data '{spec}' is neither a packaged dataset ({', '.join(PACKAGED)}) nor an "
                              "existing file")
    if path.suffix == ".txt":
        texts = [t.strip() for t in read_user_text(path, "text data", RecipeError).split("\n\n") if t.strip()]
    elif path.suffix == ".jsonl":
        field = field or "text"
        texts = []
        for lineno, row in read_jsonl_objects(path, "text data", RecipeError):
            if field not in row:
                raise RecipeError(f"{path}:{lineno}: no field '{field}' (fields: {', '.join(row)}); set the field option")
            texts.append(str(row[field]))
    else:
        raise RecipeError(f"text data {path}: expected a .jsonl or .txt file")
    if not texts:
        raise RecipeError(f"text data {path} holds no text")
    return texts


def _token_stream(texts: list[str], tokenizer, need: int) -> list[int]:
    """The texts' token ids joined by EOS, stopping once `need` tokens are there."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if eos is not None:
            ids.append(eos)
        if len(ids) >= need:
            break
    return ids


def pack_sequences(texts: list[str], tokenizer, num_samples: int, seq_len: int) -> torch.Tensor:
    """Token ids [num_samples, seq_len] from the texts joined by EOS; errors if there is too little text."""
    need = num_samples * seq_len
    ids = _token_stream(texts, tokenizer, need)
    if len(ids) < need:
        raise RecipeError(f"the text data gives {len(ids)} tokens, fewer than num_samples x seq_len = {need}; "
                          "lower num_samples or seq_len, or give more text")
    return torch.tensor(ids[:need], dtype=torch.long).view(num_samples, seq_len)


def pack_available(texts: list[str], tokenizer, num_samples: int, seq_len: int) -> torch.Tensor:
    """Like `pack_sequences`, but with too little text it takes what there is instead of failing:
    fewer sequences, or one shorter sequence. For reports, which must never fail a stage."""
    ids = _token_stream(texts, tokenizer, num_samples * seq_len)
    if len(ids) < 2:
        raise RecipeError(f"the text data gives {len(ids)} tokens; a perplexity needs at least 2")
    rows = min(num_samples, len(ids) // seq_len)
    if rows == 0:
        return torch.tensor(ids, dtype=torch.long).view(1, -1)
    return torch.tensor(ids[:rows * seq_len], dtype=torch.long).view(rows, seq_len)
