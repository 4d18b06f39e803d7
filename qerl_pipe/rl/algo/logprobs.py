"""Per-token logprobs and entropies of responses under the training forward, LM head in chunks:
at most one chunk of logits exists at a time, in forward and in backward (which recomputes it).
The definition is the engine's: logits in the model dtype, log_softmax in float32 over the full
vocabulary. See docs/training.md, section "One step" (`sequence_logprobs`)."""

from __future__ import annotations

import torch
from torch import Tensor

from qerl_pipe.model.decoder import Decoder, soft_cap

DEFAULT_CHUNK = 1024


def _logits(h: Tensor, weight: Tensor, cap: float | None) -> Tensor:
    """The head's logits in the model dtype, soft-capped as `Decoder.head` does."""
    raw = h @ weight.t()
    return raw if cap is None else soft_cap(raw, cap)


class _ChunkLogprob(torch.autograd.Function):
    """(h [N, H], W [V, H], targets [N]) -> (logp [N], entropy [N]) in float32. Saves only `h`;
    backward recomputes p: dh = (g (onehot - p) / T) W, and dW = (...)^T h when W trains (full
    fine-tuning). A soft cap (Gemma2) scales the raw logits' gradient by 1 - tanh(raw / cap)^2.
    The entropy is a metric: no gradient."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, temperature: float, cap: float | None = None):
        logits = _logits(h, weight, cap).float() / temperature
        logz = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
        probs = torch.softmax(logits, dim=-1)
        entropy = logz - (probs * logits).sum(-1)
        ctx.save_for_backward(h, weight, targets)
        ctx.temperature, ctx.cap = temperature, cap
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor):
        h, weight, targets = ctx.saved_tensors
        raw = h @ weight.t()
        capped = raw if ctx.cap is None else soft_cap(raw, ctx.cap)
        probs = torch.softmax(capped.float() / ctx.temperature, dim=-1)
        grad_logits = -probs
        grad_logits[torch.arange(len(targets), device=h.device), targets] += 1.0
        grad_logits *= grad_logp[:, None] / ctx.temperature
        if ctx.cap is not None:
            grad_logits *= 1 - torch.tanh(raw.float() / ctx.cap).square()
        grad_logits = grad_logits.to(h.dtype)
        grad_weight = grad_logits.t() @ h if ctx.needs_input_grad[1] else None
        return grad_logits @ weight, grad_weight, None, None, None


def sequence_logprobs(model: Decoder, input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor,
                      temperature: float = 1.0, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """logp [B, T] and entropy [B, T] (float32) of each token in `response_mask`, zero elsewhere.
    `input_ids` [B, T]: prompt + response, padded on either side; `response_mask`: 1 on the tokens
    to score (never position 0). Gradients flow through `logp` to whatever trains."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for logprobs; got {temperature}")
    hidden = model(input_ids, attention_mask=attention_mask)
    scored = response_mask.bool().clone()
    scored[:, 0] = False
    rows, cols = scored.nonzero(as_tuple=True)
    h = hidden[rows, cols - 1]  # the hidden state that predicts token `cols`
    targets = input_ids[rows, cols]
    parts_logp, parts_entropy = [], []
    for start in range(0, len(targets), chunk):
        lp, ent = _ChunkLogprob.apply(h[start:start + chunk], model.lm_head.weight,
                                      targets[start:start + chunk], float(temperature), model.config.final_softcap)
        parts_logp.append(lp)
        parts_entropy.append(ent)
    shape = input_ids.shape
    logp = torch.zeros(shape, dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros(shape, dtype=torch.float32, device=input_ids.device)
    if parts_logp:
        logp = logp.index_put((rows, cols), torch.cat(parts_logp))
        entropy = entropy.index_put((rows, cols), torch.cat(parts_entropy))
    return logp, entropy
