"""Where one training micro-batch spends its GPU time, NVFP4 vs bf16, summarised by kernel kind.

The trainer's work per micro-batch, at a Qwen2.5 shape with random weights and LoRA r32 on all
seven projections: the no-grad log-prob pass (the old policy's logprobs) and the training pass
(forward with gradient checkpointing through `rl.logprobs.sequence_logprobs`, the LM head in
chunks, backward into the adapter). Each pass is timed with CUDA events (median of --reps after a
warm-up), then profiled once with torch.profiler; CUDA kernel time is grouped by kind (cuBLAS
GEMMs, humming GEMMs, our W4A16 kernels, attention, elementwise/reductions, copies) so the two
bases compare kind by kind.

python3 bench/scripts/train_profile.py --shape qwen2.5-7b --bases nvfp4,bf16 --out FILE.json
"""
import argparse
import json
import statistics
from pathlib import Path

import torch

from qerl_lab.kernel_kinds import profile_kinds
from qerl_pipe.model.random_init import init_random_model
from qerl_lab.results import results_file
from qerl_pipe.model.shapes import QWEN25_SHAPES
from qerl_pipe.model.lora import LoraSpec
from qerl_pipe.rl.algo.logprobs import sequence_logprobs

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(QWEN25_SHAPES))
ap.add_argument("--bases", default="nvfp4,bf16")
ap.add_argument("--micro-batch", type=int, default=8)
ap.add_argument("--prompt-len", type=int, default=256)
ap.add_argument("--response-len", type=int, default=1024)
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--out", type=Path, required=True)
args = ap.parse_args()

def batch(vocab: int, device: str) -> tuple:
    gen = torch.Generator(device=device).manual_seed(0)
    t = args.prompt_len + args.response_len
    ids = torch.randint(vocab, (args.micro_batch, t), device=device, generator=gen)
    mask = torch.ones_like(ids)
    resp = torch.zeros_like(ids)
    resp[:, args.prompt_len:] = 1
    return ids, mask, resp


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


rows = []
for base in args.bases.split(","):
    model = init_random_model(QWEN25_SHAPES[args.shape], base_format=base, device="cuda", lora=LoraSpec(32, 64.0))
    model.gradient_checkpointing = True
    ids, mask, resp = batch(model.config.vocab_size, "cuda")

    def scored() -> None:
        with torch.no_grad():
            sequence_logprobs(model, ids, mask, resp)

    def trained() -> None:
        logp, _ = sequence_logprobs(model, ids, mask, resp)
        (logp.sum() / resp.sum()).backward()

    row = {"base": base, "shape": args.shape, "tokens": ids.numel(),
           "logprob_pass_s": timed(scored), "train_pass_s": timed(trained)}
    row["logprob_pass_profile"] = profile_kinds(scored)[1]
    row["train_pass_profile"] = profile_kinds(trained)[1]
    print(json.dumps({k: v for k, v in row.items() if not k.endswith("profile")}), flush=True)
    for what in ("logprob_pass_profile", "train_pass_profile"):
        print(what, json.dumps(row[what]["ms_by_kind"]), flush=True)
    rows.append(row)
    del model
    torch.cuda.empty_cache()

ratio = {}
if len(rows) == 2:
    a, b = rows
    ratio = {f"{a['base']}_over_{b['base']}": {k: b[k] / a[k] for k in ("logprob_pass_s", "train_pass_s")}}
args.out.parent.mkdir(parents=True, exist_ok=True)
args.out.write_text(json.dumps(results_file(rows, [], settings=vars(args) | {"out": None}, speed=ratio), indent=1,
                               default=str) + "\n")
print(json.dumps(ratio))
