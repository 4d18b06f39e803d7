"""The decode step on the first b cache slots and L positions: eager, or replayed from a CUDA graph captured
lazily per (b, L). A graph reads only static addresses: updates in place reach the next replay, rebinding
needs `reset()` (`model_fingerprint` detects it). docs/engine.md, "Scheduling" ("CUDA graphs") and "LoRA,
AQN noise and CUDA graphs"."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qerl_pipe.engine.decode_step import decode_step
from qerl_pipe.engine.fused_lora import FusedLora
from qerl_pipe.model.decoder import Decoder, KVCache
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.moe import SparseMoE, inference_modules

log = logging.getLogger(__name__)


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    cache: KVCache  # the view the graph was captured on (kept alive with it)


def length_buckets(max_len: int, smallest: int = 256) -> tuple[int, ...]:
    """Attention lengths the decode step runs at: powers of two from `smallest`, then max_len (KV reads
    within 2x of the lengths, with few enough shapes to capture each as a graph)."""
    out, length = [], smallest
    while length < max_len:
        out.append(length)
        length *= 2
    return (*out, max_len)


class DecodeRunner:
    """Runs the engine's `decode_step` on slots 0..b-1 and positions 0..L-1 of `cache`, with inputs
    taken from the first b entries of the engine's static `tokens` / `positions` [max_batch]."""

    def __init__(self, model: Decoder, lora: FusedLora, cache: KVCache, tokens: Tensor, positions: Tensor,
                 graph_sizes: tuple[int, ...], use_graphs: bool):
        self.model, self.lora, self.cache, self.tokens, self.positions = model, lora, cache, tokens, positions
        self.use_graphs = use_graphs
        # Batch-size buckets. Without graphs they are dropped (eager runs exactly the rows
        # needed); tests set them on CPU to exercise the bucketed schedule.
        self.sizes = tuple(sorted(set(graph_sizes))) if use_graphs else ()
        self.lengths = length_buckets(cache.max_len)
        self._views: dict[tuple[int, int], KVCache] = {}
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None  # one memory pool shared by every captured graph (they never run at once)
        self.captures = 0  # graphs captured so far (a recapture inside a timed rollout shows here)
        # Every graph copies its logits into rows 0..b-1 of this one buffer, so captured outputs
        # do not pile up (one [b, vocab] per graph would be ~1 GB at vocab 152k).
        self._logits: Tensor | None = None

    def batch_size_for(self, slots: int) -> int:
        """Rows the step runs on to cover slots 0..slots-1: the smallest graph size that holds
        them, or exactly `slots` when eager (no size that large, or no graphs)."""
        return next((size for size in self.sizes if size >= slots), slots)

    def length_for(self, positions: int) -> int:
        """Cache positions the step attends over to cover positions 0..positions-1."""
        for length in self.lengths:
            if length >= positions:
                return length
        raise ValueError(f"{positions} positions exceed the cache's {self.cache.max_len}")

    @property
    def captured(self) -> int:
        return len(self._graphs)

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({b for b, _ in self._graphs}))

    def reset(self) -> None:
        """Drop every captured graph (and its memory); the next steps capture afresh."""
        self._graphs.clear()
        self._pool = None
        self._logits = None

    def run(self, b: int, length: int) -> Tensor:
        """Logits [b, vocab] of one decode step on slots 0..b-1, positions 0..length-1 (a static
        buffer when replayed: read it before the next step)."""
        if self.use_graphs and b in self.sizes:
            self.ensure_captured(b, length).graph.replay()
            return self._logits[:b]
        return decode_step(self.model, self.lora, self.tokens[:b], self.positions[:b], self._view(b, length))

    def ensure_captured(self, b: int, length: int) -> _Graph:
        """The graph for (b, length), captured now if it does not exist yet."""
        entry = self._graphs.get((b, length))
        if entry is None:
            entry = self._graphs[(b, length)] = self._capture(b, length)
        return entry

    def _view(self, b: int, length: int) -> KVCache:
        view = self._views.get((b, length))
        if view is None:
            view = self._views[(b, length)] = self.cache.first_slots(b, length)
        return view

    def _capture(self, b: int, length: int) -> _Graph:
        # Called right before the step it will serve, with the real tokens/positions in the
        # buffers: the warm-up runs write exactly the k/v that the replay writes again (active
        # slots) or garbage at position 0 of idle slots, which nothing reads.
        tokens, positions, view = self.tokens[:b], self.positions[:b], self._view(b, length)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._logits is None:
            rows = self.tokens.shape[0]
            self._logits = torch.empty(rows, self.model.config.vocab_size, dtype=self.model.dtype,
                                       device=self.tokens.device)
        # Warm up on a side stream (PyTorch's recipe): Triton compilation, cuBLAS workspaces and
        # lazily made tensors (the reference's code tables, bitsandbytes' probe) happen outside the capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                decode_step(self.model, self.lora, tokens, positions, view)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                self._logits[:b].copy_(decode_step(self.model, self.lora, tokens, positions, view))
        except Exception as e:
            raise RuntimeError(f"capturing the decode step as a CUDA graph (batch {b}, length {length}) failed: {e}. "
                               "Run without graphs: Engine(..., cuda_graphs=False) or QERL_ENGINE_CUDA_GRAPHS=0") from e
        self.captures += 1
        log.debug("captured the decode step for batch %d, length %d", b, length)
        return _Graph(graph, view)


def model_fingerprint(model: nn.Module) -> tuple:
    """What a captured graph baked in besides tensor contents: every parameter and buffer address, the LoRA
    switches and scalings, a linear's humming copy, a MoE layer's grouped experts. Changed: recapture."""
    modules = list(inference_modules(model))
    tensors = tuple(t.data_ptr() for m in modules for t in (*m._parameters.values(), *m._buffers.values())
                    if t is not None)
    switches = tuple((m.lora_enabled, m.lora_scaling, len(m.lora_A), id(m.humming)) if isinstance(m, QuantLinear)
                     else id(m.grouped) for m in modules if isinstance(m, (QuantLinear, SparseMoE)))
    return tensors, switches
