"""Data-parallel scaling of the RL step: training steps/s on 1 GPU vs N GPUs, same global batch.

`qerl-pipe bench train-scaling --shape qwen2.5-7b --nproc 1,2 --out FILE.json` launches, for each
process count, `python -m torch.distributed.run --standalone --nproc-per-node N -m
qerl_lab.train_scaling --worker ...` (NVLink multicast off), where every rank builds a
random-init NVFP4 model of the shape with LoRA and runs `Trainer.step()` on its share of B
prompts x G samples (rollouts to the full max_new_tokens: no stop token, so every step does the
same work). Rank 0 times the steps after warm-up and writes one row; the driver collects the rows
into a results file whose target is the issue's: 2 GPUs >= 1.8x the steps/s of 1.

Strong scaling (the global batch stays B): per GPU the rollout batch halves, and a decode step
of a memory-bound model costs nearly the same at half the batch, so the rollout part scales less
than the training part; the rows report both times so the reason for a miss is visible.
`--device cpu --shape tiny` runs the same code with gloo on a CPU (a smoke test, not a figure).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from qerl_lab.results import nulls_for_non_finite, results_file, target
from qerl_pipe.model.shapes import QWEN25_SHAPES
from qerl_pipe.rl.loop.distributed import disable_nvls
from qerl_pipe.strict_json import write_json

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}
SHAPES: dict[str, dict[str, Any]] = {"tiny": TINY, **QWEN25_SHAPES}
TARGET_SPEEDUP = 1.8  # issue 8: 2 GPUs >= 1.8x the steps/s of 1


class _IdsAsText:
    """The one tokenizer call the trainer makes on a random model: token ids as text."""

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [" ".join(map(str, ids)) for ids in sequences]


def even_token_share(completion: str, problem) -> float:
    """A reward with a spread on random text (the share of even token ids), so no group is flat
    and every step trains."""
    ids = completion.split()
    return sum(int(t) % 2 == 0 for t in ids) / max(1, len(ids))


def measure(shape: str, device: str, prompts_per_step: int, group_size: int, prompt_len: int, new_tokens: int,
            steps: int, warmup: int, lora_rank: int, micro_batch_size: int) -> dict[str, Any]:
    """Run warm-up + timed RL steps on this rank's share; returns rank 0's row (others: {})."""
    from qerl_pipe.engine import Engine, plan_limits
    from qerl_pipe.model.config import DecoderConfig
    from qerl_pipe.model.random_init import init_random_model
    from qerl_pipe.model.lora import LoraSpec
    from qerl_pipe.jobs.train_config import train_config
    from qerl_pipe.recipe import TrainSection
    from qerl_pipe.rl.loop.distributed import init_distributed
    from qerl_pipe.rl.task.tasks import load_problems
    from qerl_pipe.rl.loop.trainer import Trainer
    from qerl_pipe.hf import pick_device

    dist, device_name = init_distributed(device)
    dev = pick_device(device_name)
    config = SHAPES[shape]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = init_random_model(config, "nvfp4", device=dev, dtype=dtype, lora=LoraSpec(lora_rank, 2 * lora_rank))
    per_rank = prompts_per_step // dist.world_size * group_size
    limits = plan_limits(DecoderConfig.from_hf(config), max_seq_len=prompt_len + new_tokens, max_batch=per_rank,
                         dtype=dtype, cuda_graphs=dev.type == "cuda")
    section = TrainSection.model_validate({
        "steps": warmup + steps, "prompts_per_step": prompts_per_step, "group_size": group_size,
        "max_new_tokens": new_tokens, "micro_batch_size": micro_batch_size, "lora": {"rank": lora_rank},
        "rewards": {"accuracy": 0.0, "custom": [f"{__name__}:even_token_share"]}})
    problems = load_problems("arithmetic:256", seed=0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config["vocab_size"], (prompt_len,), generator=gen).tolist() for _ in problems]
    trainer = Trainer(model, Engine(model, limits), _IdsAsText(), problems, prompts, train_config(section), (),
                      dist=dist)
    for _ in range(warmup):  # kernels, CUDA graphs, allocator
        trainer.step()
    dist.barrier()
    t0 = time.perf_counter()
    records = [trainer.step() for _ in range(steps)]
    dist.barrier()
    seconds = time.perf_counter() - t0
    if not dist.is_main:
        return {}

    def mean(key: str) -> float:
        return sum(r[key] for r in records) / len(records)

    return {
        "shape": shape, "processes": dist.world_size, "device": str(dev), "steps": steps,
        "steps_per_s": steps / seconds, "step_seconds_mean": seconds / steps,
        "rollout_seconds_mean": mean("rollout_seconds"), "train_seconds_mean": mean("train_seconds"),
        "prompts_per_step": prompts_per_step, "group_size": group_size, "sequences_per_rank": per_rank,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "lora_rank": lora_rank,
        "micro_batch_size": micro_batch_size,
        "peak_gpu_memory_gib": max((r["peak_gpu_memory_gib"] or 0.0) for r in records) if dev.type == "cuda" else None,
    }


def scaling_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's target, when both a 1- and a 2-process row exist."""
    by_n = {r["processes"]: r for r in rows}
    if 1 not in by_n or 2 not in by_n:
        return []
    speedup = by_n[2]["steps_per_s"] / by_n[1]["steps_per_s"]
    return [target(f"2 processes vs 1, RL steps/s at the same global batch ({by_n[1]['shape']})",
                   f">= {TARGET_SPEEDUP}x", round(speedup, 3), "x", speedup >= TARGET_SPEEDUP)]


def run_train_scaling_bench(shape: str, nprocs: list[int], device: str = "cuda", prompts_per_step: int = 32,
                            group_size: int = 8, prompt_len: int = 128, new_tokens: int = 256, steps: int = 3,
                            warmup: int = 1, lora_rank: int = 32, micro_batch_size: int = 32) -> dict[str, Any]:
    """One torchrun launch per process count; the rows and the scaling target as a results file."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r} is unknown; choose one of {sorted(SHAPES)}")
    worker_args = [f"--shape={shape}", f"--device={device}", f"--prompts-per-step={prompts_per_step}",
                   f"--group-size={group_size}", f"--prompt-len={prompt_len}", f"--new-tokens={new_tokens}",
                   f"--steps={steps}", f"--warmup={warmup}", f"--lora-rank={lora_rank}",
                   f"--micro-batch-size={micro_batch_size}"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in nprocs:
            out = Path(tmp) / f"row-{n}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                       "-m", __name__, "--worker", f"--out={out}", *worker_args]
            subprocess.run(command, env=disable_nvls(dict(os.environ)), check=True)
            rows.append(json.loads(out.read_text()))
    return results_file(rows, scaling_targets(rows))


def worker_main(argv: list[str] | None = None) -> None:
    """The torchrun worker `run_train_scaling_bench` launches (`python -m qerl_lab.train_scaling
    --worker ...`): torchrun starts a module, so this is its entry; users run `qerl-pipe bench
    train-scaling`."""
    ap = argparse.ArgumentParser(description="(internal) one torchrun process: measure, rank 0 writes --out")
    ap.add_argument("--worker", action="store_true", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--device", required=True, choices=["cuda", "cpu"])
    for name in ("prompts-per-step", "group-size", "prompt-len", "new-tokens", "steps", "warmup", "lora-rank",
                 "micro-batch-size"):
        ap.add_argument(f"--{name}", type=int, required=True)
    a = ap.parse_args(argv)
    from qerl_pipe.rl.loop.distributed import group_lifetime

    with group_lifetime():
        row = measure(a.shape, a.device, prompts_per_step=a.prompts_per_step, group_size=a.group_size,
                      prompt_len=a.prompt_len, new_tokens=a.new_tokens, steps=a.steps, warmup=a.warmup,
                      lora_rank=a.lora_rank, micro_batch_size=a.micro_batch_size)
        if row:
            write_json(a.out, nulls_for_non_finite(row), indent=None)


if __name__ == "__main__":
    worker_main()
