"""The rollout engine: continuous batching over a preallocated KV cache, steps launched one ahead of the
host. The scheduler decides the slots, the runner (`model_runner`) changes the device state, this loop
asks both and keeps the sequences. docs/engine.md#scheduling has the whole policy."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from qerl_pipe.engine.fp8 import Fp8Linears, check_activations, check_kv_cache
from qerl_pipe.engine.fused_lora import FusedLora
from qerl_pipe.engine.graphs import model_fingerprint
from qerl_pipe.engine.limits import EngineLimits
from qerl_pipe.engine.model_runner import LaunchedStep, ModelRunner
from qerl_pipe.engine.sampling import SamplingParams, sequence_key
from qerl_pipe.engine.scheduler import Group, Scheduler
from qerl_pipe.errors import QerlError
from qerl_pipe.log import log
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.kernel_copies import all_experts_grouped, attach_grouped_experts, attach_humming, detach_humming

DEFAULT_PREFILL_TOKENS = 8192


class PromptError(QerlError):
    """A generate() input cannot run: names the prompt or argument and the fix."""


@dataclass
class Rollouts:
    """P*n sequences in order: prompt 0 samples 0..n-1, prompt 1 samples 0..n-1, ... `tokens`: the
    generated ids (an ending stop token included); `logprobs[i][t]` = log_softmax(logits / T)
    [tokens[i][t]] (T = 1 when greedy), before top-k/top-p; `finish_reasons`: "stop" or "length"."""

    prompt_index: list[int]
    sample_index: list[int]
    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    prefill_seconds: float = 0.0  # admission waves: prefill, KV copies to siblings, first tokens
    decode_seconds: float = 0.0  # decode steps, compaction, bookkeeping
    decode_steps: int = 0
    generated_tokens: int = 0
    max_active: int = 0  # most sequences in flight at once
    prefills: int = 0  # prompt prefills (more than P when a prompt's samples span waves)
    prefill_tokens: int = 0  # real (unpadded) prompt tokens prefilled
    compactions: int = 0  # times active sequences were moved to lower slots
    decode_rows: int = 0  # sum over steps of the batch size the step ran on (padding included)

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class _Sequence:
    prompt_index: int
    sample_index: int
    prompt: list[int]
    key: int  # 32-bit key of its random stream (seed, sequence id)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = ""
    in_flight: int = 0  # tokens drawn by launched steps and not yet read back (1 at most between steps)


@dataclass
class _Step:
    """A launched decode step whose tokens are still on their way to the host."""

    rows: list[tuple[int, int]]  # (row of the step's record, sequence index)
    launched: LaunchedStep


class Engine:
    """Generates rollouts from a Decoder: `Engine(model, limits).generate(prompts, n, sampling)`.
    Allocates the KV cache once; runs the model as it is (unmerged LoRA, AQN noise in its norms:
    update in place; a rebound tensor is seen and the graphs recaptured). `activations="fp8"`: FP8
    copies of the dense bases where `kernel_copies` allows (`self.activations` says what runs).
    CUDA graphs, `prefill_tokens` and the rest: docs/engine.md."""

    def __init__(self, model: Decoder, limits: EngineLimits, *, prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
                 cuda_graphs: bool | None = None, kernel_copies: bool = True, activations: str = "bf16"):
        if prefill_tokens < 1:
            raise PromptError(f"prefill_tokens must be >= 1; got {prefill_tokens}")
        device = model.embed_tokens.weight.device
        check_activations(activations, model.base_format, device, model.dtype)
        check_kv_cache(limits.kv_cache, device)
        self.model, self.limits, self.prefill_tokens = model, limits, prefill_tokens
        want_graphs = cuda_graphs if cuda_graphs is not None else os.environ.get(
            "QERL_ENGINE_CUDA_GRAPHS", "1").strip().lower() not in ("0", "false", "no", "off")
        # Before any graph is captured: the kernel copies of the base the memory plan has room for: FP8
        # copies for FP8 activations (their rows are those humming would serve), else humming's where the
        # dispatch table sends rows of this model's shapes to it; and a MoE's grouped experts.
        fp8 = None
        if kernel_copies and activations == "fp8":
            detach_humming(model)
            fp8 = Fp8Linears(model)
        elif kernel_copies:
            attach_humming(model)
        else:
            detach_humming(model)
            if activations == "fp8":
                log("engine: no room for FP8 copies of the base in the memory plan; the rollout runs bf16 "
                    "activations")
        attach_grouped_experts(model, copies=kernel_copies)
        # A MoE layer's per-expert loop takes its row counts from the routing (a host sync and
        # data-dependent shapes), which a CUDA graph cannot replay: a MoE decodes in graphs only
        # where every sparse layer runs grouped (fixed shapes, no sync), else eagerly.
        use_graphs = bool(want_graphs and device.type == "cuda" and limits.graph_batch_sizes
                          and all_experts_grouped(model))
        self.runner = ModelRunner(model, limits, FusedLora(model, model.dtype, fp8), use_graphs)
        self._fingerprint: tuple | None = None

    @property
    def activations(self) -> str:
        """What the rollout's linears run on: "fp8" where FP8 copies were made, else "bf16"."""
        return "bf16" if self.runner.lora.fp8 is None else "fp8"

    @property
    def fp8_copy_bytes(self) -> int:
        return 0 if self.runner.lora.fp8 is None else self.runner.lora.fp8.nbytes

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.runner.graphs.use_graphs

    @property
    def captured_graph_sizes(self) -> tuple[int, ...]:
        return self.runner.graphs.captured_sizes

    def reset_graphs(self) -> None:
        """Forget the captured CUDA graphs (call after replacing LoRA/noise tensors rather than
        updating them in place); the next generate captures again. No-op without graphs."""
        self.runner.graphs.reset()
        self._fingerprint = None

    def capture_graphs(self) -> int:
        """Capture every (batch size, attention length) graph now instead of lazily (e.g. before
        timing a run); returns how many exist. No-op without graphs. Safe between generate calls:
        the slots are idle, so the warm-up steps write only unused position 0 of each row."""
        if not self.uses_cuda_graphs:
            return 0
        self.runner.lora.refresh()
        with torch.inference_mode():
            self._check_graphs()  # the same model state generate() will see
            return self.runner.capture_all()

    def generate(self, prompts: Sequence[Sequence[int]], n: int = 1, sampling: SamplingParams = SamplingParams(),
                 first_sequence_id: int = 0) -> Rollouts:
        """n samples of each prompt (token ids), in order prompt 0 samples 0..n-1, prompt 1, ...
        Sample s of prompt p draws as sequence `first_sequence_id + p * n + s`: a data-parallel
        rank generating prompts k.. passes k * n and draws what one process would."""
        if not isinstance(sampling, SamplingParams):
            raise PromptError(f"sampling must be a SamplingParams; got {type(sampling).__name__}")
        prompt_lists = self._check_inputs(prompts, n, sampling)
        if isinstance(first_sequence_id, bool) or not isinstance(first_sequence_id, int) or first_sequence_id < 0:
            raise PromptError(f"first_sequence_id must be an integer >= 0; got {first_sequence_id!r}")
        # The fused adapter copy is refreshed in place from the current LoRA parameters on entry
        # (outside inference mode: tensors made inside it could not be updated in place later).
        self.runner.lora.refresh()
        with torch.inference_mode():
            self._check_graphs()
            return _Generation(self, prompt_lists, n, sampling, first_sequence_id).run()

    def _check_inputs(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> list[list[int]]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PromptError(f"n (samples per prompt) must be an integer >= 1; got {n!r}")
        vocab, max_len, new = self.model.config.vocab_size, self.limits.max_seq_len, sampling.max_new_tokens
        bad_stops = [s for s in sampling.stop_token_ids if s >= vocab]
        if bad_stops:
            raise PromptError(f"stop_token_ids {bad_stops} lie outside the vocabulary 0..{vocab - 1}; pass this "
                              "model's tokenizer's EOS id")
        out: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError):
                raise PromptError(f"prompt {i} is not a sequence of token ids; tokenize it first") from None
            if not ids:
                raise PromptError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
            low, high = min(ids), max(ids)
            if low < 0 or high >= vocab:
                raise PromptError(f"prompt {i} has token id {low if low < 0 else high} outside the vocabulary "
                                  f"0..{vocab - 1}; tokenize with this model's tokenizer")
            if len(ids) + new > max_len:
                raise PromptError(f"prompt {i} has {len(ids)} tokens, plus max_new_tokens={new} that is "
                                  f"{len(ids) + new} > the engine's max_seq_len={max_len}; shorten the prompt, lower "
                                  "max_new_tokens, or build the engine with a larger max_seq_len")
            out.append(ids)
        return out

    def _check_graphs(self) -> None:
        if not self.uses_cuda_graphs:
            return
        fingerprint = (model_fingerprint(self.model), self.runner.lora.addresses())
        if self._fingerprint is not None and fingerprint != self._fingerprint:
            self.runner.graphs.reset()  # a captured graph would read stale addresses / LoRA switches
        self._fingerprint = fingerprint


class _Generation:
    """One generate() call: its sequences, its scheduler and its output lists. It asks the engine's
    runner for every change of slot state (`model_runner.ModelRunner`) and never writes it."""

    def __init__(self, engine: Engine, prompts: list[list[int]], n: int, params: SamplingParams,
                 first_sequence_id: int = 0):
        self.engine, self.runner, self.params, self.n = engine, engine.runner, params, n
        self.seqs = [_Sequence(p, s, prompt, sequence_key(params.seed, first_sequence_id + p * n + s))
                     for p, prompt in enumerate(prompts) for s in range(n)]
        self.sched = Scheduler([s.prompt_index for s in self.seqs], engine.limits.max_batch)
        self.stops = frozenset(params.stop_token_ids)
        self.out = Rollouts([s.prompt_index for s in self.seqs], [s.sample_index for s in self.seqs], [], [], [])

    def run(self) -> Rollouts:
        self.runner.clear()
        pending: _Step | None = None  # launched, its tokens not yet read back
        while self.sched.busy or pending is not None:
            if self.sched.should_admit() or (pending is not None and not self._needs_step()):
                # Admission needs the exact slot table, and with nothing left to draw the step in
                # flight is the last: read it first.
                if pending is not None:
                    t0 = time.perf_counter()
                    self._collect(pending)
                    pending = None
                    self.out.decode_seconds += time.perf_counter() - t0
                    continue
                t0 = time.perf_counter()
                self._admit()
                self.out.prefill_seconds += time.perf_counter() - t0
                continue  # sequences may have finished on their first token: admit again
            t0 = time.perf_counter()
            step = self._launch_step()
            if pending is not None:
                self._collect(pending)  # while the GPU runs `step`
            pending = step
            self.out.decode_seconds += time.perf_counter() - t0
        out = self.out
        out.tokens = [s.tokens for s in self.seqs]
        out.logprobs = [s.logprobs for s in self.seqs]
        out.finish_reasons = [s.finish for s in self.seqs]
        out.generated_tokens = sum(len(s.tokens) for s in self.seqs)
        return out

    def _admit(self) -> None:
        """Admit the sequences the scheduler places (lowest free slots), prefill each distinct prompt once."""
        groups = self.sched.admit()
        # Short prompts together: less padding per prefill batch.
        groups.sort(key=lambda g: len(self.seqs[g[0][0]].prompt))
        rows: list[Tensor] = []  # first-token logits, one per admitted sequence, in `order`
        order: list[tuple[int, int]] = []
        start = 0
        while start < len(groups):
            # The longest prompt is last in the chunk (sorted), so the padded size is count x its length.
            end = start + 1
            while (end < len(groups)
                   and (end + 1 - start) * len(self.seqs[groups[end][0][0]].prompt) <= self.engine.prefill_tokens):
                end += 1
            logits = self._prefill(groups[start:end])
            for g, group in enumerate(groups[start:end]):
                rows.append(logits[g : g + 1].expand(len(group), -1))
                order.extend(group)
            start = end
        seq_ids = [i for i, _ in order]
        tokens, logprobs = self.runner.admit([slot for _, slot in order], torch.cat(rows),
                                             [self.seqs[i].key for i in seq_ids],
                                             [len(self.seqs[i].prompt) for i in seq_ids], self.params)
        self.out.max_active = max(self.out.max_active, len(self.sched.active))
        self._record(list(enumerate(seq_ids)), tokens, logprobs)

    def _prefill(self, groups: list[Group]) -> Tensor:
        """Prefill each group's prompt into its first slot, copy it to the others: logits [G, V]."""
        prompts = [self.seqs[g[0][0]].prompt for g in groups]
        siblings = [(g[0][1], slot) for g in groups for _, slot in g[1:]]
        logits = self.runner.prefill(prompts, [g[0][1] for g in groups], siblings)
        self.out.prefills += len(prompts)
        self.out.prefill_tokens += sum(len(p) for p in prompts)
        return logits

    def _needs_step(self) -> bool:
        """Whether an active sequence may still draw a token beyond those in flight."""
        limit = self.params.max_new_tokens
        return any(len(self.seqs[i].tokens) + self.seqs[i].in_flight < limit for i in self.sched.active.values())

    def _length(self, i: int) -> int:
        """Positions sequence i's next step needs: its prompt, its tokens and the one in flight."""
        seq = self.seqs[i]
        return len(seq.prompt) + len(seq.tokens) + seq.in_flight

    def _launch_step(self) -> _Step:
        """Launch one decode step and its sampling; the record's copy to the host is on its way."""
        graphs, active = self.runner.graphs, self.sched.active
        b, moves = self.sched.plan_step(graphs.batch_size_for, bucketed=bool(graphs.sizes))
        if moves:
            self._move(moves)
        reach = max(self._length(i) for i in active.values())
        launched = self.runner.step(b, graphs.length_for(reach), self.params)
        self.out.decode_steps += 1
        self.out.decode_rows += b
        for i in active.values():
            self.seqs[i].in_flight += 1
        return _Step([(slot, i) for slot, i in active.items()], launched)

    def _collect(self, step: _Step) -> None:
        """Wait for a launched step's record and take its tokens."""
        tokens, logprobs = step.launched.wait()
        for _, i in step.rows:
            self.seqs[i].in_flight -= 1
        self._record(step.rows, tokens, logprobs)

    def _move(self, moves: list[tuple[int, int]]) -> None:
        """Apply the scheduler's compaction: each (source, destination) slot's KV rows and state."""
        length = max(self._length(self.sched.active[d]) for _, d in moves)
        self.runner.move(moves, min(length, self.engine.limits.max_seq_len))
        self.out.compactions += 1

    def _record(self, rows: list[tuple[int, int]], tokens: list[int], logprobs: list[float]) -> None:
        """Append each row's token to its sequence, then the stop checks. `rows`: (row of `tokens`,
        sequence index) of every sequence that drew a token; one that finished a step earlier drew
        one more in the step launched before that was known: it is dropped."""
        finished: list[int] = []
        limit = self.params.max_new_tokens
        for r, i in rows:
            seq = self.seqs[i]
            if seq.finish:
                continue
            token = tokens[r]
            seq.tokens.append(token)
            seq.logprobs.append(logprobs[r])
            if token in self.stops:
                seq.finish = "stop"
            elif len(seq.tokens) >= limit:
                seq.finish = "length"
            else:
                continue
            finished.append(self.sched.slot_of(i))
        if finished:
            self.sched.release(finished)
            self.runner.release(finished)
