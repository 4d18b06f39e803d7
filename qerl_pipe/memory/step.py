"""What one RL step of a model asks of the GPU, estimated from the config before anything is allocated
(exact counts, activations over-counted; its measured accuracy is in docs/engine.md, section "The
step's memory plan", and docs/training.md)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from qerl_pipe.engine.limits import kv_bytes_per_token
from qerl_pipe.kernels.base_formats import NVFP4, base_format as format_entry
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.full import full_training_bytes

# A base's stored bytes per weight and per linear are its entry's (kernels.base_formats): 4-bit
# codes plus one scale per block, and NVFP4's global scale or NF4's level table per linear; a
# dense base holds its linears in the model dtype.
# A LoRA parameter costs its fp32 value, its fp32 gradient and AdamW's two fp32 moments.
LORA_TRAIN_BYTES = 4 * 4
# cuBLAS workspaces, CUDA-graph pools, sampling buffers and allocator rounding.
SLACK_BYTES = 2**30


@dataclass(frozen=True)
class StepSize:
    """The work of one step: `sequences` rows of `seq_len` tokens; training in `micro_batch` rows."""

    sequences: int
    seq_len: int
    prompt_len: int
    prompts: int
    kv_slots: int
    micro_batch: int
    lora_rank: int
    logprob_chunk: int
    dense_base: bool = False  # a CPU run: the 4-bit base also held dequantized, once (model.dense_copy)
    lora_experts: bool = False  # MoE: LoRA on every routed expert too (recipe train.lora.experts)
    kv_cache: str = "bf16"  # the KV cache's format (engine.kv_cache)


def _model_linears(c: DecoderConfig, experts: bool = True) -> list[tuple[int, tuple[int, ...], int]]:
    """(in_features, output sizes, how many the model has) of every linear kind: attention in
    every layer, the dense MLP in the dense layers, each expert's in the sparse ones (all experts
    are resident; `experts=False` leaves them out, as LoRA does unless it targets them)."""
    sparse = c.num_sparse_layers
    out = [(k, tuple(n for _, n in projections), c.num_layers - (sparse if block == "mlp" else 0))
           for block, _, k, projections in c.layer_linears()]
    if sparse and experts:
        out += _expert_linears(c)
    return [row for row in out if row[2]]


def _expert_linears(c: DecoderConfig) -> list[tuple[int, tuple[int, ...], int]]:
    return [(k, tuple(n for _, n in projections), c.num_sparse_layers * c.num_experts)
            for _, _, k, projections in c.expert_linears()]


def _router_elements(c: DecoderConfig) -> int:
    return c.num_sparse_layers * c.num_experts * c.hidden_size


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def weight_bytes(c: DecoderConfig, base_format: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """The model without LoRA: base linears, embedding, LM head, norms, biases."""
    e = element_bytes(dtype)
    linear = sum(k * sum(outs) * n for k, outs, n in _model_linears(c))
    tables = c.vocab_size * c.hidden_size * e * (1 if c.tie_word_embeddings else 2) + _router_elements(c) * e
    # Norm weights in the model dtype with their fp32 AQN noise buffers; q/k/v biases for Qwen2.
    norms = (c.norms_per_layer * c.num_layers + 1) * c.hidden_size * (e + 4)
    bias = c.num_layers * (c.q_size + 2 * c.kv_size) * e if c.qkv_bias else 0
    fmt = format_entry(base_format)
    per_linear = sum(n for _, _, n in _model_linears(c)) * fmt.bytes_per_linear
    return int(linear * fmt.weight_bytes(e)) + tables + norms + bias + per_linear


def lora_params(c: DecoderConfig, rank: int, experts: bool = False) -> int:
    """Trainable LoRA elements on all seven projections (of every expert too, with `experts`)."""
    return sum(count * rank * (k + n) for k, outs, count in _model_linears(c, experts) for n in outs)


def lora_bytes(c: DecoderConfig, rank: int, dtype: torch.dtype = torch.bfloat16, experts: bool = False) -> int:
    """LoRA values, gradients and AdamW moments, plus the engine's fused copy in the model dtype
    (its B is block-diagonal over a layer's projections, so it is larger than the adapter itself)."""
    e = element_bytes(dtype)
    cache = sum(count * rank * len(outs) * (k + sum(outs)) for k, outs, count in _model_linears(c, experts)) * e
    return lora_params(c, rank, experts) * LORA_TRAIN_BYTES + cache


def weight_elements(c: DecoderConfig) -> int:
    """Every weight of the model (what full fine-tuning trains): linears, biases, norms, embedding,
    an untied LM head."""
    linear = sum(k * sum(outs) * n for k, outs, n in _model_linears(c)) + _router_elements(c)
    tables = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    norms = (c.norms_per_layer * c.num_layers + 1) * c.hidden_size + (2 * c.num_layers * c.head_dim if c.qk_norm else 0)
    i = c.intermediate_size
    bias = c.num_layers * ((c.q_size + 2 * c.kv_size) * c.qkv_bias + c.hidden_size * c.o_bias
                           + (2 * i + c.hidden_size) * c.mlp_bias)
    return linear + tables + norms + bias


def full_bytes(c: DecoderConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """Full fine-tuning of a bf16 model: a float32 master, gradient and two AdamW moments per weight
    (16 bytes), plus the bf16 gradient of the largest weight, alive until it is added to its master."""
    largest = max(c.vocab_size * c.hidden_size, max(k * sum(outs) for k, outs, _ in _model_linears(c)))
    return full_training_bytes(weight_elements(c), dtype) + largest * element_bytes(dtype)


def activation_bytes(c: DecoderConfig, s: StepSize, dtype: torch.dtype = torch.bfloat16) -> int:
    """Peak of the training pass of one micro-batch (larger than any rollout activation here)."""
    e = element_bytes(dtype)
    tokens = s.micro_batch * s.seq_len
    h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    mlp = 4 * i if c.num_sparse_layers < c.num_layers else 0
    if c.num_sparse_layers:
        # A sparse layer: k routed rows per token, each through an expert's gate/up and SiLU, and
        # the gathered input and weighted output rows ([tokens * k, hidden] each).
        k = c.experts_per_token
        mlp = max(mlp, k * (4 * c.moe_intermediate_size + 2 * h))
    kept = (c.num_layers + 1) * tokens * h * e  # checkpointing keeps each layer's input
    # One layer recomputed in backward: norms, q/k/v (k/v also repeated to every query head),
    # attention, the gate/up product and SiLU; x1.5 for the gradients alive beside them.
    layer = int(1.5 * tokens * e * (6 * h + 2 * (q + 2 * kv) + 3 * q + mlp))
    # LM head chunk: logits in the model dtype, fp32 logits, softmax and one fp32 temporary (x 152k vocab).
    chunk = min(s.logprob_chunk, tokens) * c.vocab_size * (e + 3 * 4)
    mask = s.micro_batch * s.seq_len * s.seq_len * (1 + e)
    return kept + layer + chunk + mask + 2 * tokens * h * e  # + the gathered hidden states


def scratch_bytes(c: DecoderConfig, base_format: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """The 4-bit large-M path decodes one linear at a time into a buffer of the model dtype (the
    largest bounds it); a MoE's grouped path decodes a projection's experts at once (`torch_grouped`)."""
    if format_entry(base_format).dense:
        return 0
    stacked = [c.num_experts * k * sum(outs) for k, outs, _ in _expert_linears(c)] if c.num_sparse_layers else []
    return max([k * sum(outs) for k, outs, _ in _model_linears(c)] + stacked) * element_bytes(dtype)


def _nvfp4_bytes(linears: Iterable[tuple[int, tuple[int, ...], int]]) -> int:
    """The NVFP4 bytes of `linears` (in_features, output sizes, count): a humming copy's."""
    return sum((int(k * sum(outs) * NVFP4.bytes_per_weight) + NVFP4.bytes_per_linear) * n for k, outs, n in linears)


def kernel_copy_bytes(c: DecoderConfig, shapes: Iterable[tuple[int, int]]) -> int:
    """An NVFP4 base's second copy in humming-kernels' layout, for the linears of shape (N, K) in
    `shapes` (those the dispatch table sends rows of to humming): the NVFP4 bytes again."""
    wanted = set(shapes)
    return _nvfp4_bytes(row for row in _model_linears(c) if (sum(row[1]), row[0]) in wanted)


def fp8_copy_bytes(c: DecoderConfig) -> int:
    """The FP8 copies of FP8 rollouts (`engine.fp8`): every attention and dense-MLP linear again at
    a byte per weight and an fp32 scale per output channel (not a MoE's experts)."""
    return sum((k + 4) * sum(outs) * n for k, outs, n in _model_linears(c, experts=False))


def expert_copy_bytes(c: DecoderConfig) -> int:
    """An NVFP4 MoE's experts stacked again in humming-kernels' layout for their grouped GEMMs
    (`model.kernel_copies`): the experts' NVFP4 bytes again; 0 for a dense model."""
    return _nvfp4_bytes(_expert_linears(c)) if c.num_sparse_layers else 0


def dense_base_bytes(c: DecoderConfig, dtype: torch.dtype) -> int:
    """A CPU run's copy of the 4-bit linears dequantized once into the model dtype (instead of at
    every call): every linear weight, in place of the shared decode buffer."""
    return sum(k * sum(outs) * n for k, outs, n in _model_linears(c)) * element_bytes(dtype)


def estimate_step_bytes(c: DecoderConfig, base_format: str, s: StepSize, adapter: str = "lora",
                        dtype: torch.dtype = torch.bfloat16, kernel_copies: int = 0) -> dict[str, int]:
    """Each part of the step's peak and their `total`, in bytes. `adapter`: "lora" or "full" (a bf16 base
    only); `kernel_copies`: the bytes of the base's kernel copies; `s.dense_base` (a CPU run): a 4-bit
    base's dequantized copy replaces the decode buffer."""
    if adapter == "full" and not format_entry(base_format).dense:
        raise ValueError(f"full fine-tuning needs a bf16 base, not {base_format}")
    trained = {"full_and_optimizer": full_bytes(c, dtype)} if adapter == "full" else {
        "lora_and_optimizer": lora_bytes(c, s.lora_rank, dtype, s.lora_experts)}
    parts = {
        "weights": weight_bytes(c, base_format, dtype),
        **trained,
        "kv_cache": kv_bytes_per_token(c, dtype, s.kv_cache) * s.kv_slots * s.seq_len,
        "activations": activation_bytes(c, s, dtype),
        **({"dense_base": dense_base_bytes(c, dtype)} if s.dense_base and not format_entry(base_format).dense else
           {"dequant_scratch": scratch_bytes(c, base_format, dtype)}),
        "kernel_copies": kernel_copies,
        "slack": SLACK_BYTES,
    }
    return {**parts, "total": sum(parts.values())}
