"""`qerl-pipe keys [section]`: every recipe key with its type, default and meaning.

Read from the recipe's pydantic models (`recipe.py`), so the list is what `--set` and a recipe file
accept and cannot drift from it. See docs/training.md, section "The recipe section"."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel

from qerl_pipe.errors import RecipeError
from qerl_pipe.recipe import Recipe, did_you_mean

# annotated_types' bound classes, by the attribute each keeps its value in.
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "at least"))


@dataclass(frozen=True)
class KeyDoc:
    """One recipe key as `keys` prints it."""

    key: str
    type: str
    default: str
    meaning: str


def _value(value: Any) -> str:
    """A default as it would be written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)


def _type(annotation: Any) -> str:
    """`int`, `float or null`, `one of grpo, dapo, dr_grpo`, `list of q, k, ...`."""
    origin = get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(_value(v) for v in get_args(annotation))
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(get_args(annotation))
        return " or ".join(_type(a) for a in args) + (" or null" if nullable else "")
    if origin is list:
        (item,) = get_args(annotation)
        return "list of " + _type(item).removeprefix("one of ")
    return getattr(annotation, "__name__", str(annotation))


def _walk(model: type[BaseModel], prefix: str) -> list[KeyDoc]:
    out: list[KeyDoc] = []
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):  # a section
            out += _walk(field.annotation, f"{prefix}{name}.")
        else:
            bounds = ", ".join(f"{word} {getattr(m, attr)}" for m in field.metadata for attr, word in _BOUNDS
                               if hasattr(m, attr))
            out.append(KeyDoc(f"{prefix}{name}", _type(field.annotation) + (f" ({bounds})" if bounds else ""),
                              _value(field.get_default(call_default_factory=True)), field.description or ""))
    return out


def recipe_keys(section: str | None = None) -> list[KeyDoc]:
    """Every key of the recipe, or of one section (`train`, `train.lora`); an unknown section is a
    RecipeError naming the sections there are."""
    keys = _walk(Recipe, "")
    if section is None:
        return keys
    chosen = [k for k in keys if k.key.startswith(section + ".") or k.key == section]
    if not chosen:
        sections = sorted({k.key.rsplit(".", 1)[0] for k in keys if "." in k.key})
        raise RecipeError(f"no recipe section or key '{section}'{did_you_mean(section, sections)}; sections: "
                          + ", ".join(sections))
    return chosen


def format_keys(keys: list[KeyDoc]) -> str:
    """Two lines a key: `key: type; default value`, then its meaning, indented."""
    return "\n".join(f"{k.key}: {k.type}; default {k.default}\n    {k.meaning}" for k in keys)
