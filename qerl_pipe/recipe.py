"""Typed recipes: one YAML file, one section per stage, validated before any work starts.

`--set section.key=value` overrides single values; unknown keys and bad values are errors naming the
key and the file (a typo silently ignored costs a GPU-hour). See docs/architecture.md, section
"Where each kind of change goes" (a recipe key)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from qerl_pipe.dag import STAGE_ORDER
from qerl_pipe.errors import RecipeError
from qerl_pipe.formats.names import LORA_TARGETS
from qerl_pipe.userfiles import read_user_text


class _Section(BaseModel):
    """Base for every recipe section: unknown keys are errors, values are checked on assignment, and
    NaN or infinity is no value (it would reach artifact ids and manifests, which are strict JSON)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelSection(_Section):
    source: str = Field("smollm2-135m-instruct", description="A local Hugging Face directory, a hub id, a .gguf file, "
                        "'pkg:DIST/PATH.gguf' (a GGUF file inside an installed package), or a built-in alias.")
    revision: str | None = Field(None, description="Hub revision (only for hub ids).")
    trust_remote_code: bool = Field(
        False, description="Allow the model's own Python code to run (only if you trust it).")


class CalibrateSection(_Section):
    data: str = Field("gsm8k:train", description="'gsm8k:train', 'gsm8k:test', 'math500:test' or a .jsonl/.txt file.")
    field: str | None = Field(None, description="JSONL field holding the text (default: the dataset's question field, or 'text').")
    num_samples: int = Field(128, ge=1, description="Number of calibration sequences.")
    seq_len: int = Field(256, ge=8, description="Tokens per calibration sequence.")
    batch_size: int = Field(8, ge=1, description="Sequences per forward pass (bounds memory).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the model runs; auto = CUDA when there "
                                                   "is a GPU.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Compute dtype; auto is bfloat16 on CUDA, float32 on CPU for models under 2B parameters.")


class QualitySection(_Section):
    perplexity: Literal["auto", "always", "never"] = Field(
        "auto", description="Compare bf16 vs dequantized-NVFP4 perplexity; auto does it for models under 1B "
        "parameters. The report is in the quantize artifact's manifest: a quality setting that changes it is part of "
        "its id.")
    data: str = Field("gsm8k:test", description="Held-out text for the perplexity: 'gsm8k:test', 'gsm8k:train', "
                      "'math500:test' or a .jsonl/.txt file.")
    field: str | None = Field(None, description="JSONL field holding the text (default: the dataset's question "
                              "field, or 'text').")
    num_samples: int = Field(16, ge=1, description="Sequences measured (fewer when the text runs out).")
    seq_len: int = Field(256, ge=8, description="Tokens per sequence.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the perplexity is measured; auto = "
                                                   "CUDA when there is a GPU.")


class QuantizeSection(_Section):
    format: Literal["nvfp4"] = Field("nvfp4", description="The 4-bit format (NVFP4 is the one there is).")
    method: Literal["rtn", "mse", "act-mse"] = Field(
        "rtn", description="Block scales: rtn = max calibration, byte-exact with NVIDIA Model Optimizer; mse = per "
        "block, the E4M3 scale near it with the least squared error; act-mse = the same with each input channel's "
        "error weighted by its mean squared activation (needs a calibration artifact). The file layout is the same for "
        "all three.")
    exclude: list[str] = Field(default_factory=lambda: ["lm_head"], description="Module names (fnmatch patterns) kept "
                               "in the model dtype; lm_head is always kept.")
    dtype: Literal["auto", "bfloat16", "float16"] = Field(
        "auto", description="Dtype of the tensors that stay unquantized; auto keeps a 16-bit model's own dtype, else "
        "bfloat16.")
    quality: QualitySection = Field(default_factory=QualitySection)


class EngineSection(_Section):
    """`build-engine`: the model as the kernels run it, with planned limits and a measured kernel dispatch."""

    base_format: Literal["nvfp4", "nf4", "bf16"] = Field(
        "nvfp4", description="Frozen base: nvfp4 reads the quantize artifact; nf4 (QLoRA baseline) and bf16 read the "
        "original model source.")
    max_seq_len: int = Field(1024, ge=2, description="Prompt + generated tokens per sequence (KV-cache length).")
    max_batch: int = Field(64, ge=1, description="Most sequences decoded at once (fewer if the KV budget is smaller).")
    kv_budget_gib: float | None = Field(
        None, gt=0, description="KV-cache memory budget in GiB; null = auto: the KV cache the step planner "
        "(qerl_pipe/memory/plan.py) gives train's step under train.memory_budget_gb (on CUDA without a budget, the "
        "memory free at start), on a CPU without a budget 2 GiB.")
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto", description="Capture the decode step as CUDA graphs; auto = on for CUDA.")
    tune_kernels: Literal["auto", "on", "off"] = Field(
        "auto", description="Measure the NVFP4 kernel dispatch for this model's layer shapes on this GPU (Hopper with "
        "nvcc; docs/kernels.md); auto = on for CUDA with an nvfp4 base.")
    deterministic: bool = Field(
        True, description="NVFP4 on CUDA: only kernels that give the same bits on every run (a resumed run repeats an "
        "unbroken one); false also lets humming-kernels' stream-K schedule serve the rows where it is fastest "
        "(measured on an H100: the 7B RL step 8 x 8 1.11x bf16 LoRA against 1.076x; docs/kernels.md).")
    activations: Literal["bf16", "fp8"] = Field(
        "bf16", description="Rollout activations of the linears: fp8 runs them with per-token E4M3 activations on an "
        "FP8 copy of the base (a byte per weight, planned as a kernel copy; GPUs with FP8 tensor cores: Ada, Hopper "
        "and newer), where it is faster than the base's own kernels (docs/kernels.md); the training forward stays "
        "bf16, and train.tis_cap defaults to 2 to correct the mismatch. nvfp4 and bf16 bases.")
    kv_cache: Literal["bf16", "fp8", "int8"] = Field(
        "bf16", description="The rollout's KV cache: bf16, fp8 (E4M3; Ada, Hopper and newer) or int8 (any GPU), the "
        "last two with an fp32 scale per token and head: about half the bytes, twice the KV slots at one budget; int8 "
        "rounds finer (docs/engine.md). train.tis_cap defaults to 2 with either.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the engine runs (and is tuned).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Activation, KV-cache and dense-weight dtype; auto is bfloat16 on CUDA, float32 on CPU for "
        "models under 2B parameters.")

    @field_validator("cuda_graphs", "tune_kernels", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare `on` / `off` as a boolean; both spellings mean the same here.
        if isinstance(value, bool):
            return "on" if value else "off"
        return value


class LoraSection(_Section):
    rank: int = Field(32, ge=1, description="LoRA rank r.")
    alpha: float = Field(64.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank.")
    targets: list[Literal[LORA_TARGETS]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(LORA_TARGETS), min_length=1,
        description="Projections that get an adapter (HF q_proj, k_proj, ...).")
    train_norms: bool = Field(False, description="Also train the RMSNorm weights (exported as PEFT modules_to_save).")
    experts: bool = Field(False, description="MoE models (Qwen3-MoE): also give every routed expert's projections "
                          "among `targets` their own LoRA A/B; the router stays frozen (no load-balancing loss).")


class AqnSection(_Section):
    """Adaptive Quantization Noise: N(0, sigma^2) on the norms feeding q/k/v and gate/up, per rollout step."""

    schedule: Literal["exponential", "linear", "cosine", "log", "none"] = Field(
        "exponential", description="Sigma over the K stages (stage 0 noise-free); none = no AQN.")
    sigma_start: float = Field(1e-2, gt=0, description="Sigma of stage 1.")
    sigma_end: float = Field(5e-4, gt=0, description="Sigma of the last stage (<= sigma_start).")
    num_stages: int = Field(10, ge=3, description="K: the training steps split into K equal stages.")
    apply_in_training: bool = Field(
        False, description="Keep the rollout's noise in the training forward (default: train on the clean weights).")

    @model_validator(mode="after")
    def _decays(self) -> "AqnSection":
        if self.sigma_end > self.sigma_start:
            raise ValueError(f"sigma_end ({self.sigma_end}) > sigma_start ({self.sigma_start}): the noise must "
                             "decay; swap them")
        return self


class OverlongSection(_Section):
    """DAPO's treatment of responses that hit max_new_tokens."""

    mask: bool = Field(False, description="Responses cut at max_new_tokens get no loss (overlong filtering).")
    soft_penalty: bool = Field(False, description="Add DAPO's soft overlong penalty to the reward.")
    buffer: int | None = Field(None, ge=1, description="Penalty ramp: 0 up to max_new_tokens - buffer tokens, -1 at "
                               "max_new_tokens; null = max_new_tokens // 4.")


class DynamicSamplingSection(_Section):
    """DAPO's dynamic sampling: groups whose rewards are all equal carry no signal; draw more prompts."""

    enabled: bool = Field(False, description="Draw more prompts while groups with equal rewards leave the batch short.")
    max_draws: int = Field(3, ge=1, description="Most generation rounds per step (the first included).")


class RewardsSection(_Section):
    accuracy: float = Field(1.0, description="Weight of the correctness reward (1 when the answer matches).")
    format: float = Field(0.0, description="Weight of the format reward (the answer is in the expected form).")
    custom: list[str] = Field(default_factory=list, description="Extra reward functions 'module:function'.")


class TrainSection(_Section):
    """`train`: GRPO/DAPO of LoRA adapters over the engine's frozen base (or of every weight), with AQN."""

    data: str = Field("arithmetic", description="Training problems: 'gsm8k:train', 'math500:test', "
                      "'arithmetic[:N]' (seeded two-digit additions), 'addition:train' (one-digit additions; "
                      "'addition:test' holds the others) or a .jsonl file.")
    eval_data: str | None = Field("arithmetic", description="Problems for the greedy accuracy before and after "
                                  "training (same forms as data; arithmetic is drawn with seed + 1); null = none.")
    eval_limit: int = Field(100, ge=0, description="Evaluate on the first N problems (0 = no evaluation).")
    question_field: str | None = Field(None, description="JSONL field of the question (default: the dataset's).")
    answer_field: str | None = Field(None, description="JSONL field of the answer (default: the dataset's).")
    instruction: str | None = Field(None, description="Instruction added to each question (default: the task's).")
    steps: int = Field(100, ge=1, description="RL steps (one batch of rollouts each).")
    prompts_per_step: int = Field(8, ge=1, description="B: prompts per step.")
    group_size: int = Field(8, ge=2, description="G: samples per prompt (the group of the advantage baseline).")
    max_new_tokens: int = Field(256, ge=1, description="Longest response in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (also the logprobs' temperature).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling; 1 = off.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off.")
    loss: Literal["grpo", "dapo", "dr_grpo"] = Field(
        "dapo", description="Token aggregation: grpo = per-sequence mean, dapo = token mean over the batch, dr_grpo = "
        "sum / (sequences x max_new_tokens).")
    eps_low: float = Field(0.2, ge=0, lt=1, description="Lower clip: ratio >= 1 - eps_low.")
    eps_high: float = Field(0.28, ge=0, description="Upper clip: ratio <= 1 + eps_high (DAPO's clip-higher).")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantage = (r - group mean) / std of the group, of the batch, or not divided.")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL to the base (adapter disabled); 0 = off.")
    mu: int = Field(1, ge=1, description="Optimizer updates per batch of rollouts (> 1 keeps old logprobs).")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per forward/backward (gradient accumulation).")
    lr: float = Field(1e-5, gt=0, description="AdamW peak learning rate.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps, then cosine decay to 0.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    optimizer: Literal["adamw", "adamw8bit"] = Field(
        "adamw", description="adamw: torch's, float32 moments; adamw8bit: bitsandbytes' AdamW8bit (8-bit moments, as "
        "the QeRL paper trains; a CUDA GPU and the qlora extra: pip install -e '.[qlora]').")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping; null = off.")
    gradient_checkpointing: bool = Field(
        True, description="Recompute each layer's activations in backward (less memory, ~1/3 more compute).")
    memory_budget_gb: float | None = Field(
        None, gt=0, description="GPU memory one training process may use, in GB (10^9 bytes). The planner "
        "(qerl_pipe/memory/plan.py) picks the most KV slots (rollout waves), the largest micro-batch (up to "
        "micro_batch_size) and LM-head chunk whose estimated step peak fits, and on CUDA the process is capped to it "
        "(on a CPU it is planned to, not enforced). null = the GPU's free memory at start, not capped; on a CPU, none. "
        "A budget no plan meets is an error before any work, naming the smallest that fits. A budget is part of the "
        "run's id (it sets the micro-batch and the rollout waves); the free memory is not.")
    adapter: Literal["lora", "full"] = Field(
        "lora", description="What trains: lora = adapters over the frozen base (section lora); full = every weight "
        "(embeddings, norms, LM head included) by AdamW with float32 master weights, on a bf16 base only.")
    lora: LoraSection = Field(default_factory=LoraSection)
    aqn: AqnSection = Field(default_factory=AqnSection)
    overlong: OverlongSection = Field(default_factory=OverlongSection)
    dynamic_sampling: DynamicSamplingSection = Field(default_factory=DynamicSamplingSection)
    tis_cap: float | None = Field(
        None, ge=1, description="Truncated importance sampling of the rollout/trainer mismatch (token-level, weight "
        "min(trainer / rollout probability, cap)); null = off. Unset, it is 2 when the engine's rollouts run FP8 "
        "activations or a coded KV cache (engine.activations=fp8, kv_cache=fp8 or int8), as verl does.")
    rewards: RewardsSection = Field(default_factory=RewardsSection)
    checkpoint_every: int = Field(10, ge=0, description="Checkpoint every N steps (and at the end); 0 = end only.")
    seed: int = Field(0, description="Seeds the data order, LoRA init, AQN draws and sampling.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to train (the engine's model is loaded there).")

    @model_validator(mode="after")
    def _consistent(self) -> "TrainSection":
        buffer = self.overlong.buffer
        if buffer is not None and buffer > self.max_new_tokens:
            raise ValueError(f"overlong.buffer ({buffer}) exceeds max_new_tokens ({self.max_new_tokens})")
        if self.adapter == "full" and self.kl_coef > 0:
            # The KL's base policy is the model with its adapter switched off; full fine-tuning
            # overwrites the base itself and keeps no frozen copy to compare with.
            raise ValueError(f"kl_coef={self.kl_coef} needs the base policy, which adapter=full overwrites (no "
                             "frozen copy is kept); set train.kl_coef=0 or train.adapter=lora")
        return self


class ExportSection(_Section):
    """`export`: a run's adapter as a PEFT adapter, or merged into the base (bf16 or NVFP4)."""

    format: Literal["peft", "merged-bf16", "merged-nvfp4"] = Field(
        "peft", description="peft: adapter_model.safetensors + adapter_config.json; merged-bf16: an HF model directory "
        "with the LoRA merged into the 16-bit base; merged-nvfp4: that merged model quantized to modelopt's NVFP4 "
        "layout (vLLM, TensorRT-LLM).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Dtype of the merged weights (merged-bf16) and of the tensors that stay unquantized "
        "(merged-nvfp4); auto keeps a float16 model's dtype, else bfloat16. The merge itself is in float32.")
    exclude: list[str] = Field(default_factory=lambda: ["lm_head"], description="merged-nvfp4: module names (fnmatch "
                               "patterns) kept in `dtype`; lm_head is always kept.")
    calibration: Literal["auto", "none"] = Field(
        "auto", description="merged-nvfp4: auto reuses the activation statistics of the calibration the run's quantize "
        "stage used (quant_algo NVFP4, with input_scale), when it had one; none, or no calibration, writes weight-only "
        "W4A16_NVFP4.")


class EvalSection(_Section):
    """`eval`: accuracy of the engine's model, with or without an adapter, on a problem set."""

    data: str = Field("gsm8k:test", description="Problems: 'gsm8k:test', 'math500:test', 'gsm8k:train', "
                      "'arithmetic[:N]' (seeded), 'addition:test' (held-out one-digit additions) or a .jsonl file.")
    limit: int | None = Field(None, ge=1, description="Evaluate the first N problems; null = all.")
    question_field: str | None = Field(None, description="JSONL field of the question (default: 'question').")
    answer_field: str | None = Field(None, description="JSONL field of the gold answer (default: 'answer').")
    instruction: str | None = Field(None, description="Instruction added to each question (default: the task's).")
    k: int = Field(1, ge=1, description="Samples per problem; pass@1 is averaged over them.")
    greedy: bool = Field(False, description="Greedy decoding (one deterministic sample; needs k = 1) instead of "
                         "sampling.")
    temperature: float = Field(0.6, gt=0, description="Sampling temperature (QeRL's evaluation: 0.6).")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling (QeRL's evaluation: 0.95); 1 = off.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off.")
    max_new_tokens: int = Field(512, ge=1, description="Longest response in tokens (cut responses count as "
                                "truncated and are graded as they are).")
    # 1, not 0: train draws its arithmetic pool with train.seed (0) and its own evaluation with
    # train.seed + 1, so the default evaluates the held-out draw, never the training problems.
    seed: int = Field(1, description="Seeds the sampling and the problems of 'arithmetic' (default 1: the "
                      "held-out draw that train's own evaluation uses with train.seed 0).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where to evaluate (the engine's model is "
                                                   "loaded there).")

    @model_validator(mode="after")
    def _greedy_is_one_sample(self) -> "EvalSection":
        if self.greedy and self.k > 1:
            raise ValueError(f"greedy decoding gives the same response {self.k} times; set k=1 with greedy, "
                             "or sample (greedy=false)")
        return self


class Recipe(_Section):
    """The whole recipe. `stages` lists what `qerl-pipe run` executes, in pipeline order."""

    stages: list[str] = Field(default_factory=lambda: list(STAGE_ORDER),
                              description="What `qerl-pipe run` makes, in pipeline order (a subset of the default).")
    model: ModelSection = Field(default_factory=ModelSection)
    calibrate: CalibrateSection = Field(default_factory=CalibrateSection)
    quantize: QuantizeSection = Field(default_factory=QuantizeSection)
    engine: EngineSection = Field(default_factory=EngineSection)  # the build-engine stage
    train: TrainSection = Field(default_factory=TrainSection)
    export: ExportSection = Field(default_factory=ExportSection)
    eval: EvalSection = Field(default_factory=EvalSection)

    @field_validator("stages")
    @classmethod
    def _known_stages_in_order(cls, stages: list[str]) -> list[str]:
        if not stages:
            raise ValueError("stages is empty: list at least one of " + ", ".join(STAGE_ORDER))
        unknown = [s for s in stages if s not in STAGE_ORDER]
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; known stages, in order: {list(STAGE_ORDER)}")
        if stages != sorted(stages, key=STAGE_ORDER.index) or len(set(stages)) != len(stages):
            raise ValueError(f"stages must be listed once each in pipeline order {list(STAGE_ORDER)}")
        return stages


def did_you_mean(word: str, known: list[str], prefix: str = "") -> str:
    """` (did you mean 'prefix.x'?)` for the closest of `known`, or nothing when none is close."""
    close = difflib.get_close_matches(word, known, n=1)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def _keys_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the section at `loc` (a validation error's path, without its last part) has."""
    model: Any = Recipe
    for part in loc:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        model = field.annotation
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _format_validation_error(err: ValidationError, origin: str) -> str:
    parts = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            section = ".".join(str(p) for p in e["loc"][:-1])
            hint = did_you_mean(str(e["loc"][-1]), _keys_at(e["loc"][:-1]), f"{section}." if section else "")
            where = f"`qerl-pipe keys {section}`" if section else "`qerl-pipe keys`"
            parts.append(f"unknown key '{key}'{hint}; {where} lists the keys")
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


def _refuse_duplicate_keys(node: yaml.Node | None, origin: Path, where: str = "") -> None:
    """YAML lets a later key silently replace an earlier one (`lr: 1e-4 ... lr: 0.5` trains at
    0.5): refuse any repeated key, at any depth, with its path and both lines."""
    if isinstance(node, yaml.MappingNode):
        lines: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            path = f"{where}.{key}" if where else str(key)
            if key is not None and key != "<<":
                line = key_node.start_mark.line + 1
                if key in lines:
                    raise RecipeError(f"{origin}: `{path}` is given twice (lines {lines[key]} and {line}); YAML would "
                                      "keep only the last one: delete one of them")
                lines[key] = line
            _refuse_duplicate_keys(value_node, origin, path)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, origin, f"{where}[{i}]")


def load_recipe(path: Path | None, overrides: list[str] = ()) -> Recipe:
    """Read a recipe file (or the defaults when `path` is None) and apply `--set` overrides."""
    origin = str(path) if path else "the default recipe"
    data: dict[str, Any] = {}
    if path is not None:
        if not path.is_file():
            raise RecipeError(f"recipe file {path} does not exist; pass an existing YAML file to --recipe")
        text = read_user_text(path, "recipe file", RecipeError)
        loader = yaml.SafeLoader(text)  # one parse: the node tree is checked, then built into data
        try:
            root = loader.get_single_node()  # None for an empty file
            _refuse_duplicate_keys(root, path)
            loaded = loader.construct_document(root) if root is not None else None
        except yaml.YAMLError as exc:
            raise RecipeError(f"{path}: not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise RecipeError(f"{path}: a recipe is a mapping of sections (model:, calibrate:, ...), got {type(loaded).__name__}")
        data = loaded or {}
    for text in overrides:
        key_path, value = parse_override(text)
        node = data
        for part in key_path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise RecipeError(f"--set '{text}': '{part}' is a value, not a section")
        node[key_path[-1]] = value
    if overrides:
        origin += " with --set " + " ".join(overrides)
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_validation_error(err, origin)) from None
