"""The Llama-family decoder: training forward (autograd, LoRA), the KV cache and the prompt prefill for rollouts (the engine owns the decode step: engine/decode_step.py).

Module names follow Hugging Face (`layers.N.self_attn`, `mlp`, `input_layernorm`, ...) with the
fused projections named `qkv_proj` and `gate_up_proj`, so mapping to checkpoint and PEFT names is
a string edit.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from qerl_pipe.formats.names import FUSED_GROUPS
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.model.fused import fused_on_cuda
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.norm import RMSNorm
from qerl_pipe.model.rope import apply_rope, inv_frequencies, rope_cos_sin

# attend(q [B, Hq, T, D], k [B, Hkv, T, D], v) -> [B, Hq, T, D]; one per use (full, prefill).
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
# project(linear, x [..., in]) -> [..., out]: how a projection runs. The model calls the module
# (its base and per-projection LoRA); the rollout engine passes its fused LoRA copy's `project`.
Project = Callable[[QuantLinear, Tensor], Tensor]
Device = Union[torch.device, str]


def call_module(linear: QuantLinear, x: Tensor) -> Tensor:
    """The default `Project`: the module itself."""
    return linear(x)


class KVCache:
    """Preallocated keys/values [layers, batch, kv_heads, max_len, head_dim] in the model dtype.

    A row ("slot") holds one sequence; its length is tracked by the caller (the engine), which
    passes the write position of each slot to the engine's `decode_step`.
    """

    def __init__(
        self,
        config: DecoderConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.bfloat16,
        device: Device = "cpu",
    ):
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def copy_slots(self, src: Tensor, dst: Tensor, length: int | None = None) -> None:
        """Copy slot src[i] into dst[i] in every layer: one prefilled prompt shared by G samples.

        `length`: copy only positions 0..length-1 (what the sequences hold; the rest of a row is
        masked anyway), so moving short sequences does not copy whole max_len rows.
        """
        if length is None:
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]
        else:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def first_slots(self, batch_size: int, length: int | None = None) -> "KVCache":
        """A cache over slots 0..batch_size-1 and positions 0..length-1 sharing this one's storage.

        The engine decodes on the smallest prefix holding its active slots, and attends only over
        the positions its sequences have reached (decode_step stops at each position anyway, so the
        result is the same but the step reads less of the cache). Positions passed to
        decode_step must then be below `length`.
        """
        length = self.max_len if length is None else length
        if not 1 <= batch_size <= self.batch_size or not 1 <= length <= self.max_len:
            raise ValueError(
                f"first_slots({batch_size}, {length}) outside 1..{self.batch_size} slots, 1..{self.max_len} positions"
            )
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, :batch_size, :, :length], self.v[:, :batch_size, :, :length]
        return view


def attend_full(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """Causal attention over the sequence itself; `mask` [B, 1, T, T] (True = attend) or None."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    # With an explicit mask, enable_gqa sends CUDA SDPA to the math kernel (a [B, H, T, T] fp32
    # score matrix); repeating k/v keeps the memory-efficient kernel.
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attend_prefill(
    q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor
) -> Tensor:
    """Write the prompt's k/v at positions 0..T-1 of `slots`, then attend causally within the prompt.

    Right padding is harmless: a real token never attends to a later pad, and a pad's cache entry
    lies beyond the slot's length, where decode masks it out and later overwrites it.
    """
    t = q.shape[2]
    k_cache[slots, :, :t] = k
    v_cache[slots, :, :t] = v
    return attend_full(q, k, v, None)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, base_format: str, dtype: torch.dtype, device: Device):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sizes = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        self.qkv_proj = QuantLinear(
            cfg.hidden_size, self.sizes, FUSED_GROUPS["qkv"], base_format, dtype, device, cfg.qkv_bias
        )
        self.o_proj = QuantLinear(
            cfg.q_size, (cfg.hidden_size,), ("o_proj",), base_format, dtype, device, cfg.o_bias
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend, project: Project = call_module) -> Tensor:
        b, t, _ = x.shape
        q, k, v = project(self.qkv_proj, x).split(self.sizes, dim=-1)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
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


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, base_format: str, dtype: torch.dtype, device: Device):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = QuantLinear(
            cfg.hidden_size, (i, i), FUSED_GROUPS["gate_up"], base_format, dtype, device, cfg.mlp_bias
        )
        self.down_proj = QuantLinear(
            i, (cfg.hidden_size,), ("down_proj",), base_format, dtype, device, cfg.mlp_bias
        )

    def forward(self, x: Tensor, project: Project = call_module) -> Tensor:
        return project(self.down_proj, silu_gate(project(self.gate_up_proj, x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, base_format: str, dtype: torch.dtype, device: Device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, base_format, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, base_format, dtype, device)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend, project: Project = call_module) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attend, project)
        return h + self.mlp(self.post_attention_layernorm(h), project)


class Decoder(nn.Module):
    """Embedding, N decoder layers, final norm, LM head (tied to the embedding when the config says so).

    Built by `load_model` or `init_random_model`: the constructor leaves every QuantLinear base on
    the meta device and the other weights uninitialised.
    """

    def __init__(
        self,
        config: DecoderConfig,
        base_format: str = "bf16",
        dtype: torch.dtype = torch.bfloat16,
        device: Device = "cpu",
    ):
        super().__init__()
        self.config, self.base_format, self.dtype = config, base_format, dtype
        v, h = config.vocab_size, config.hidden_size
        embedding = torch.empty(v, h, dtype=dtype, device=device)
        self.embed_tokens = nn.Embedding(v, h, _weight=embedding, _freeze=True)
        self.layers = nn.ModuleList(
            DecoderLayer(config, base_format, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.lm_head = nn.utils.skip_init(nn.Linear, h, v, bias=False, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.lm_head.weight.requires_grad_(False)
        inv_freq = inv_frequencies(config.rope, config.head_dim).to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Recompute each layer's activations in backward instead of storing them (training only).
        self.gradient_checkpointing = False

    def _run_layers(self, input_ids: Tensor, positions: Tensor, attends: list[Attend],
                    project: Project = call_module) -> Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)
        checkpointing = self.gradient_checkpointing and torch.is_grad_enabled()
        for layer, attend in zip(self.layers, attends):
            if checkpointing:
                x = checkpoint(layer, x, cos, sin, attend, project, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attend, project)
        return self.norm(x)

    def forward(
        self, input_ids: Tensor, positions: Tensor | None = None, attention_mask: Tensor | None = None
    ) -> Tensor:
        """Final hidden states [B, T, hidden] of a whole batch, with autograd (training, scoring).

        `attention_mask` [B, T] (1 = token, 0 = padding) may pad on either side; without
        `positions`, a token's position is the count of real tokens before it, so a left-padded
        prompt gets the positions it would have alone.
        """
        b, t = input_ids.shape
        mask = None
        if attention_mask is not None:
            keep = attention_mask.bool()
            if positions is None:
                positions = (keep.long().cumsum(-1) - 1).clamp(min=0)
            causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
            # The diagonal stays open so that pad rows attend to something: no NaN, and their
            # outputs are ignored anyway.
            mask = (causal & keep[:, None, None, :]) | torch.eye(t, dtype=torch.bool, device=input_ids.device)
        if positions is None:
            positions = torch.arange(t, device=input_ids.device).expand(b, t)
        attend = partial(attend_full, mask=mask)
        return self._run_layers(input_ids, positions, [attend] * len(self.layers))

    def logits(
        self, input_ids: Tensor, positions: Tensor | None = None, attention_mask: Tensor | None = None
    ) -> Tensor:
        """[B, T, vocab] logits in the model dtype (for long batches, apply `lm_head` in chunks)."""
        return self.lm_head(self.forward(input_ids, positions, attention_mask))

    def make_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty KV cache in this model's dtype and on its device."""
        return KVCache(self.config, batch_size, max_len, self.dtype, self.embed_tokens.weight.device)

    @torch.inference_mode()
    def prefill(
        self, input_ids: Tensor, cache: KVCache, slots: Tensor, lengths: Tensor | None = None,
        project: Project = call_module,
    ) -> Tensor:
        """Right-padded prompts [N, T] into cache rows `slots` [N]; logits [N, vocab] at their last token.

        `lengths` [N] are the prompt lengths (default: T). The next token of slot i goes to
        position lengths[i]. `project` runs the projections (the engine passes its fused LoRA's).
        """
        n, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(n, t)
        attends = [
            partial(attend_prefill, k_cache=cache.k[i], v_cache=cache.v[i], slots=slots)
            for i in range(len(self.layers))
        ]
        hidden = self._run_layers(input_ids, positions, attends, project)
        last = (lengths - 1) if lengths is not None else torch.full((n,), t - 1, device=input_ids.device)
        return self.lm_head(hidden[torch.arange(n, device=hidden.device), last])
