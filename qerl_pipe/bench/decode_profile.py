"""Where a decode step's time goes: kernels per step and the top kernels by GPU time.

`qerl-pipe bench decode-profile --shape qwen2.5-7b --format nvfp4 --batch 8` builds a
random model of the shape (LoRA attached), decodes eagerly (no CUDA graphs, so the profiler sees
each kernel) under torch.profiler, and prints the kernel count per step and the top kernels.
A development tool: the figures to quote come from `bench rollout`.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from qerl_pipe.bench.shapes import QWEN25_SHAPES
from qerl_pipe.engine import Engine, SamplingParams
from qerl_pipe.engine.limits import plan_limits
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.load import init_random_model
from qerl_pipe.model.lora import LoraSpec


def profile_decode(shape: str, base_format: str, batch: int, steps: int = 16, lora_rank: int = 32) -> None:
    config = QWEN25_SHAPES[shape]
    model = init_random_model(config, base_format=base_format, device="cuda",
                              lora=LoraSpec(rank=lora_rank, alpha=2 * lora_rank))
    limits = plan_limits(DecoderConfig.from_hf(config), max_seq_len=512, max_batch=batch)
    engine = Engine(model, limits, cuda_graphs=False)
    prompts = torch.randint(0, 150000, (batch, 64), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=steps, seed=0)
    engine.generate(prompts, 1, params)  # compile kernels
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = engine.generate(prompts, 1, params)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    per_step = out.decode_steps + 1  # plus the prefill
    print(f"{shape} {base_format} batch {batch}: {kernels} kernels over {per_step} forward passes "
          f"(~{kernels / per_step:.0f} per pass), GPU busy {gpu_us / 1e3:.1f} ms, "
          f"decode wall {1e3 * out.decode_seconds / max(out.decode_steps, 1):.2f} ms/step")
    print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70))
