"""EngineLimits: how many sequences the rollout engine runs at once, how long, and with which graphs.
The KV cache is the engine's one big allocation, so `plan_limits` gives the largest batch whose
cache fits a memory budget (build-engine plans it once on the target GPU and stores it in the
artifact). See docs/engine.md, section "Memory"."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from qerl_pipe.errors import QerlError
from qerl_pipe.kernels.fp8 import KV_CODES
from qerl_pipe.model.config import DecoderConfig

KV_FORMATS = ("bf16", *KV_CODES)  # engine.kv_cache: the model dtype, or codes with a scale per token and head

# Batch sizes the decode step is captured for as CUDA graphs (each a fixed shape); a batch runs
# on the smallest captured size that holds it. Powers of two keep the padding waste under 2x.
DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class EngineLimitsError(QerlError):
    """The requested engine does not fit: names the limit and what to change."""


@dataclass(frozen=True)
class EngineLimits:
    max_batch: int  # decode slots: sequences in flight at once
    max_seq_len: int  # prompt + generated tokens per slot
    kv_cache_bytes: int  # keys + values for max_batch x max_seq_len
    graph_batch_sizes: tuple[int, ...] = field(default=())  # empty: no CUDA graphs (CPU)
    kv_cache: str = "bf16"  # the model dtype, or "fp8" / "int8" (codes + a scale per token and head)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_seq_len < 2:
            raise EngineLimitsError(f"engine limits need max_batch >= 1 and max_seq_len >= 2; got {self.max_batch}, "
                                    f"{self.max_seq_len}")
        if self.kv_cache not in KV_FORMATS:
            raise EngineLimitsError(f"engine.kv_cache={self.kv_cache!r}: choose one of {', '.join(KV_FORMATS)}")
        if any(b < 1 or b > self.max_batch for b in self.graph_batch_sizes):
            raise EngineLimitsError(f"CUDA-graph batch sizes {self.graph_batch_sizes} must lie in "
                                    f"1..max_batch={self.max_batch}")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "graph_batch_sizes": list(self.graph_batch_sizes)}

    def with_batch(self, slots: int) -> "EngineLimits":
        """These limits with `slots` decode slots (at most max_batch): a smaller KV cache, the same length."""
        if slots >= self.max_batch:
            return self
        graphs = tuple(b for b in self.graph_batch_sizes if b < slots) + (slots,) if self.graph_batch_sizes else ()
        return replace(self, max_batch=slots, kv_cache_bytes=self.kv_cache_bytes // self.max_batch * slots,
                       graph_batch_sizes=graphs)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "EngineLimits":
        return cls(max_batch=int(data["max_batch"]), max_seq_len=int(data["max_seq_len"]),
                   kv_cache_bytes=int(data["kv_cache_bytes"]),
                   graph_batch_sizes=tuple(int(b) for b in data.get("graph_batch_sizes", ())),
                   kv_cache=str(data.get("kv_cache", "bf16")))


def kv_bytes_per_token(config: DecoderConfig, dtype: torch.dtype = torch.bfloat16, kv_cache: str = "bf16") -> int:
    """Bytes of keys plus values one token occupies across all layers: in the model dtype, or
    (kv_cache "fp8" or "int8") one byte per element and an fp32 scale per head."""
    element = torch.empty((), dtype=dtype).element_size()
    per_head = config.head_dim + 4 if kv_cache in KV_CODES else config.head_dim * element
    return 2 * config.num_layers * config.num_kv_heads * per_head


def plan_limits(config: DecoderConfig, *, max_seq_len: int, max_batch: int, kv_budget_bytes: int | None = None,
                dtype: torch.dtype = torch.bfloat16, cuda_graphs: bool = False, kv_cache: str = "bf16") -> EngineLimits:
    """The largest batch up to `max_batch` whose KV cache fits `kv_budget_bytes` (None: no cap); fails,
    naming the numbers, when not even one sequence of `max_seq_len` fits."""
    if max_seq_len < 2:
        raise EngineLimitsError(f"max_seq_len must be at least 2 (a prompt token and one more); got {max_seq_len}")
    if max_batch < 1:
        raise EngineLimitsError(f"max_batch must be at least 1; got {max_batch}")
    per_sequence = kv_bytes_per_token(config, dtype, kv_cache) * max_seq_len
    batch = max_batch
    if kv_budget_bytes is not None:
        batch = min(max_batch, kv_budget_bytes // per_sequence)
        if batch < 1:
            raise EngineLimitsError(f"one sequence of {max_seq_len} tokens needs {per_sequence / 2**20:.1f} MiB of KV "
                                    f"cache but the budget is {kv_budget_bytes / 2**20:.1f} MiB; lower max_seq_len or "
                                    "raise the KV budget")
    graphs = tuple(b for b in DEFAULT_GRAPH_SIZES if b < batch) + (batch,) if cuda_graphs else ()
    return EngineLimits(batch, max_seq_len, per_sequence * batch, graphs, kv_cache)
