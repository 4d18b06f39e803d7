"""What every stage shares: devices, loading an HF model for a forward pass, the config key, and
what the stages that generate from an engine (train, eval) need: stop tokens and prompts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from qerl_pipe.errors import ArtifactError, ModelSourceError, QerlError
from qerl_pipe.log import log, quiet_transformers
from qerl_pipe.rl.tasks import Problem, render_prompt
from qerl_pipe.sources import ResolvedModel


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise QerlError("device 'cuda' was asked for but no CUDA GPU is visible; use device: auto or cpu")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def count_parameters(config: dict[str, Any]) -> int:
    """Parameter count from an HF Llama-family config, without loading weights."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or h // heads
    vocab = config["vocab_size"]
    attn = h * head_dim * (heads + 2 * kv) + heads * head_dim * h
    mlp = 3 * h * i
    embeddings = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    return layers * (attn + mlp) + embeddings


def compute_dtype(choice: str, device: torch.device, n_params: int) -> torch.dtype:
    """float32 on CPU for small models (exact statistics, fast enough); bfloat16 elsewhere."""
    if choice != "auto":
        return getattr(torch, choice)
    if device.type == "cpu" and n_params < 2_000_000_000:
        return torch.float32
    return torch.bfloat16


def load_hf_causal_lm(model_dir: Path, dtype: torch.dtype, device: torch.device, trust_remote_code: bool):
    """The unquantized model through transformers, for calibration and the perplexity reference."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True
        )
    except Exception as exc:  # transformers raises many types for unreadable models
        raise ModelSourceError(f"cannot load the model in {model_dir}: {exc}") from None
    return model.to(device).eval()


def load_tokenizer(model_dir: Path, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelSourceError(f"cannot load the tokenizer in {model_dir}: {exc}") from None


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
