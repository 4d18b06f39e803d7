"""Typed recipes: one YAML file, one section per stage, validated before any work starts.

A recipe is the whole configuration of a pipeline run. Every stage command reads the section it
needs; `--set section.key=value` overrides single values. Unknown keys and bad values are errors
that name the key and the file, because a typo silently ignored costs a GPU-hour.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qerl_pipe.errors import RecipeError

STAGE_ORDER = ("calibrate", "quantize", "build-engine")


class _Section(BaseModel):
    """Base for every recipe section: unknown keys are errors, values are checked on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    source: str = Field(
        "smollm2-135m-instruct",
        description="A local Hugging Face directory, a hub id, a .gguf file, "
        "'pkg:DIST/PATH.gguf' (a GGUF file inside an installed package), or a built-in alias.",
    )
    revision: str | None = Field(None, description="Hub revision (only for hub ids).")
    trust_remote_code: bool = Field(
        False, description="Allow the model's own Python code to run (only if you trust it)."
    )


class CalibrateSection(_Section):
    data: str = Field("gsm8k:train", description="'gsm8k:train', 'gsm8k:test', 'math500:test' or a .jsonl/.txt file.")
    field: str | None = Field(None, description="JSONL field holding the text (default: the dataset's question field, or 'text').")
    num_samples: int = Field(128, ge=1, description="Number of calibration sequences.")
    seq_len: int = Field(256, ge=8, description="Tokens per calibration sequence.")
    batch_size: int = Field(8, ge=1, description="Sequences per forward pass (bounds memory).")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Compute dtype; auto is bfloat16 on CUDA, float32 on CPU for models under 2B parameters."
    )


class QualitySection(_Section):
    perplexity: Literal["auto", "always", "never"] = Field(
        "auto", description="Compare bf16 vs dequantized-NVFP4 perplexity; auto does it for models under 1B parameters."
    )
    data: str = "gsm8k:test"
    field: str | None = None
    num_samples: int = Field(16, ge=1)
    seq_len: int = Field(256, ge=8)
    device: Literal["auto", "cpu", "cuda"] = "auto"


class QuantizeSection(_Section):
    format: Literal["nvfp4"] = "nvfp4"
    exclude: list[str] = Field(
        default_factory=lambda: ["lm_head"],
        description="Module names (fnmatch patterns) kept in the model dtype; lm_head is always kept.",
    )
    dtype: Literal["auto", "bfloat16", "float16"] = Field(
        "auto", description="Dtype of the tensors that stay unquantized; auto keeps a 16-bit model's own dtype, else bfloat16."
    )
    quality: QualitySection = Field(default_factory=QualitySection)


class EngineSection(_Section):
    """`build-engine`: the model as the kernels run it, with planned limits and tuned kernels."""

    base_format: Literal["nvfp4", "nf4", "bf16"] = Field(
        "nvfp4", description="Frozen base: nvfp4 reads the quantize artifact; nf4 (QLoRA baseline) and "
        "bf16 read the original model source.",
    )
    max_seq_len: int = Field(1024, ge=2, description="Prompt + generated tokens per sequence (KV-cache length).")
    max_batch: int = Field(64, ge=1, description="Most sequences decoded at once (fewer if the KV budget is smaller).")
    kv_budget_gib: float | None = Field(
        None, gt=0, description="KV-cache memory budget in GiB; null = auto: on CUDA 40% of the memory free "
        "after loading the model, on CPU 2 GiB.",
    )
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto", description="Capture the decode step as CUDA graphs; auto = on for CUDA."
    )
    tune_kernels: Literal["auto", "on", "off"] = Field(
        "auto", description="Time kernel configs for this model's layer shapes on this GPU; auto = on for CUDA "
        "with a 4-bit base.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the engine runs (and is tuned).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Activation, KV-cache and dense-weight dtype; auto is bfloat16 on CUDA, float32 on "
        "CPU for models under 2B parameters.",
    )

    @field_validator("cuda_graphs", "tune_kernels", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `on` / `off` as a boolean; both spellings mean the same here.
        if isinstance(value, bool):
            return "on" if value else "off"
        return value


class Recipe(_Section):
    """The whole recipe. `stages` lists what `qerl-pipe run` executes, in pipeline order."""

    stages: list[str] = Field(default_factory=lambda: list(STAGE_ORDER))
    model: ModelSection = Field(default_factory=ModelSection)
    calibrate: CalibrateSection = Field(default_factory=CalibrateSection)
    quantize: QuantizeSection = Field(default_factory=QuantizeSection)
    engine: EngineSection = Field(default_factory=EngineSection)  # the build-engine stage

    @field_validator("stages")
    @classmethod
    def _known_stages_in_order(cls, stages: list[str]) -> list[str]:
        unknown = [s for s in stages if s not in STAGE_ORDER]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; known stages, in order: {list(STAGE_ORDER)}")
        if stages != sorted(stages, key=STAGE_ORDER.index) or len(set(stages)) != len(stages):
            raise ValueError(f"stages must be listed once each in pipeline order {list(STAGE_ORDER)}")
        return stages

    @model_validator(mode="after")
    def _has_a_stage(self) -> "Recipe":
        if not self.stages:
            raise ValueError("stages is empty: list at least one of " + ", ".join(STAGE_ORDER))
        return self


def _format_validation_error(err: ValidationError, origin: str) -> str:
    parts = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown key '{key}'")
        else:
            parts.append(f"'{key}': {e['msg']}")
    return f"{origin}: " + "; ".join(parts)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `section.key=value` into a key path and a YAML-typed value (so 3 is an int, [a] a list)."""
    if "=" not in text:
        raise RecipeError(f"--set '{text}': expected section.key=value, e.g. --set calibrate.num_samples=64")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise RecipeError(f"--set '{text}': the key is empty; expected section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise RecipeError(f"--set '{text}': the value is not valid YAML ({exc.problem})") from None
    return path, value


def _apply_override(data: dict[str, Any], path: list[str], value: Any, text: str) -> None:
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"--set '{text}': '{part}' is a value, not a section")
        node = child
    node[path[-1]] = value


def load_recipe(path: Path | None, overrides: list[str] = ()) -> Recipe:
    """Read a recipe file (or the defaults when `path` is None) and apply `--set` overrides."""
    origin = str(path) if path else "the default recipe"
    data: dict[str, Any] = {}
    if path is not None:
        if not path.is_file():
            raise RecipeError(f"recipe file {path} does not exist; pass an existing YAML file to --recipe")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise RecipeError(f"{path}: not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise RecipeError(f"{path}: a recipe is a mapping of sections (model:, calibrate:, ...), got {type(loaded).__name__}")
        data = loaded or {}
    for text in overrides:
        key_path, value = parse_override(text)
        _apply_override(data, key_path, value, text)
    if overrides:
        origin += " with --set " + " ".join(overrides)
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_validation_error(err, origin)) from None
