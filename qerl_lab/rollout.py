"""Rollout benchmark: HF transformers `generate` vs our engine in bf16 and NVFP4, at Qwen2.5 and
Qwen3-30B-A3B shapes (`qerl_pipe.model.shapes`).

`qerl-pipe bench rollout --shapes qwen2.5-7b --out FILE.json`. Random weights of the exact shapes; prompts
of `--prompt-len` random tokens, `--new-tokens` sampled tokens at temperature 1 with no stop
token (every sequence runs to the end), LoRA of rank `--lora-rank` on all seven projections
attached to our model (computed unmerged, as in training). For each batch size it reports
tokens/s, the mean decode-step time, and that time over the HBM lower bound: the bytes one step
must read (every weight once, LoRA, the KV cache of the mean context) at `--hbm-tbps`. In a
mixture-of-experts model a step reads only the experts its tokens are routed to: the bound counts
a sparse layer's experts at the share `batch` tokens of top-k routing reach on average when the
routing is uniform (1 - (1 - k/E)^batch; batch 1 of Qwen3-30B-A3B: 8 of 128).

HF `generate` is slow, so it runs `--hf-new-tokens` tokens (default 64): its decode-step time is
(t(N) - t(1)) / (N - 1), and its tokens/s is reported for that length (the prefill counts less
in ours, which makes the comparison slightly favour HF at batch 1-8).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qerl_pipe.model.random_init import init_random_model
from qerl_lab.results import nulls_for_non_finite, results_file, target
from qerl_pipe.model.shapes import SHAPES
from qerl_pipe.engine import Engine, SamplingParams
from qerl_pipe.errors import QerlError
from qerl_pipe.engine.limits import kv_bytes_per_token, plan_limits
from qerl_pipe.kernels import dispatch
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.load import model_memory_bytes
from qerl_pipe.model.lora import LoraSpec
from qerl_pipe.strict_json import write_json

GIB = 2**30


def _prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Stay clear of the special tokens at the top of Qwen's vocabulary.
    return torch.randint(0, min(vocab, 150000), (batch, length), generator=gen).tolist()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else float("nan")


def _lora_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)


def _expert_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the routed experts (`mlp.experts.E`) alone: no storage a tensor outside them
    shares (a decode buffer) is counted."""
    outside: set[tuple[torch.device, int]] = set()
    inside: dict[tuple[torch.device, int], int] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if ".mlp.experts." in f".{name}":
            inside[key] = storage.nbytes()
        else:
            outside.add(key)
    return sum(n for key, n in inside.items() if key not in outside)


def experts_read_share(config: DecoderConfig, batch: int) -> float:
    """The expected share of a sparse layer's experts that one decode step of `batch` tokens reads,
    each token routed to k of E experts uniformly at random: 1 - (1 - k/E)^batch (1.0: no experts)."""
    if not config.num_sparse_layers:
        return 1.0
    return 1.0 - (1.0 - config.experts_per_token / config.num_experts) ** batch


Emit = Callable[[dict], None]


def bench_hf(config: dict[str, Any], batches: list[int], prompt_len: int, new_tokens: int,
             emit: Emit = lambda row: None, device: str = "cuda") -> list[dict]:
    """HF transformers bf16 `generate` (sampling, no early stop) on a random model of `config`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    rows = []
    for batch in batches:
        _free()
        ids = torch.tensor(_prompts(batch, prompt_len, config["vocab_size"]), device=device)
        mask = torch.ones_like(ids)

        def run(n: int, hf: torch.nn.Module = model) -> float:
            _sync()
            t0 = time.perf_counter()
            hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                           top_k=0, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)
            _sync()
            return time.perf_counter() - t0

        run(2)  # warm-up
        t1, tn = run(1), run(new_tokens)
        rows.append({
            "impl": "hf-generate", "format": "bf16", "batch": batch, "new_tokens": new_tokens,
            "tokens_per_s": batch * new_tokens / tn, "decode_step_ms": 1e3 * (tn - t1) / (new_tokens - 1),
            "prefill_s": t1, "total_s": tn, "peak_gib": _peak_gib(),
        })
        print(_fmt(rows[-1]), flush=True)
        emit(rows[-1])
    del model, run
    _free()
    return rows


def bench_engine(config: dict[str, Any], base_format: str, batches: list[int], prompt_len: int,
                 new_tokens: int, lora_rank: int, hbm_tbps: float, device: str = "cuda",
                 emit: Emit = lambda row: None, kernel_copies: bool = True) -> list[dict]:
    """Our engine on a random model in `base_format` with LoRA attached, one row per batch size
    (`device="cpu"` only to smoke-test this code on tiny shapes). `kernel_copies=False`: no
    humming copies of NVFP4 weights, as a run whose memory plan leaves them out (a MoE's experts
    then decode from their 4-bit stacks)."""
    _free()
    label = base_format
    base_format, activations, kv_cache = parse_label(label)
    t0 = time.perf_counter()
    model = init_random_model(config, base_format=base_format, device=device,
                              lora=LoraSpec(rank=lora_rank, alpha=2 * lora_rank))
    _sync()
    build_s = time.perf_counter() - t0
    dcfg = DecoderConfig.from_hf(config)
    weight_bytes, lora_bytes, expert_bytes = model_memory_bytes(model), _lora_bytes(model), _expert_bytes(model)
    # A decode step reads every weight but the embedding table (only B rows of it), and of the
    # routed experts only those its tokens reach.
    embed_bytes = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    if dcfg.tie_word_embeddings:
        embed_bytes = 0
    rows = []
    for batch in batches:
        _free()
        share = experts_read_share(dcfg, batch)
        step_weight_bytes = weight_bytes - embed_bytes - expert_bytes + round(share * expert_bytes)
        limits = plan_limits(dcfg, max_seq_len=prompt_len + new_tokens, max_batch=batch,
                             cuda_graphs=device == "cuda", kv_cache=kv_cache)
        engine = Engine(model, limits, kernel_copies=kernel_copies, activations=activations)
        prompts = _prompts(batch, prompt_len, config["vocab_size"], seed=1)
        # Warm-up: compile the kernels this batch uses, then capture every decode graph (batch x
        # attended length) so that no capture lands in the timed run.
        engine.generate(prompts, 1, SamplingParams(temperature=1.0, max_new_tokens=min(8, new_tokens), seed=1))
        if engine.uses_cuda_graphs:
            engine.capture_graphs()
        _sync()
        t0 = time.perf_counter()
        out = engine.generate(prompts, 1, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=2))
        _sync()
        total = time.perf_counter() - t0
        generated = sum(out.lengths)
        step_s = out.decode_seconds / max(out.decode_steps, 1)
        mean_context = prompt_len + new_tokens / 2
        kv_bytes = batch * mean_context * kv_bytes_per_token(dcfg, model.dtype, kv_cache)
        bound_s = (step_weight_bytes + kv_bytes) / (hbm_tbps * 1e12)
        rows.append({
            "impl": "qerl-engine", "format": label, "batch": batch, "new_tokens": new_tokens,
            "kernel_copies": kernel_copies, "activations": engine.activations, "kv_cache": kv_cache,
            "kv_bytes_per_token": kv_bytes_per_token(dcfg, model.dtype, kv_cache), "fp8_copy_bytes": engine.fp8_copy_bytes,
            "generated_tokens": generated, "all_ran_to_length": generated == batch * new_tokens,
            "tokens_per_s": generated / total, "decode_step_ms": 1e3 * step_s,
            "decode_steps": out.decode_steps, "prefill_s": out.prefill_seconds, "total_s": total,
            "hbm_bound_step_ms": 1e3 * bound_s, "step_over_hbm_bound": step_s / bound_s,
            "step_bytes_weights": step_weight_bytes, "step_bytes_kv_mean": kv_bytes,
            "expert_bytes": expert_bytes, "experts_read_share": share, "model_bytes": weight_bytes, "lora_bytes": lora_bytes, "kv_cache_bytes": limits.kv_cache_bytes,
            "build_s": build_s, "peak_gib": _peak_gib(),
        })
        print(_fmt(rows[-1]), flush=True)
        emit(rows[-1])
        del engine, out
    del model
    _free()
    return rows


def parse_label(label: str) -> tuple[str, str, str]:
    """(base format, engine.activations, engine.kv_cache) of a format label: `BASE[+fp8][+fp8kv|+int8kv]`,
    "+fp8" for FP8 activations, "+fp8kv" / "+int8kv" for an E4M3 / INT8 KV cache."""
    base_format, *options = label.split("+")
    caches = [o.removesuffix("kv") for o in options if o in ("fp8kv", "int8kv")]
    if set(options) - {"fp8", "fp8kv", "int8kv"} or len(caches) > 1:
        raise QerlError(f"format {label!r}: unknown or repeated options; write BASE[+fp8][+fp8kv|+int8kv]")
    return base_format, "fp8" if "fp8" in options else "bf16", caches[0] if caches else "bf16"


def _fmt(r: dict) -> str:
    bound = f" bound {r['hbm_bound_step_ms']:.2f} ms ({r['step_over_hbm_bound']:.2f}x)" if "hbm_bound_step_ms" in r else ""
    return (f"{r['impl']:12} {r['format']:6} batch {r['batch']:4}: {r['tokens_per_s']:9.0f} tok/s, "
            f"step {r['decode_step_ms']:7.2f} ms{bound}, peak {r['peak_gib']:.1f} GiB")


def _row(rows: list[dict], shape: str, impl: str, fmt: str, batch: int) -> dict | None:
    return next((r for r in rows if r["shape"] == shape and r["impl"] == impl and r["format"] == fmt
                 and r["batch"] == batch), None)


# NVFP4 over our bf16 engine (tokens/s) per (shape, batch): the RL-step issue's 7B rows, the
# lean-decode-step issue's 32B rows, issue 35's Qwen3-30B-A3B rows; NVFP4 over NF4 (the QLoRA base, bitsandbytes' kernels where
# they win) at batch 8, QeRL's claim; and the batch-1 decode step over its HBM lower bound.
# Issue 47's FP8-activation rows: (shape, batch, label, base label) -> the tokens/s ratio wanted; the
# same bars for the whole FP8 rollout (activations and KV cache, issues 47 and 50 together).
FP8_TARGETS = {("qwen2.5-7b", 64, "nvfp4+fp8", "bf16"): ">= 1.3", ("qwen2.5-7b", 256, "nvfp4+fp8", "bf16"): ">= 1.2",
               ("qwen2.5-7b", 64, "nvfp4+fp8+fp8kv", "bf16"): ">= 1.3",
               ("qwen2.5-7b", 256, "nvfp4+fp8+fp8kv", "bf16"): ">= 1.2",
               ("qwen2.5-7b", 8, "nvfp4+fp8", "bf16+fp8"): ">= 1.6", ("qwen2.5-7b", 64, "nvfp4+fp8", "bf16+fp8"): ">= 1.0",
               ("qwen2.5-7b", 1, "nvfp4+fp8", "nvfp4"): ">= 0.98", ("qwen2.5-7b", 8, "nvfp4+fp8", "nvfp4"): ">= 0.98"}
# Issue 50's FP8 KV cache: the decode step's time with the FP8 cache over the same base's with
# bf16 (run with --prompt-len ~3.5-4k for its 4,096-token context).
KV_TARGETS = {("qwen2.5-7b", 256, "nvfp4+fp8kv", "nvfp4"): 0.85, ("qwen2.5-7b", 256, "bf16+fp8kv", "bf16"): 0.85,
              ("qwen2.5-7b", 256, "nvfp4+fp8+fp8kv", "nvfp4+fp8"): 0.85, ("qwen2.5-7b", 256, "nvfp4+int8kv", "nvfp4"): 0.85}
# Issue 50's 32B row: tokens/s at the slots the 80 GB plan gives each cache (BigMath paper setting:
# 16 with bf16 KV, 32 with FP8), run as one wave at the wave's mean context (--prompt-len ~4.6k).
PLAN_SLOT_TARGETS = {("qwen2.5-32b", "nvfp4+fp8kv", 32, "nvfp4", 16): 1.7, ("qwen2.5-32b", "nvfp4+int8kv", 32, "nvfp4", 16): 1.7}
SPEEDUP_TARGETS = {("qwen2.5-7b", 1): 1.9, ("qwen2.5-7b", 8): 1.8, ("qwen2.5-7b", 64): 1.25,
                   ("qwen2.5-7b", 256): 0.95, ("qwen2.5-32b", 8): 2.5, ("qwen2.5-32b", 64): 1.8,
                   ("qwen3-30b-a3b", 1): 1.5, ("qwen3-30b-a3b", 8): 1.4, ("qwen3-30b-a3b", 64): 1.1}
OVER_NF4_TARGETS = {("qwen2.5-7b", 8): 1.5, ("qwen2.5-32b", 8): 1.5}
BOUND_TARGETS = {("qwen2.5-7b", "nvfp4"): 1.8, ("qwen2.5-32b", "nvfp4"): 1.4, ("qwen2.5-7b", "bf16"): 1.6}


def targets(rows: list[dict]) -> list[dict]:
    out = []
    for wants, other, label in ((SPEEDUP_TARGETS, "bf16", "our bf16"), (OVER_NF4_TARGETS, "nf4", "NF4 (QLoRA's base)")):
        for (shape, batch), want in wants.items():
            fp4, base = (_row(rows, shape, "qerl-engine", f, batch) for f in ("nvfp4", other))
            if fp4 and base:
                ratio = fp4["tokens_per_s"] / base["tokens_per_s"]
                out.append(target(f"{shape} batch {batch}: NVFP4 tokens/s over {label}", f">= {want}x",
                                  round(ratio, 3), "x", ratio >= want))
    for (shape, fmt), want in BOUND_TARGETS.items():
        row = _row(rows, shape, "qerl-engine", fmt, 1)
        if row and "step_over_hbm_bound" in row:
            over = row["step_over_hbm_bound"]
            out.append(target(f"{shape} {fmt} batch 1: decode step over its HBM lower bound", f"<= {want}x",
                              round(over, 3), "x", over <= want))
    for (shape, batch, label, base_label), want in FP8_TARGETS.items():
        mine, base = _row(rows, shape, "qerl-engine", label, batch), _row(rows, shape, "qerl-engine", base_label, batch)
        if mine and base:
            ratio, least = mine["tokens_per_s"] / base["tokens_per_s"], float(want.split()[1])
            out.append(target(f"{shape} batch {batch}: {label} tokens/s over {base_label}", f"{want}x", round(ratio, 3),
                              "x", ratio >= least))
    out += kv_targets(lambda shape, label, batch: _row(rows, shape, "qerl-engine", label, batch),
                      lambda r: r["decode_step_ms"], lambda r: r["tokens_per_s"],
                      lambda r: f"mean context {r['step_bytes_kv_mean'] // max(1, r['batch'] * r['kv_bytes_per_token'])} tokens",
                      ("", "", " (tokens/s)"))
    ours, hf = _row(rows, "qwen2.5-7b", "qerl-engine", "bf16", 64), _row(rows, "qwen2.5-7b", "hf-generate", "bf16", 64)
    if ours and hf:
        ratio = ours["tokens_per_s"] / hf["tokens_per_s"]
        out.append(target("qwen2.5-7b batch 64: our bf16 engine over HF generate (tokens/s)", ">= 5x",
                          round(ratio, 2), "x", ratio >= 5))
    return out


def kv_targets(find: Callable[[str, str, int], dict | None], step_ms: Callable[[dict], float],
               per_s: Callable[[dict], float], context: Callable[[dict], str], how: tuple[str, str, str]) -> list[dict]:
    """Issue 50's targets over one bench's rows: `find(shape, label, batch)` a row or None; a coded
    cache's step (`step_ms`) over the bf16 cache's at one batch, and `per_s` at each cache's plan
    slots. `how`: what the names add after the step row, before and after the slots row's ratio."""
    out = []
    for (shape, batch, label, base_label), most in KV_TARGETS.items():
        mine, base = find(shape, label, batch), find(shape, base_label, batch)
        if mine and base:
            ratio = step_ms(mine) / step_ms(base)
            out.append(target(f"{shape} batch {batch}, {context(mine)}: {label} decode step over {base_label}'s{how[0]}",
                              f"<= {most}x", round(ratio, 3), "x", ratio <= most))
    for (shape, label, batch, base_label, base_batch), least in PLAN_SLOT_TARGETS.items():
        mine, base = find(shape, label, batch), find(shape, base_label, base_batch)
        if mine and base:
            ratio = per_s(mine) / per_s(base)
            out.append(target(f"{shape}{how[1]}: {label} at its plan's {batch} slots over {base_label} at {base_batch}{how[2]}",
                              f">= {least}x", round(ratio, 3), "x", ratio >= least))
    return out


def run_rollout_bench(shapes: list[str], batches: list[int], prompt_len: int = 256, new_tokens: int = 512,
                      hf_new_tokens: int = 64, hf_batches: list[int] | None = None, lora_rank: int = 32,
                      formats: tuple[str, ...] = ("bf16", "nvfp4"), hbm_tbps: float = 4.2,
                      partial: Path | None = None, kernels: str = "deterministic",
                      kernel_copies: bool = True) -> dict[str, Any]:
    """Every row, then the targets. `partial`: rewritten after each row, so a run cut short by a
    time limit still leaves what it measured. `kernels`: the NVFP4 dispatch column (deterministic
    or fast). `kernel_copies`: whether the engine makes humming's copies (`bench_engine`)."""
    if not torch.cuda.is_available():
        raise QerlError("bench rollout measures GPU generation and needs a CUDA GPU; none is visible here")
    device = torch.device("cuda", torch.cuda.current_device())
    dispatch.configure(dispatch.table_for(device), deterministic=kernels == "deterministic")
    settings = {"prompt_len": prompt_len, "new_tokens": new_tokens, "hf_new_tokens": hf_new_tokens,
                "lora_rank": lora_rank, "sampling": "temperature 1.0, no top-p/top-k, no stop token",
                "hbm_tbps_for_bound": hbm_tbps, "kernels": kernels, "kernel_copies": kernel_copies}
    rows: list[dict] = []

    def result() -> dict[str, Any]:
        return results_file(rows, targets(rows), settings=settings, torch=torch.__version__)

    for shape in shapes:
        config = SHAPES[shape]

        def emit(row: dict, shape: str = shape) -> None:
            rows.append({"shape": shape, **row})
            if partial is not None:
                partial.parent.mkdir(parents=True, exist_ok=True)
                write_json(partial, nulls_for_non_finite(result()), indent=1)

        if hf_batches != []:
            bench_hf(config, hf_batches or batches, prompt_len, hf_new_tokens, emit)
        for fmt in formats:
            bench_engine(config, fmt, batches, prompt_len, new_tokens, lora_rank, hbm_tbps, emit=emit,
                         kernel_copies=kernel_copies)
    return result()
