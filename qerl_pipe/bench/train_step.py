"""One full RL step (rollouts + training) at Qwen2.5 shapes, with a bf16, NF4 or NVFP4 base under LoRA.

`qerl-pipe bench train-step --shape qwen2.5-7b --quant bf16,nvfp4 --out FILE.json`. Every (shape,
quant) pair runs in this process, one after another, with the GPU memory freed in between.

Each configuration: random weights of the exact shape built directly in the base format, LoRA on
all seven projections, the rollout engine over that same model (KV cache for every sequence of the
step at once), and the real `Trainer` with a synthetic reward, so the step is what `train` runs:
8 prompts x G = 8 samples, 256-token prompts, 1024 sampled tokens at temperature 1 with no stop
token (every response runs to the end), DAPO loss, logprobs through the LM head in chunks,
backward with gradient checkpointing, AdamW on the adapter. One small warm-up step and the capture
of every decode CUDA graph come first, so compilation and capture stay out of the timed step.

Before building, the bytes the step needs are estimated (`step_memory`); a configuration that
cannot fit is reported with `fits: false` and what it asked for. A CUDA out-of-memory error, or
any other failure, is recorded in its row and the next configuration runs. Each row is printed as
one JSON line and the output file is rewritten after it, so a run cut short still leaves data.
"""

from __future__ import annotations

import gc
import json
import string
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from qerl_pipe.bench.results import results_file, target
from qerl_pipe.bench.shapes import QWEN25_SHAPES
from qerl_pipe.bench.step_memory import StepSize, estimate_step_bytes
from qerl_pipe.engine import Engine, plan_limits
from qerl_pipe.errors import QerlError
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.load import init_random_model, model_memory_bytes
from qerl_pipe.model.lora import LoraSpec, lora_parameters
from qerl_pipe.recipe import TrainSection
from qerl_pipe.rl.logprobs import DEFAULT_CHUNK
from qerl_pipe.rl.tasks import Problem
from qerl_pipe.rl.trainer import Trainer

GIB = 2**30
QUANTS = ("bf16", "nf4", "nvfp4")
# Sequences per forward/backward: activations of 8 x 1280 tokens fit easily at 7B/14B; the
# larger hidden sizes and layer counts of 32B/72B want 4.
DEFAULT_MICRO_BATCH = {"qwen2.5-7b": 8, "qwen2.5-14b": 8, "qwen2.5-32b": 4, "qwen2.5-72b": 4}
SYNTHETIC_REWARD = "qerl_pipe.bench.train_step:synthetic_reward"


@dataclass(frozen=True)
class StepSettings:
    prompts: int = 8
    group_size: int = 8
    prompt_len: int = 256
    response_len: int = 1024
    lora_rank: int = 32
    micro_batch: int | None = None  # None: DEFAULT_MICRO_BATCH of the shape (4 for unknown ones)
    kv_slots: int | None = None  # engine slots; None: every sequence of the step at once
    warmup_prompts: int = 1
    warmup_group_size: int = 2
    warmup_tokens: int = 32
    logprob_chunk: int = DEFAULT_CHUNK
    lr: float = 1e-5
    adapter: str = "lora"  # or "full": every weight trains (bf16 base only)

    @property
    def sequences(self) -> int:
        return self.prompts * self.group_size

    def size(self, shape: str) -> StepSize:
        micro = self.micro_batch or DEFAULT_MICRO_BATCH.get(shape, 4)
        return StepSize(self.sequences, self.prompt_len + self.response_len, self.prompt_len, self.prompts,
                        self.kv_slots or self.sequences, micro, self.lora_rank, self.logprob_chunk)


# ---------------------------------------------------------------------- the synthetic task


class LetterTokenizer:
    """Stands in for a tokenizer (random weights have no vocabulary): one letter per token id, so
    each completion is a distinct string with no digits or \\boxed{} and scoring costs nothing."""

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        letters = string.ascii_lowercase
        return ["".join(letters[t % 26] for t in seq) for seq in sequences]


def synthetic_reward(completion: str, problem: Problem) -> float:
    """A reward in [0, 1) that differs between any two different completions: every group has a
    spread, so the advantages, the loss and its backward are real work."""
    return zlib.crc32(completion.encode()) / 2**32


def _prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Stay clear of the special tokens at the top of Qwen's vocabulary.
    return torch.randint(0, min(vocab, 150000), (count, length), generator=gen).tolist()


def train_config(s: StepSettings, micro: int, prompts: int, group: int, new_tokens: int) -> TrainSection:
    """The recipe's `train` section the step runs, built and validated as a recipe's is: its
    defaults, with the step's sizes, sampling at temperature 1 without top-p/top-k, the DAPO loss,
    the synthetic reward alone, no evaluation and no checkpoints."""
    return TrainSection(
        eval_data=None, eval_limit=0, steps=1, prompts_per_step=prompts, group_size=group, max_new_tokens=new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, loss="dapo", micro_batch_size=micro, lr=s.lr,
        gradient_checkpointing=True, adapter=s.adapter, lora={"rank": s.lora_rank, "alpha": 2.0 * s.lora_rank},
        rewards={"accuracy": 0.0, "format": 0.0, "custom": [SYNTHETIC_REWARD]}, checkpoint_every=0, seed=0,
    )


def _trainer(model: Decoder, engine: Engine, prompts: list[list[int]], cfg: TrainSection,
             logprob_chunk: int) -> Trainer:
    problems = [Problem(f"synthetic:{i}", "", "0", "arithmetic") for i in range(len(prompts))]
    # No stop ids: every response runs to max_new_tokens.
    return Trainer(model, engine, LetterTokenizer(), problems, prompts, cfg, stop_token_ids=(),
                   logprob_chunk=logprob_chunk)


# ---------------------------------------------------------------------- GPU bookkeeping


def _cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def _sync(device: str) -> None:
    if _cuda(device):
        torch.cuda.synchronize()


def _free(device: str) -> None:
    """Return everything the last configuration held to the driver and restart the peak counters."""
    gc.collect()
    if _cuda(device):
        from qerl_pipe.kernels.dequant_gemm import release_scratch

        release_scratch()  # sized by the last model's largest layer
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peaks(device: str) -> dict[str, int | None]:
    if not _cuda(device):
        return {"allocated": None, "reserved": None}
    return {"allocated": torch.cuda.max_memory_allocated(), "reserved": torch.cuda.max_memory_reserved()}


def _free_bytes(device: str) -> int | None:
    return torch.cuda.mem_get_info()[0] if _cuda(device) else None


def _gib(n: int | None) -> float | None:
    return None if n is None else round(n / GIB, 3)


# ---------------------------------------------------------------------- one configuration


def _warm_up(model: Decoder, engine: Engine, prompts: list[list[int]], s: StepSettings, micro: int,
             device: str) -> dict[str, Any]:
    """A small trainer step, then every decode graph. The step's training micro-batch (2 x 288
    tokens by default) lies past 512 rows like the timed one's, in the 4-bit kernels' last M
    bucket, so the Triton kernels the timed prefill and training use are compiled here; the
    captures cover every (batch, length) the timed rollout decodes at."""
    cfg = train_config(s, micro, s.warmup_prompts, s.warmup_group_size, s.warmup_tokens)
    t0 = time.perf_counter()
    _trainer(model, engine, prompts, cfg, s.logprob_chunk).step()  # its optimizer goes with it
    _sync(device)
    t1 = time.perf_counter()
    graphs = engine.capture_graphs()
    _sync(device)
    return {
        "what": (f"one trainer step of {s.warmup_prompts} prompt x {s.warmup_group_size} samples x "
                 f"{s.warmup_tokens} new tokens (prefill, decode, scoring, logprobs, backward, AdamW), "
                 "then capture of every decode CUDA graph (batch size x attention length)"),
        "step_s": t1 - t0, "graphs_captured": graphs, "capture_s": time.perf_counter() - t1,
        "peak_allocated_bytes_since_build": _peaks(device)["allocated"],
    }


def _lora_param_bytes(model: Decoder) -> int:
    return sum(p.numel() * p.element_size() for p in lora_parameters(model))


def _optimizer_bytes(trainer: Trainer) -> int:
    """AdamW's moments, and under full fine-tuning the float32 masters it steps (not model weights)."""
    moments = sum(t.numel() * t.element_size() for state in trainer.optimizer.state.values()
                  for t in state.values() if isinstance(t, torch.Tensor))
    full = trainer.full
    masters = sum(m.numel() * 4 for m, w in zip(full.masters, full.weights) if m is not w) if full else 0
    return moments + masters


def measure_step(config: Mapping[str, Any], quant: str, s: StepSettings, size: StepSize,
                 device: str) -> dict[str, Any]:
    """Build, warm up, time one step; every figure of a row that ran."""
    t0 = time.perf_counter()
    lora = LoraSpec(rank=s.lora_rank, alpha=2.0 * s.lora_rank) if s.adapter == "lora" else None
    model = init_random_model(config, base_format=quant, device=device, lora=lora)
    _sync(device)
    build_s, build_peak = time.perf_counter() - t0, _peaks(device)["allocated"]
    limits = plan_limits(model.config, max_seq_len=size.seq_len, max_batch=size.kv_slots,
                         cuda_graphs=_cuda(device))
    engine = Engine(model, limits)
    prompts = _prompts(s.prompts, s.prompt_len, model.config.vocab_size)
    warmup = _warm_up(model, engine, prompts, s, size.micro_batch, device)

    cfg = train_config(s, size.micro_batch, s.prompts, s.group_size, s.response_len)
    trainer = _trainer(model, engine, prompts, cfg, s.logprob_chunk)
    _sync(device)
    t0 = time.perf_counter()
    m = trainer.step()  # resets the peak counters at its start
    _sync(device)
    step_s = time.perf_counter() - t0
    peaks = _peaks(device)
    # The trainer's clock stops before the last optimizer kernels finish; the synchronised tail
    # belongs to training: train = whole step - (noise draw, rollouts, scoring).
    train_s = step_s - (m["step_seconds"] - m["train_seconds"])
    rollout_tokens = s.sequences * round(m["response_length_mean"])
    lora_bytes = _lora_param_bytes(model) if s.adapter == "lora" else 0  # full: the weights are the model's
    resident = model_memory_bytes(model)
    return {
        "build_s": build_s, "build_peak_allocated_bytes": build_peak, "warmup": warmup,
        "rollout_s": m["rollout_seconds"], "train_s": train_s, "step_s": step_s,
        "rollout_tokens": rollout_tokens, "rollout_tokens_per_s": m["rollout_tokens_per_s"],
        "train_tokens": m["train_tokens"], "train_tokens_per_s": m["train_tokens"] / train_s,
        "all_responses_full_length": m["response_length_mean"] == s.response_len and m["truncation_rate"] == 1.0,
        "peak_allocated_bytes": peaks["allocated"], "peak_reserved_bytes": peaks["reserved"],
        "peak_allocated_gib": _gib(peaks["allocated"]), "peak_reserved_gib": _gib(peaks["reserved"]),
        "model_resident_bytes": resident, "model_resident_gib": _gib(resident),
        "base_weights_bytes": resident - lora_bytes, "lora_param_bytes": lora_bytes,
        "optimizer_state_bytes": _optimizer_bytes(trainer), "kv_cache_bytes": limits.kv_cache_bytes,
        "cuda_graphs": engine.uses_cuda_graphs,
        "loss": m["loss"], "grad_norm": m["grad_norm"], "reward_std": m["reward_std"],
    }


def bench_config(name: str, config: Mapping[str, Any], quant: str, s: StepSettings, device: str = "cuda",
                 memory_limit_bytes: int | None = None) -> dict[str, Any]:
    """One row: measured, or why not (does not fit, out of memory, another error)."""
    _free(device)
    size = s.size(name)
    estimate = estimate_step_bytes(DecoderConfig.from_hf(config), quant, size, s.adapter)
    limit = memory_limit_bytes if memory_limit_bytes is not None else _free_bytes(device)
    row: dict[str, Any] = {"shape": name, "quant": quant, "adapter": s.adapter, "micro_batch": size.micro_batch,
                           "kv_slots": size.kv_slots, "estimate_bytes": estimate,
                           "estimate_gib": _gib(estimate["total"]), "memory_limit_bytes": limit}
    if limit is not None and estimate["total"] > limit:
        return {**row, "fits": False, "status": "does-not-fit", "asked_bytes": estimate["total"]}
    try:
        return {**row, "fits": True, "status": "ok", **measure_step(config, quant, s, size, device)}
    except torch.cuda.OutOfMemoryError as e:
        failed = {**row, "fits": False, "status": "oom", "error": str(e).splitlines()[0][:500],
                  "asked_bytes": estimate["total"]}
    except Exception as e:  # noqa: BLE001 - one broken configuration must not lose the others' data
        failed = {**row, "fits": None, "status": "error", "error": f"{type(e).__name__}: {e}"[:1000],
                  "traceback": traceback.format_exc()[-3000:]}
    # Outside the except block: the traceback, and with it the model, is released by now.
    _free(device)
    return failed


# ---------------------------------------------------------------------- targets and the run


def _row(rows: list[dict], shape: str, quant: str) -> dict | None:
    """The LoRA row of (shape, quant): the targets compare LoRA arms (full fine-tuning rows are extra)."""
    return next((r for r in rows if r["shape"] == shape and r["quant"] == quant
                 and r.get("adapter", "lora") == "lora"), None)


def _gb(gib: float | None) -> float | None:
    return None if gib is None else round(gib * GIB / 1e9, 2)


def _peak_target(rows: list[dict], shape: str, limit_gb: float, what: str) -> list[dict]:
    """The issue states memory targets in GB (10^9 bytes, as GPU memory is sold); rows hold GiB."""
    r = _row(rows, shape, "nvfp4")
    if r is None:
        return []
    if r["status"] != "ok":  # did not run: the estimate is what it asked for
        return [target(f"{shape} NVFP4 RL step {what} (did not run: {r['status']}; measured = estimated need)",
                       f"< {limit_gb} GB", _gb(r["estimate_gib"]), "GB", False)]
    peak = _gb(r["peak_reserved_gib"])
    return [target(f"{shape} NVFP4 RL step {what} (peak reserved)", f"< {limit_gb} GB", peak, "GB",
                   peak is not None and peak < limit_gb)]


def targets(rows: list[dict]) -> list[dict]:
    out = _peak_target(rows, "qwen2.5-32b", 40, "peak GPU memory")
    out += _peak_target(rows, "qwen2.5-72b", 135, "fits on one H200")
    fp4, bf16 = _row(rows, "qwen2.5-7b", "nvfp4"), _row(rows, "qwen2.5-7b", "bf16")
    if fp4 and bf16 and fp4["status"] == bf16["status"] == "ok":
        ratio = bf16["step_s"] / fp4["step_s"]
        out.append(target("qwen2.5-7b RL step: NVFP4 over bf16 LoRA (step time, same run)", ">= 1.5x",
                          round(ratio, 3), "x", ratio >= 1.5))
    return out


def speedups(rows: list[dict]) -> list[dict]:
    """Per shape with both bases measured: bf16 time over NVFP4 time, per phase."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        fp4, bf16 = _row(rows, shape, "nvfp4"), _row(rows, shape, "bf16")
        if fp4 and bf16 and fp4["status"] == bf16["status"] == "ok":
            out.append({"shape": shape, **{k: round(bf16[f"{k}_s"] / fp4[f"{k}_s"], 3)
                                           for k in ("rollout", "train", "step")}})
    return out


def _settings(s: StepSettings) -> dict[str, Any]:
    return {**asdict(s), "sampling": "temperature 1.0, no top-p/top-k, no stop token (every response "
            "runs to response_len)", "reward": "synthetic: crc32 of the response text, in [0, 1)",
            "loss": "dapo, mu 1, no KL, AQN schedule stage 0",
            "optimizer": ("AdamW on float32 masters of every weight, clip 1.0" if s.adapter == "full"
                          else "AdamW on the fp32 LoRA, clip 1.0"),
            "lora_alpha": 2 * s.lora_rank, "gradient_checkpointing": True}


def _summary(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['shape']} {r['quant']}: {r['status']} (needs ~{r['estimate_gib']} GiB) {r.get('error', '')}"
    return (f"{r['shape']} {r['quant']}: step {r['step_s']:.1f} s = rollout {r['rollout_s']:.1f} s "
            f"({r['rollout_tokens_per_s']:.0f} tok/s) + train {r['train_s']:.1f} s "
            f"({r['train_tokens_per_s']:.0f} tok/s), peak {r['peak_reserved_gib']} GiB reserved")


def run_train_step_bench(shapes: Sequence[str], quants: Sequence[str], s: StepSettings = StepSettings(),
                         device: str = "cuda", memory_limit_bytes: int | None = None, out: Path | None = None,
                         shape_configs: Mapping[str, Mapping[str, Any]] = QWEN25_SHAPES,
                         emit: Callable[[str], None] = lambda line: print(line, flush=True)) -> dict[str, Any]:
    """Every (shape, quant) in order; after each, `emit` gets its JSON line and `out` is rewritten."""
    unknown = [q for q in quants if q not in QUANTS] + [n for n in shapes if n not in shape_configs]
    if unknown:
        raise QerlError(f"unknown {unknown}: shapes are {sorted(shape_configs)}, quants {list(QUANTS)}")
    if s.adapter not in ("lora", "full") or (s.adapter == "full" and set(quants) != {"bf16"}):
        raise QerlError(f"--adapter {s.adapter} with --quant {','.join(quants)}: the adapter is lora or full, and "
                        "full fine-tuning trains a bf16 base only (pass --quant bf16)")
    if _cuda(device) and not torch.cuda.is_available():
        raise QerlError("bench train-step measures a GPU training step and needs a CUDA GPU; none is visible here")
    rows: list[dict] = []

    def result() -> dict[str, Any]:
        return results_file(rows, targets(rows), settings=_settings(s), torch=torch.__version__,
                            nvfp4_over_bf16=speedups(rows))

    latest = result()
    for name in shapes:
        for quant in quants:
            rows.append(bench_config(name, shape_configs[name], quant, s, device, memory_limit_bytes))
            print(_summary(rows[-1]), file=sys.stderr, flush=True)
            emit(json.dumps(rows[-1]))
            latest = result()  # one dict for the file and the caller: its date is taken once
            if out is not None:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(latest, indent=1) + "\n")
    return latest
