"""The engine's decode step: one new token per cache slot over the shared model's modules and the
engine's fused adapter copy, in as few kernels as the fused pieces allow (add + RMSNorm with the
next LoRA shrink and, for FP8 rollouts, the E4M3 rows; RoPE + KV write + split-KV attention; the
bias and LoRA expand in the GEMM's epilogue). Shapes never depend on positions, so it is captured
as a CUDA graph per (batch, length). docs/engine.md#the-decode-step-enginedecode_steppy."""

from __future__ import annotations

import torch
from torch import Tensor

from qerl_pipe.engine.fused_lora import FusedLora
from qerl_pipe.kernels.decode_ops import add_rms_norm, decode_attention, lora_shrink
from qerl_pipe.kernels.fp8 import Fp8Rows
from qerl_pipe.kernels.triton_fp8 import gated_rows
from qerl_pipe.model.decoder import MLP, Decoder, KVCache
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.moe import SparseMoE
from qerl_pipe.model.norm import RMSNorm


def _norm(x: Tensor, residual: Tensor | None, norm: RMSNorm, lora: FusedLora,
          following: QuantLinear | None) -> tuple[Tensor, Tensor, Tensor | None, Fp8Rows | None]:
    """Residual add + RMSNorm, and the LoRA shrink of the projection that reads the result (and
    its E4M3 rows where that projection runs FP8 activations)."""
    shrink = None if following is None else lora.shrink_of(following)
    quantize = following is not None and lora.runs_fp8(following, x.shape[0])
    return add_rms_norm(x, residual, norm.weight, norm.noise, norm.eps, shrink, norm.offset, quantize)


def _mlp(mlp: MLP, normed: Tensor, u: Tensor | None, q: Fp8Rows | None, lora: FusedLora, act: str) -> Tensor:
    """gate/up, the gate, down; where down runs FP8 on a GPU, one row kernel computes the gate and
    its E4M3 rows (docs/kernels.md "FP8 rollouts")."""
    gate_up = lora.project(mlp.gate_up_proj, normed, u, q)
    if gate_up.is_cuda and lora.runs_fp8(mlp.down_proj, gate_up.shape[0]):
        gated, q_down = gated_rows(gate_up, act)
        return lora.project(mlp.down_proj, gated, q=q_down)
    return lora.project(mlp.down_proj, mlp.gate(gate_up))


def _output_norm(x: Tensor, norm: RMSNorm) -> Tensor:
    """A sublayer's output normed on its own (Gemma's post-attention and post-feed-forward norms)."""
    return add_rms_norm(x, None, norm.weight, norm.noise, norm.eps, None, norm.offset)[0]


@torch.inference_mode()
def decode_step(model: Decoder, lora: FusedLora, tokens: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
    """Logits [B, vocab] for tokens [B] at positions [B], one per slot of `cache` (B = its batch). Idle slots
    compute garbage nobody reads (fixed shapes for a CUDA graph); their positions must stay below cache.max_len."""
    b = cache.batch_size
    if tokens.shape != (b,) or positions.shape != (b,):
        raise ValueError(f"decode_step needs tokens and positions of shape ({b},), one per cache slot; "
                         f"got {tuple(tokens.shape)} and {tuple(positions.shape)}")
    cfg = model.config
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    scale = cfg.attn_scale if cfg.attn_scale is not None else d ** -0.5
    tables = model.rope_cos_sin(positions)  # per layer, [B, rotary_dim] each
    layers = model.layers
    normed, residual, u, q8 = _norm(model.embed(tokens), None, layers[0].input_layernorm, lora,
                                    layers[0].self_attn.qkv_proj)
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = lora.project(attn.qkv_proj, normed, u, q8).split(attn.sizes, dim=-1)
        q, k, v = q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d)
        if attn.q_norm is not None:  # Qwen3, Gemma3: per-head RMSNorm before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = tables[i]
        k_cache, v_cache, k_scale, v_scale = cache.layer(i)
        out = decode_attention(q, k, v, cos, sin, k_cache, v_cache, positions, scale, attn.spec.window or 0,
                               attn.spec.softcap or 0.0, k_scale, v_scale)
        attended = lora.project(attn.o_proj, out, lora_shrink(out, lora.shrink_of(attn.o_proj)))
        if layer.sandwich:
            attended = _output_norm(attended, layer.post_attention_layernorm)
        if isinstance(mlp, SparseMoE):  # routed experts: each expert's LoRA shrink runs on its own rows
            normed, residual, _, _ = _norm(attended, residual, layer.mlp_norm, lora, None)
            down = mlp(normed, lora.project)
        else:
            normed, residual, u, q8 = _norm(attended, residual, layer.mlp_norm, lora, mlp.gate_up_proj)
            down = _mlp(mlp, normed, u, q8, lora, cfg.hidden_act)
        if layer.sandwich:
            down = _output_norm(down, layer.post_feedforward_layernorm)
        following = layers[i + 1] if i + 1 < len(layers) else None  # None: the final norm, then the head
        normed, residual, u, q8 = _norm(down, residual, model.norm if following is None else following.input_layernorm,
                                        lora, None if following is None else following.self_attn.qkv_proj)
    return model.head(normed)
