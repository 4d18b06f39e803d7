"""The decoder of every supported family: training forward (autograd, LoRA), the KV cache and the
prompt prefill for rollouts (the decode step is the engine's: engine/decode_step.py). Module names
are Hugging Face's, with q/k/v and gate/up fused (`qkv_proj`, `gate_up_proj`).
See docs/model.md, sections "Fused layout" and "KV cache and decoding"."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from qerl_pipe.kernels.fp8 import FP8, KV_CODES
from qerl_pipe.model.attention import AttentionSpec, attend, attend_prefill, visible
from qerl_pipe.model.config import DecoderConfig, RopeConfig
from qerl_pipe.model.fused import fused_on_cuda
from qerl_pipe.model.linear import Project, QuantLinear, call_module
from qerl_pipe.model.moe import SparseMoE
from qerl_pipe.model.norm import RMSNorm
from qerl_pipe.model.rope import apply_rope, inv_frequencies, long_inv_frequencies, rope_cos_sin

# attend(q [B, Hq, T, D], k [B, Hkv, T, D], v) -> [B, Hq, T, D]; one per use (full, prefill).
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
Device = Union[torch.device, str]


class KVCache:
    """Preallocated keys/values [layers, batch, kv_heads, max_len, head_dim] in the model dtype, or
    for `kv_format` "fp8" / "int8" codes (`kernels.fp8.row_codes` of each head's vector) and fp32
    scales `k_scale`, `v_scale` [layers, batch, kv_heads, max_len]. A row ("slot") holds one
    sequence; the engine tracks its length and passes each slot's write position to `decode_step`."""

    def __init__(self, config: DecoderConfig, batch_size: int, max_len: int, dtype: torch.dtype = torch.bfloat16,
                 device: Device = "cpu", kv_format: str = "bf16"):
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
        coded = kv_format in KV_CODES
        stored = KV_CODES[kv_format] if coded else dtype
        self.k = torch.zeros(shape, dtype=stored, device=device)
        self.v = torch.zeros(shape, dtype=stored, device=device)
        self.k_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device) if coded else None
        self.v_scale = torch.zeros(shape[:-1], dtype=torch.float32, device=device) if coded else None

    def layer(self, i: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """Layer i's keys, values and their scales (None for a cache in the model dtype)."""
        if self.k_scale is None:
            return self.k[i], self.v[i], None, None
        return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def copy_slots(self, src: Tensor, dst: Tensor, length: int | None = None) -> None:
        """Copy slot src[i] into dst[i] in every layer (one prefilled prompt shared by G samples);
        with `length`, positions 0..length-1 only (the rest of a row is masked anyway)."""
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is None:
                continue
            t = t.view(torch.uint8) if t.dtype == FP8 else t  # as bytes: no fp8 indexing on CPU
            if length is None:
                t[:, dst] = t[:, src]
            else:
                t[:, dst, :, :length] = t[:, src, :, :length]

    def first_slots(self, batch_size: int, length: int | None = None) -> "KVCache":
        """A cache over slots 0..batch_size-1 and positions 0..length-1 sharing this one's storage (the
        engine decodes on the smallest prefix it needs); positions passed to decode_step must be below `length`."""
        length = self.max_len if length is None else length
        if not 1 <= batch_size <= self.batch_size or not 1 <= length <= self.max_len:
            raise ValueError(f"first_slots({batch_size}, {length}) outside 1..{self.batch_size} slots, "
                             f"1..{self.max_len} positions")
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, :batch_size, :, :length], self.v[:, :batch_size, :, :length]
        view.k_scale, view.v_scale = ((None, None) if self.k_scale is None else
                                      (self.k_scale[:, :batch_size, :, :length], self.v_scale[:, :batch_size, :, :length]))
        return view


def _linear(cfg: DecoderConfig, index: int, base_format: str, dtype: torch.dtype, device: Device,
            bias: bool) -> QuantLinear:
    """The layer's `index`-th linear of `DecoderConfig.layer_linears` (its projections' names and sizes)."""
    _, _, in_features, projections = cfg.layer_linears()[index]
    names, sizes = zip(*projections)
    return QuantLinear(in_features, sizes, names, base_format, dtype, device, bias)


def _norm(cfg: DecoderConfig, dim: int, dtype: torch.dtype, device: Device) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, dtype, device, cfg.norm_offset)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int, base_format: str, dtype: torch.dtype, device: Device):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sizes = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        self.spec = AttentionSpec(cfg.window(layer), cfg.attn_scale, cfg.attn_softcap)
        self.qkv_proj = _linear(cfg, 0, base_format, dtype, device, cfg.qkv_bias)
        self.o_proj = _linear(cfg, 1, base_format, dtype, device, cfg.o_bias)
        self.q_norm = _norm(cfg, cfg.head_dim, dtype, device) if cfg.qk_norm else None
        self.k_norm = _norm(cfg, cfg.head_dim, dtype, device) if cfg.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend, project: Project = call_module) -> Tensor:
        b, t, _ = x.shape
        q, k, v = project(self.qkv_proj, x).split(self.sizes, dim=-1)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3, Gemma3: per-head RMSNorm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = attend(q, k, v)
        return project(self.o_proj, out.transpose(1, 2).reshape(b, t, -1))


@fused_on_cuda
def silu_gate(gate_up: Tensor) -> Tensor:
    """SiLU(gate) * up from the fused gate_up projection's output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@fused_on_cuda
def gelu_tanh_gate(gate_up: Tensor) -> Tensor:
    """GELU(gate) (tanh approximation, transformers' gelu_pytorch_tanh) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATES = {"silu": silu_gate, "gelu_pytorch_tanh": gelu_tanh_gate}


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, base_format: str, dtype: torch.dtype, device: Device):
        super().__init__()
        self.gate_up_proj = _linear(cfg, 2, base_format, dtype, device, cfg.mlp_bias)
        self.down_proj = _linear(cfg, 3, base_format, dtype, device, cfg.mlp_bias)
        self.gate = GATES[cfg.hidden_act]

    def forward(self, x: Tensor, project: Project = call_module) -> Tensor:
        return project(self.down_proj, self.gate(project(self.gate_up_proj, x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; with Gemma's sandwich norms also a norm on each block's
    output (`post_attention_layernorm` there normalises attention's output, and
    `pre_feedforward_layernorm` feeds the MLP, as transformers names them)."""

    def __init__(self, cfg: DecoderConfig, layer: int, base_format: str, dtype: torch.dtype, device: Device):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = _norm(cfg, h, dtype, device)
        self.self_attn = Attention(cfg, layer, base_format, dtype, device)
        self.post_attention_layernorm = _norm(cfg, h, dtype, device)
        self.mlp: MLP | SparseMoE = (SparseMoE(cfg, base_format, dtype, device, GATES[cfg.hidden_act])
                                     if cfg.is_sparse(layer) else MLP(cfg, base_format, dtype, device))
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = _norm(cfg, h, dtype, device)
            self.post_feedforward_layernorm = _norm(cfg, h, dtype, device)
        self.sandwich = cfg.sandwich_norms

    @property
    def mlp_norm(self) -> RMSNorm:
        """The norm whose output the MLP's gate/up projection reads."""
        return self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm

    def linear_input_norms(self) -> tuple[RMSNorm, RMSNorm]:
        """The norms that scale the inputs of quantized linears (q/k/v, gate/up): AQN's."""
        return self.input_layernorm, self.mlp_norm

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend, project: Project = call_module) -> Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, attend, project)
        if not self.sandwich:
            h = x + attended
            return h + self.mlp(self.post_attention_layernorm(h), project)
        h = x + self.post_attention_layernorm(attended)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), project))


@fused_on_cuda
def soft_cap(x: Tensor, cap: float) -> Tensor:
    """cap * tanh(x / cap), in x's dtype (Gemma2's final logits, as transformers computes them)."""
    return torch.tanh(x / cap) * cap


class Decoder(nn.Module):
    """Embedding, N decoder layers, final norm, LM head (tied when the config says so). Built by
    `load_model` (or `init_random_model`): bases start on the meta device, other weights uninitialised."""

    def __init__(self, config: DecoderConfig, base_format: str = "bf16", dtype: torch.dtype = torch.bfloat16,
                 device: Device = "cpu"):
        super().__init__()
        self.config, self.base_format, self.dtype = config, base_format, dtype
        v, h = config.vocab_size, config.hidden_size
        embedding = torch.empty(v, h, dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(v, h, _weight=embedding, _freeze=True)
        self.layers = nn.ModuleList(DecoderLayer(config, i, base_format, dtype, device)
                                    for i in range(config.num_layers))
        self.norm = _norm(config, h, dtype, device)
        self.lm_head = nn.utils.skip_init(nn.Linear, h, v, bias=False, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.lm_head.weight.requires_grad_(False)
        # Gemma multiplies the embeddings by sqrt(hidden) rounded to the model dtype (transformers
        # casts its scale to the weights' dtype: 55.4256 becomes 55.5 in bf16).
        self.embed_scale = (None if config.embed_scale is None
                            else float(torch.tensor(config.embed_scale, dtype=torch.float32).to(dtype)))
        # RoPE tables: `inv_freq` for the global layers, `local_inv_freq` for Gemma3's local ones,
        # `long_inv_freq` for LongRoPE's long factors (None where the model has none).
        self._register_rope("", config.rope, device)
        if config.local_rope is not None:
            self._register_rope("local_", config.local_rope, device)
        # Recompute each layer's activations in backward instead of storing them (training only).
        self.gradient_checkpointing = False

    def _register_rope(self, prefix: str, rope: RopeConfig, device: Device) -> None:
        self.register_buffer(f"{prefix}inv_freq", inv_frequencies(rope, self.config.head_dim).to(device),
                             persistent=False)
        long = long_inv_frequencies(rope, self.config.head_dim)
        if long is not None:
            self.register_buffer(f"{prefix}long_inv_freq", long.to(device), persistent=False)

    def rope_cos_sin(self, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each layer's (cos, sin) at `positions`, [*positions.shape, rotary_dim] each; computed
        once per distinct RoPE (a Gemma3 model has two)."""
        tables: dict[str, tuple[Tensor, Tensor]] = {}
        out = []
        for i in range(self.config.num_layers):
            prefix = "local_" if self.config.rope_of(i) is self.config.local_rope else ""
            if prefix not in tables:
                rope = self.config.rope_of(i)
                long = getattr(self, f"{prefix}long_inv_freq", None)
                tables[prefix] = rope_cos_sin(positions, getattr(self, f"{prefix}inv_freq"), self.dtype, long,
                                              rope.original_max_position_embeddings, rope.attention_factor)
            out.append(tables[prefix])
        return out

    def embed(self, input_ids: Tensor) -> Tensor:
        """The input embeddings (scaled, for Gemma)."""
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

    def head(self, hidden: Tensor) -> Tensor:
        """Logits of final hidden states, in the model dtype: the LM head, then Gemma2's soft cap."""
        logits = self.lm_head(hidden)
        cap = self.config.final_softcap
        return logits if cap is None else soft_cap(logits, cap)

    def _run_layers(self, input_ids: Tensor, positions: Tensor, attends: list[Attend],
                    project: Project = call_module) -> Tensor:
        x = self.embed(input_ids)
        tables = self.rope_cos_sin(positions)
        checkpointing = self.gradient_checkpointing and torch.is_grad_enabled()
        for layer, attend_fn, (cos, sin) in zip(self.layers, attends, tables):
            if checkpointing:
                x = checkpoint(layer, x, cos, sin, attend_fn, project, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attend_fn, project)
        return self.norm(x)

    def _masks(self, positions: Tensor, keep: Tensor | None) -> list[Tensor | None]:
        """Each layer's attention mask, one per distinct window; None where plain causal SDPA
        serves (no padding, window or score cap)."""
        masks: dict[int | None, Tensor] = {}
        out: list[Tensor | None] = []
        for layer in self.layers:
            spec = layer.self_attn.spec
            if keep is None and spec.window is None and spec.softcap is None:
                out.append(None)
                continue
            if spec.window not in masks:
                masks[spec.window] = visible(positions, keep, spec.window)
            out.append(masks[spec.window])
        return out

    def forward(self, input_ids: Tensor, positions: Tensor | None = None,
                attention_mask: Tensor | None = None) -> Tensor:
        """Final hidden states [B, T, hidden] of a whole batch, with autograd (training, scoring).
        `attention_mask` [B, T] may pad on either side; without `positions`, a token's position is
        the count of real tokens before it (a left-padded prompt gets its positions alone)."""
        b, t = input_ids.shape
        keep = None
        if attention_mask is not None:
            keep = attention_mask.bool()
            if positions is None:
                positions = (keep.long().cumsum(-1) - 1).clamp(min=0)
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        attends = [partial(attend, mask=mask, spec=layer.self_attn.spec)
                   for layer, mask in zip(self.layers, self._masks(positions, keep))]
        return self._run_layers(input_ids, positions, attends)

    def logits(self, input_ids: Tensor, positions: Tensor | None = None,
               attention_mask: Tensor | None = None) -> Tensor:
        """[B, T, vocab] logits in the model dtype (for long batches, apply `head` in chunks)."""
        return self.head(self.forward(input_ids, positions, attention_mask))

    def make_cache(self, batch_size: int, max_len: int, kv_format: str = "bf16") -> KVCache:
        """An empty KV cache on this model's device, in its dtype or as `kv_format` codes with scales."""
        return KVCache(self.config, batch_size, max_len, self.dtype, self.embed_tokens.weight.device, kv_format)

    @torch.inference_mode()
    def prefill(self, input_ids: Tensor, cache: KVCache, slots: Tensor, lengths: Tensor | None = None,
                project: Project = call_module) -> Tensor:
        """Right-padded prompts [N, T] (`lengths` [N], default T) into cache rows `slots` [N]; logits
        [N, vocab] at their last token. `project` runs the projections (the engine's fused LoRA's)."""
        n, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(n, t)
        masks = self._masks(positions[:1], None)  # positions are 0..T-1 in every row
        attends = [partial(attend_prefill, cache=cache.layer(i), slots=slots, mask=masks[i], spec=layer.self_attn.spec)
                   for i, layer in enumerate(self.layers)]
        hidden = self._run_layers(input_ids, positions, attends, project)
        last = (lengths - 1) if lengths is not None else torch.full((n,), t - 1, device=input_ids.device)
        return self.head(hidden[torch.arange(n, device=hidden.device), last])
