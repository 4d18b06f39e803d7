"""Plan one RL step to a memory budget: the first of one chain of candidate settings whose estimated peak
(`memory.step`) fits, else `MemoryBudgetError`. Plain numbers (`StepShape`, bytes; GB = 10^9).
See docs/engine.md, section "The step's memory plan", and docs/training.md (the rule and its chain)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from qerl_pipe.errors import QerlError
from qerl_pipe.kernels.base_formats import base_format as format_entry
from qerl_pipe.memory.step import StepSize, estimate_step_bytes
from qerl_pipe.model.config import DecoderConfig

GB = 10**9
MIN_LOGPROB_CHUNK = 128
BUDGET_KEY = "train.memory_budget_gb"
# What each part of the estimate is called in messages.
PART_NAMES = {"weights": "weights", "lora_and_optimizer": "LoRA + AdamW", "full_and_optimizer": "masters + AdamW",
              "kv_cache": "KV cache", "activations": "activations", "dequant_scratch": "dequant scratch",
              "kernel_copies": "kernel copies (humming / FP8)", "dense_base": "base dequantized for the CPU",
              "slack": "slack"}


class MemoryBudgetError(QerlError):
    """No plan of the step fits the budget; `needed_bytes` is the smallest budget that does."""

    def __init__(self, message: str, needed_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.needed_bytes, self.budget_bytes = needed_bytes, budget_bytes


@dataclass(frozen=True)
class StepShape:
    """What the recipe fixes about one process's step; `max_*` bound what the planner may choose."""

    sequences: int  # prompts x samples this process rolls out per step
    prompts: int
    seq_len: int  # prompt + completion tokens per sequence: each KV slot's length
    prompt_len: int
    lora_rank: int
    max_kv_slots: int  # engine.max_batch (no more than `sequences` are ever used)
    max_micro_batch: int  # train.micro_batch_size
    max_logprob_chunk: int  # the log-probabilities' default chunk
    adapter: str = "lora"  # or "full" (every weight trains; a bf16 base only)
    dense_base: bool = False  # a CPU run: a 4-bit base is also held dequantized (memory.step.dense_base_bytes)
    lora_experts: bool = False  # MoE: LoRA on the routed experts too
    kv_cache: str = "bf16"  # the KV cache's format (engine.kv_cache): "fp8" or "int8" holds about half the bytes

    def __post_init__(self) -> None:
        for key in ("sequences", "prompts", "seq_len", "max_kv_slots", "max_micro_batch", "max_logprob_chunk"):
            if getattr(self, key) < 1:
                raise ValueError(f"StepShape.{key} must be at least 1, got {getattr(self, key)}")

    def size(self, kv_slots: int, micro_batch: int, logprob_chunk: int) -> StepSize:
        return StepSize(self.sequences, self.seq_len, self.prompt_len, self.prompts, kv_slots, micro_batch,
                        self.lora_rank, logprob_chunk, self.dense_base, self.lora_experts, self.kv_cache)


@dataclass(frozen=True)
class PlanChange:
    """One setting the plan lowered: what the step would use without a budget, and what it uses."""

    SETTINGS = ("kv_slots", "micro_batch", "logprob_chunk")

    setting: str  # one of SETTINGS
    asked: int
    planned: int


@dataclass(frozen=True)
class MemoryPlan:
    """The settings chosen for a step and the estimate they were chosen by (bytes)."""

    kv_slots: int
    micro_batch: int
    logprob_chunk: int
    budget_bytes: int | None  # None: nothing to fit (the recipe's own settings)
    budget_source: str  # what set the budget: the recipe key, a flag, "free GPU memory", "none"
    estimate: dict[str, int]
    shape: StepShape
    base_format: str
    dtype: str
    # Whether the step keeps humming copies of the NVFP4 base (kernels.dispatch), and the bytes
    # the caller asked for: copies are dropped first when they keep the step from fitting.
    kernel_copies: bool = False
    kernel_copies_asked: int = 0

    @property
    def waves(self) -> int:
        return math.ceil(self.shape.sequences / self.kv_slots)

    @property
    def estimate_bytes(self) -> int:
        return self.estimate["total"]

    @property
    def size(self) -> StepSize:
        return self.shape.size(self.kv_slots, self.micro_batch, self.logprob_chunk)

    def to_json(self) -> dict[str, Any]:
        return {"kv_slots": self.kv_slots, "waves": self.waves, "micro_batch": self.micro_batch,
            "logprob_chunk": self.logprob_chunk, "budget_bytes": self.budget_bytes,
            "budget_gb": None if self.budget_bytes is None else round(self.budget_bytes / GB, 3),
            "budget_source": self.budget_source, "estimate_bytes": self.estimate,
            "estimate_gb": round(self.estimate_bytes / GB, 3), "estimate_gib": round(self.estimate_bytes / 2**30, 3),
            "base_format": self.base_format, "dtype": self.dtype, "step": asdict(self.shape),
            "kernel_copies": self.kernel_copies, "kernel_copies_asked_bytes": self.kernel_copies_asked}

    def changes(self) -> list[PlanChange]:
        """The settings this plan lowers below what the step would use without a budget (the recipe's
        bounds, each capped at the step's sequences); none when the recipe's settings fit."""
        asked = candidates(self.shape)[0]
        planned = (self.kv_slots, self.micro_batch, self.logprob_chunk)
        return [PlanChange(name, a, p) for name, a, p in zip(PlanChange.SETTINGS, asked, planned) if p != a]

    def describe(self) -> str:
        """One line: the settings, the estimate and the budget."""
        s = self.shape
        budget = ("no budget" if self.budget_bytes is None
                  else f"budget {self.budget_bytes / GB:.1f} GB ({self.budget_source})")
        return (f"{s.sequences} sequences of {s.seq_len} tokens in {self.waves} wave(s) of {self.kv_slots} KV slots, "
                f"micro-batch {self.micro_batch}, LM-head chunk {self.logprob_chunk}: estimated peak "
                f"{self.estimate_bytes / GB:.1f} GB ({_parts(self.estimate)}), {budget}"
                + ("" if self.kernel_copies or not self.kernel_copies_asked else
                   f"; no kernel copies of the base ({self.kernel_copies_asked / GB:.1f} GB did not fit: the "
                   "base's own kernels serve their rows)"))


def _parts(estimate: dict[str, int]) -> str:
    return ", ".join(f"{PART_NAMES.get(k, k)} {v / GB:.1f}" for k, v in estimate.items() if k != "total" and v)


def _halvings(start: int, floor: int) -> list[int]:
    """start, start // 2, ... down to `floor` (the last step lands on it), each once."""
    out = [start]
    while out[-1] > floor:
        out.append(max(floor, out[-1] // 2))
    return out


def candidates(shape: StepShape) -> list[tuple[int, int, int]]:
    """(kv_slots, micro_batch, logprob_chunk), from the recipe's settings down to the smallest
    plan; each at most its predecessor in every setting (docs/engine.md, "The step's memory plan")."""
    slots = min(shape.max_kv_slots, shape.sequences)
    micro = min(shape.max_micro_batch, shape.sequences)
    chunks = _halvings(shape.max_logprob_chunk, min(MIN_LOGPROB_CHUNK, shape.max_logprob_chunk))
    out = [(slots, micro, c) for c in chunks]
    chunk = chunks[-1]
    out += [(slots, m, chunk) for m in _halvings(micro, 1)[1:]]
    out += [(k, 1, chunk) for k in range(slots - 1, 0, -1)]
    return out


def plan_step(config: DecoderConfig, base_format: str, shape: StepShape, budget_bytes: int | None, *,
              dtype: torch.dtype = torch.bfloat16, budget_source: str = BUDGET_KEY,
              what: str = "the RL step", kernel_copies: int = 0) -> MemoryPlan:
    """The largest settings (first of `candidates`) whose estimated peak fits `budget_bytes` (None: the
    recipe's), else MemoryBudgetError naming the smallest budget that fits and `budget_source`, the knob.
    `kernel_copies` (bytes, a speed option) go first: the recipe's settings with them, then without."""
    fmt = format_entry(base_format)  # raises on an unknown one
    dtype_name = str(dtype).removeprefix("torch.")
    estimate: dict[str, int] = {}
    chain = candidates(shape)
    tries = ([(chain[0], kernel_copies)] if kernel_copies else []) + [(c, 0) for c in chain]
    for (slots, micro, chunk), copies in tries:
        estimate = estimate_step_bytes(config, base_format, shape.size(slots, micro, chunk), shape.adapter, dtype,
                                       copies)
        if budget_bytes is None or estimate["total"] <= budget_bytes:
            return MemoryPlan(slots, micro, chunk, budget_bytes, budget_source if budget_bytes is not None else "none",
                              estimate, shape, base_format, dtype_name, bool(copies), kernel_copies)
    assert budget_bytes is not None
    needed = math.ceil(estimate["total"] / (GB / 10)) / 10  # GB rounded up to 0.1: that budget holds it
    slots, micro, chunk = chain[-1]
    fix = ("a 4-bit base (engine.base_format=nvfp4) holds the weights in about a quarter of the bytes; "
           if fmt.dense else "")
    raise MemoryBudgetError(
        f"{what} does not fit {budget_source}={budget_bytes / GB:g} GB: even its smallest plan ({slots} KV slot(s), "
        f"{math.ceil(shape.sequences / slots)} waves, micro-batch {micro}, LM-head chunk {chunk}) needs "
        f"{estimate['total'] / GB:.1f} GB ({base_format} base, {dtype_name}: {_parts(estimate)}). "
        f"The smallest budget that fits is {needed:g} GB: "
        + (f"set {budget_source}={needed:g} or more on a GPU that has it"
           if budget_source == BUDGET_KEY else f"a GPU with that much free ({budget_source} is the budget now)")
        + f", or shrink the step ({fix}shorter sequences, a lower LoRA rank)",
        needed_bytes=estimate["total"], budget_bytes=budget_bytes)


# ---------------------------------------------------------------------------- budgets


def budget_bytes(gb: float) -> int:
    return int(gb * GB)


def step_budget(gb: float | None, device: torch.device) -> tuple[int | None, str, bool]:
    """(budget bytes, what set it, enforced): the recipe's `memory_budget_gb`, enforced on CUDA;
    without one, on CUDA the memory free now (not capped: the GPU is the cap), on CPU none."""
    if gb is not None:
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            if budget_bytes(gb) > total:
                raise QerlError(f"{BUDGET_KEY}={gb:g} GB is more than this GPU has ({total / GB:.1f} GB): a plan for "
                                f"it would run out of memory mid-run; set {BUDGET_KEY} to {total / GB:.1f} or less, or "
                                "leave it unset to plan for the memory free now")
        return budget_bytes(gb), BUDGET_KEY, device.type == "cuda"
    if device.type == "cuda":
        # The driver's free figure leaves out what this process's caching allocator holds but no
        # longer uses (an earlier stage of `run` in the same process): that is ours to plan with.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached, "free GPU memory", False
    return None, "none", False


def _indexed(device: torch.device) -> torch.device:
    # set_per_process_memory_fraction refuses a bare "cuda" (it needs the index): seen on the H200.
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def enforce_budget(budget: int, device: torch.device) -> float | None:
    """Cap this process's CUDA caching allocator at `budget` bytes of `device` (allocations past it
    raise out-of-memory, as on a card of that size); returns the fraction set (None on CPU)."""
    if device.type != "cuda":
        return None
    device = _indexed(device)
    fraction = min(1.0, budget / torch.cuda.get_device_properties(device).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def release_budget(device: torch.device) -> None:
    """Lift `enforce_budget`'s cap."""
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, _indexed(device))


@contextmanager
def budget_cap(budget: int | None, device: torch.device) -> Iterator[None]:
    """The process capped at `budget` bytes (None: not capped) while the block runs, then uncapped,
    so that a later stage in the same process sets its own cap."""
    if budget is None:
        yield
        return
    enforce_budget(budget, device)
    try:
        yield
    finally:
        release_budget(device)
