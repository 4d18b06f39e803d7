"""Sampling: parameters, counter-based Gumbel noise, and one batched sampling step. Gumbel-max,
argmax(logits / T + g), is an exact sample of softmax(logits / T); the uniforms are a hash of (seed, sequence
id, step, vocab index), so a sequence's randomness never depends on its batch, its slot or the slot count.
See docs/engine.md, sections "Sampling and logprobs" and "Reproducibility"."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qerl_pipe.errors import QerlError

_M32 = 0xFFFFFFFF
# Multipliers of a two-round xor-shift-multiply 32-bit mixer found by Wellons' hash-prospector
# search (shifts 16, 15, 15). Both are below 2**31, so a product with a 32-bit value stays below
# 2**63: the hash is exact in int64 on every device, with no reliance on overflow wrapping.
_C1 = 0x21F0AAAD
_C2 = 0x735A2D97


class SamplingParamsError(QerlError):
    """A sampling parameter is out of range: names it and the accepted values."""


@dataclass(frozen=True)
class SamplingParams:
    """How the engine picks each token: temperature (0 = greedy), top_p / top_k (1.0 / 0 = off;
    after the temperature, top-k first; never change the reported logprobs), max_new_tokens
    (finish "length"), stop_token_ids (finish "stop", the token kept; pass the EOS), seed (with the
    sequence id and step, every random number). docs/engine.md, "Sampling and logprobs"."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(what: str) -> SamplingParamsError:
            return SamplingParamsError(f"SamplingParams: {what}")

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0.0 <= t < float("inf")):
            raise bad(f"temperature must be a finite number >= 0 (0 = greedy); got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise bad(f"top_p must lie in (0, 1] (1 = off); got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad(f"top_k must be an integer >= 0 (0 = off); got {self.top_k!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad(f"max_new_tokens must be an integer >= 1; got {self.max_new_tokens!r}")
        if not _is_int(self.seed):
            raise bad(f"seed must be an integer; got {self.seed!r}")
        try:
            stops = tuple(self.stop_token_ids)
        except TypeError:
            raise bad(f"stop_token_ids must be a sequence of token ids; got {self.stop_token_ids!r}") from None
        if not all(_is_int(s) and s >= 0 for s in stops):
            raise bad(f"stop_token_ids must be token ids >= 0; got {stops!r}")
        # A list (say, from a recipe) is accepted and stored as a tuple: the params stay hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in stops))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def truncates(self) -> bool:
        """Whether top-k or top-p removes tokens (the costly part: a sort over the vocabulary)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def hash32(x):  # int or int64 Tensor in [0, 2**32) -> the same type, in [0, 2**32)
    """A bijective 32-bit mixer, in plain integer ops so it runs on Python ints and int64 tensors
    alike (the same numbers on CPU and GPU, the host computing per-sequence keys)."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 15)


def _hash32_(x: Tensor) -> Tensor:
    """`hash32` in place on an int64 tensor of values in [0, 2**32) (the [B, V] hot path)."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_C1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_C2).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 15)


def sequence_key(seed: int, sequence_id: int) -> int:
    """The 32-bit key of one sequence's random stream (host side): every bit of the seed and of the id
    goes through the mixer, so nearby seeds or ids give unrelated streams."""
    seed &= (1 << 64) - 1  # negative seeds are fine: two's complement
    key = hash32(hash32(seed & _M32) ^ (seed >> 32))
    for word in (sequence_id & _M32, (sequence_id >> 32) & _M32):
        key = hash32(key ^ word)
    return key


def gumbel_noise(keys: Tensor, steps: Tensor, vocab: Tensor) -> Tensor:
    """Gumbel(0, 1) noise [B, V] float32 for sequence keys [B] at their steps [B]; `vocab`: int64
    arange(V) on the device. The uniform of (key, step, v) is hash32(hash32(key ^ step) ^ v) kept to
    24 bits, strictly inside (0, 1) and exact in float32: the noise is finite, at most ~17."""
    row = hash32((keys ^ steps) & _M32)  # [B]
    bits = _hash32_(row[:, None] ^ vocab[None, :])  # [B, V] int64
    u = (bits >> 8).to(torch.float32).add_(0.5).mul_(2.0**-24)
    return u.log_().neg_().log_().neg_()


def truncate_logits(z: Tensor, top_k: int, top_p: float) -> Tensor:
    """A copy of scaled logits z [B, V] with tokens outside top-k, then top-p, set to -inf. Top-p keeps the
    smallest set of most likely tokens reaching top_p, and always the most likely one, as Hugging Face does."""
    vocab = z.shape[-1]
    if top_p >= 1.0:  # top-k alone: a partial selection, no full sort
        kth = z.topk(min(top_k, vocab), dim=-1).values[:, -1:]
        return z.masked_fill(z < kth, float("-inf"))
    sorted_z, order = z.sort(dim=-1, descending=True)
    if 0 < top_k < vocab:
        sorted_z[:, top_k:] = float("-inf")
    probs = sorted_z.softmax(dim=-1)
    # Drop a token when the tokens before it already reach top_p; the first never goes.
    drop = (probs.cumsum(dim=-1) - probs) >= top_p
    drop[:, 0] = False
    sorted_z.masked_fill_(drop, float("-inf"))
    return torch.empty_like(z).scatter_(-1, order, sorted_z)


def sample(logits: Tensor, keys: Tensor, steps: Tensor, vocab: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
    """Next tokens [B] (int64) and their logprobs [B] (float32) from logits [B, V]: log_softmax(logits.float() / T)
    at the chosen token (T = 1 when greedy), what a trainer recomputes. Top-k/top-p only narrow the candidates."""
    z = logits.float()
    if not params.greedy and params.temperature != 1.0:
        z = z / params.temperature
    if params.greedy:
        tokens = z.argmax(dim=-1)
    else:
        candidates = truncate_logits(z, params.top_k, params.top_p) if params.truncates else z
        tokens = gumbel_noise(keys, steps, vocab).add_(candidates).argmax(dim=-1)
    chosen = z.gather(-1, tokens[:, None])[:, 0]
    return tokens, chosen - z.logsumexp(dim=-1)
