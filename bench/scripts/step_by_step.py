"""Three RL steps in a row after the bench's warm-up, each micro-batch of each step timed: is the
training phase of the first step slower than that of the next ones, and where.

`bench train-step` times the first step after a short warm-up step (32-token responses). On the
7B NVFP4 model that step's training phase measured 13.45 s where a second step, profiled, took
11.38 s (bf16: 11.15 s and 11.25 s; H100, bench/results/profiles/train-step-profile-7b-h100.json).
This script runs the bench's own configuration (same build, warm-up, planner sizes and trainer)
for `--steps` steps and records, per step, the rollout and training seconds and the wall time of
each training micro-batch (CUDA-synchronised at each micro-batch's start), and profiles the
training phase of the steps named by `--profile-steps` with torch.profiler (kernel time by kind).

python3 bench/scripts/step_by_step.py --bases nvfp4,bf16 --steps 3 --profile-steps 1 --out FILE.json

The targets (issue 31's, for the 7B step at 8 x 8, 256 + 1024) compare the steady state: the
median over the unprofiled steps after the first, NVFP4 against bf16 of the same run. The first
step's training phase is reported beside them (a one-time cost on NVFP4 that the later steps do
not pay). `--targets-only FILE` recomputes the targets block of a file this script wrote.
"""
import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from qerl_lab.kernel_kinds import profile_kinds
from qerl_pipe.model.random_init import init_random_model
from qerl_lab.results import results_file, target
from qerl_pipe.model.shapes import QWEN25_SHAPES
from qerl_lab.train_step import StepSettings, _prompts, _trainer, _warm_up, train_config
from qerl_pipe.engine import Engine, plan_limits
from qerl_pipe.kernels import dispatch
from qerl_pipe.memory.step import StepSize
from qerl_pipe.model.lora import LoraSpec


def steady(row: dict, key: str) -> float | None:
    """The median of `key` over the unprofiled steps after the first (None with fewer than 2 steps)."""
    later = [s[key] for s in row["steps"][1:] if not s["profiled"]]
    return statistics.median(later) if later else None


def targets(rows: list[dict]) -> list[dict]:
    by_base = {r["base"]: r for r in rows}
    fp4, bf16 = by_base.get("nvfp4"), by_base.get("bf16")
    if fp4 is None or bf16 is None or steady(fp4, "step_s") is None or steady(bf16, "step_s") is None:
        return []
    step = steady(bf16, "step_s") / steady(fp4, "step_s")
    train = steady(bf16, "train_s") / steady(fp4, "train_s")
    first = bf16["steps"][0]["train_s"] / fp4["steps"][0]["train_s"]
    what = f"{fp4['shape']} RL step 8 x 8, 256 + 1024, steady state (median of steps 2-{len(fp4['steps'])})"
    return [target(f"{what}: NVFP4 over bf16 LoRA, step time", ">= 1.10x", round(step, 3), "x", step >= 1.10),
            target(f"{what}: training phase NVFP4 over bf16", ">= 0.95x", round(train, 3), "x", train >= 0.95),
            target(f"{fp4['shape']} first step's training phase NVFP4 over bf16 (one-time costs included)",
                   ">= 0.95x", round(first, 3), "x", first >= 0.95)]


if "--targets-only" in sys.argv:  # recompute the targets of a file this script wrote
    path = Path(sys.argv[sys.argv.index("--targets-only") + 1])
    data = json.loads(path.read_text())
    data["targets"] = targets(data["results"])
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(json.dumps(data["targets"], indent=1))
    sys.exit(0)

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(QWEN25_SHAPES))
ap.add_argument("--bases", default="nvfp4,bf16")
ap.add_argument("--steps", type=int, default=3)
ap.add_argument("--profile-steps", default="", help="1-based steps whose training phase is profiled")
ap.add_argument("--host-top", type=int, default=0, help="with --profile-steps: also the host ops with most self time")
ap.add_argument("--micro-batch", type=int, default=8)
ap.add_argument("--out", type=Path, required=True)
args = ap.parse_args()
profiled_steps = {int(s) for s in args.profile_steps.split(",") if s}


# Garbage collections over 50 ms (a stall inside a step that is neither a kernel nor an operator).
gc_pauses: list[dict] = []
_gc_start: list[float] = []


def _gc_watch(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_start[:] = [time.perf_counter()]
    elif _gc_start and (ms := (time.perf_counter() - _gc_start[0]) * 1e3) > 50:
        gc_pauses.append({"generation": info["generation"], "ms": round(ms, 1), "collected": info["collected"]})


gc.callbacks.append(_gc_watch)


def sync() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def run_base(base: str) -> dict:
    s = StepSettings(micro_batch=args.micro_batch)
    size = StepSize(sequences=s.sequences, seq_len=s.prompt_len + s.response_len, prompt_len=s.prompt_len,
                    prompts=s.prompts, kv_slots=s.sequences, micro_batch=args.micro_batch,
                    lora_rank=s.lora_rank, logprob_chunk=s.logprob_chunk)
    dispatch.configure(dispatch.table_for(torch.device("cuda")), deterministic=True)
    model = init_random_model(QWEN25_SHAPES[args.shape], base_format=base, device="cuda",
                              lora=LoraSpec(rank=s.lora_rank, alpha=2.0 * s.lora_rank))
    limits = plan_limits(model.config, max_seq_len=size.seq_len, max_batch=size.kv_slots, cuda_graphs=True)
    engine = Engine(model, limits)
    prompts = _prompts(s.prompts, s.prompt_len, model.config.vocab_size)
    warmup = _warm_up(model, engine, prompts, s, size, "cuda")
    cfg = train_config(s, size.micro_batch, s.prompts, s.group_size, s.response_len)
    # One more step in the schedule than run, so every step is inside the AQN schedule.
    trainer = _trainer(model, engine, prompts, cfg.model_copy(update={"steps": args.steps + 1}), size.logprob_chunk)
    marks: list[float] = []
    logprobs, update = trainer._logprobs, trainer._update

    def timed_logprobs(batch):
        marks.append(sync())
        return logprobs(batch)

    trainer._logprobs = timed_logprobs
    steps = []
    for k in range(1, args.steps + 1):
        marks.clear()
        gc_pauses.clear()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        profile: dict = {}

        def phase(groups):
            if k not in profiled_steps:
                out = update(groups)
                marks.append(sync())
                return out
            out, profile["p"] = profile_kinds(lambda: update(groups), cpu_top=args.host_top)
            marks.append(sync())
            return out

        trainer._update = phase
        t0 = sync()
        m = trainer.step()
        step_s = sync() - t0
        micro = [round(b - a, 4) for a, b in zip(marks, marks[1:])]
        row = {"step": k, "step_s": step_s, "rollout_s": m["rollout_seconds"],
               "train_s": step_s - (m["step_seconds"] - m["train_seconds"]),
               "micro_batch_s": micro, "profiled": k in profiled_steps, "gc_pauses": list(gc_pauses),
               "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries}
        if profile:
            row["train_profile"] = profile["p"]
        print(base, json.dumps({kk: v for kk, v in row.items() if kk != "train_profile"}), flush=True)
        if profile:
            print(base, "profile", json.dumps({kk: profile["p"][kk] for kk in ("wall_ms", "kernel_ms", "ms_by_kind")}),
                  flush=True)
            for op in profile["p"].get("host_top_ops", [])[:12]:
                print(base, "host", json.dumps(op), flush=True)
        steps.append(row)
    return {"base": base, "shape": args.shape, "warmup": warmup, "steps": steps}


rows = []
for base in args.bases.split(","):
    rows.append(run_base(base))
    torch.cuda.empty_cache()
args.out.parent.mkdir(parents=True, exist_ok=True)
args.out.write_text(json.dumps(results_file(rows, targets(rows), settings=vars(args) | {"out": None}), indent=1,
                               default=str) + "\n")
