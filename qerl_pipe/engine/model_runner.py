"""The engine's device state and the work on it (nano-vllm's `ModelRunner`): the KV cache, the per-slot buffers,
the host record buffers, the fused adapter copy and the decode graphs. The generation loop (`engine.Engine`) asks
it to `prefill`, `admit`, `step`, `move` and `release` slots and never writes its state (docs/engine.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from qerl_pipe.engine.fused_lora import FusedLora
from qerl_pipe.engine.graphs import DecodeRunner
from qerl_pipe.engine.limits import EngineLimits
from qerl_pipe.engine.sampling import SamplingParams, sample
from qerl_pipe.model.decoder import Decoder


@dataclass
class LaunchedStep:
    """A decode step on its way: its (tokens, logprobs) record [2, b] in host memory, filled once
    `done` (a CUDA event; None: the copy was synchronous) has passed."""

    record: Tensor
    done: torch.cuda.Event | None

    def wait(self) -> tuple[list[int], list[float]]:
        if self.done is not None:
            self.done.synchronize()
        return self.record[0].long().tolist(), self.record[1].tolist()


def indices(values: list[int], device: torch.device) -> Tensor:
    """An int64 index tensor on `device` without a stream sync: a tensor from ordinary host
    memory is copied synchronously, which would make the host wait for the step in flight."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.tensor(values, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


class ModelRunner:
    def __init__(self, model: Decoder, limits: EngineLimits, lora: FusedLora, use_graphs: bool):
        self.model, self.lora = model, lora
        self.device = model.embed_tokens.weight.device
        self.cache = model.make_cache(limits.max_batch, limits.max_seq_len, kv_format=limits.kv_cache)
        slots = limits.max_batch

        def buffer() -> Tensor:
            return torch.zeros(slots, dtype=torch.long, device=self.device)

        # Updated in place: the graphs read tokens/positions from fixed addresses, and keeping the
        # rest on the device avoids per-step host-to-device copies.
        self._tokens = buffer()  # token fed to the next step
        self._positions = buffer()  # where that token goes in the cache
        self._keys = buffer()  # the slot's sequence key
        self._steps = buffer()  # tokens the slot's sequence has generated so far
        self._live = buffer()  # 1 = a sequence occupies the slot (idle slots keep position 0)
        self._vocab = torch.arange(model.config.vocab_size, device=self.device)
        # Each step's (tokens, logprobs) go to the host in one copy. Two pinned buffers in turn:
        # one is read while the next step's copy lands in the other.
        self._record = torch.zeros(2 * slots, dtype=torch.float64, device=self.device)
        pinned = self.device.type == "cuda"
        self._host = [torch.zeros(2 * slots, dtype=torch.float64, pin_memory=pinned) for _ in range(2)]
        self._launched = 0
        self.graphs = DecodeRunner(model, lora, self.cache, self._tokens, self._positions,
                                   limits.graph_batch_sizes, use_graphs)

    def clear(self) -> None:
        """Every slot idle (a call that raised may have left some live)."""
        self._live.zero_()
        self._positions.zero_()

    def capture_all(self) -> int:
        """Capture every graph now; returns how many exist. All slots idle: warm-ups write only position 0."""
        self.clear()
        for b in self.graphs.sizes:
            for length in self.graphs.lengths:
                self.graphs.ensure_captured(b, length)
        return self.graphs.captured

    def prefill(self, prompts: list[list[int]], first_slots: list[int], siblings: list[tuple[int, int]]) -> Tensor:
        """Each prompt (right-padded into one batch) into its first slot, then each (source, destination) of
        `siblings` copied over (a prompt's other samples). Logits [P, V] at each prompt's last token."""
        ids = pad_sequence([torch.tensor(p, dtype=torch.long) for p in prompts], batch_first=True)
        lengths = torch.tensor([len(p) for p in prompts])
        logits = self.model.prefill(ids.to(self.device), self.cache, torch.tensor(first_slots).to(self.device),
                                    lengths.to(self.device), project=self.lora.project)
        if siblings:
            self.cache.copy_slots(torch.tensor([s for s, _ in siblings], device=self.device),
                                  torch.tensor([d for _, d in siblings], device=self.device), ids.shape[1])
        return logits

    def admit(self, slots: list[int], logits: Tensor, keys: list[int], positions: list[int],
              params: SamplingParams) -> tuple[list[int], list[float]]:
        """Draw each admitted sequence's first token from its prompt's logits (rows as `slots`) and
        make its slot live at `positions` (its prompt length); returns the tokens and logprobs."""
        slots_t = torch.tensor(slots, device=self.device)
        keys_t = torch.tensor(keys, device=self.device)
        tokens, logprobs = sample(logits, keys_t, torch.zeros_like(keys_t), self._vocab, params)
        self._tokens[slots_t] = tokens
        self._positions[slots_t] = torch.tensor(positions, device=self.device)
        self._keys[slots_t] = keys_t
        self._steps[slots_t] = 1
        self._live[slots_t] = 1
        host = torch.stack((tokens.double(), logprobs.double())).cpu()
        return host[0].long().tolist(), host[1].tolist()

    def step(self, b: int, length: int, params: SamplingParams) -> LaunchedStep:
        """Launch one decode step on slots 0..b-1 over positions 0..length-1 and its sampling; the
        live slots move to their next token. The record's copy to the host is on its way."""
        logits = self.graphs.run(b, length)
        record = self._record[: 2 * b].view(2, b)
        if logits.is_cuda and not params.truncates:
            from qerl_pipe.kernels.triton_sample import launch_sample_step

            temperature = 0.0 if params.greedy else params.temperature
            launch_sample_step(logits, self._keys[:b], self._steps[:b], self._positions[:b], self._live[:b],
                               self._tokens[:b], record, temperature)
        else:
            tokens, logprobs = sample(logits, self._keys[:b], self._steps[:b], self._vocab, params)
            self._tokens[:b].copy_(tokens)
            self._positions[:b].add_(self._live[:b])  # idle slots stay at position 0
            self._steps[:b].add_(1)
            record[0].copy_(tokens)
            record[1].copy_(logprobs)
        self._launched += 1
        host = self._host[self._launched % 2][: 2 * b].view(2, b)
        host.copy_(record, non_blocking=record.is_cuda)
        done = torch.cuda.Event() if record.is_cuda else None
        if done is not None:
            done.record()
        return LaunchedStep(host, done)

    def move(self, moves: list[tuple[int, int]], length: int) -> None:
        """Each (source, destination) slot's KV rows (positions 0..length-1) and state; the sources go idle."""
        src = indices([s for s, _ in moves], self.device)
        dst = indices([d for _, d in moves], self.device)
        self.cache.copy_slots(src, dst, length)
        for buf in (self._tokens, self._positions, self._keys, self._steps, self._live):
            buf[dst] = buf[src]
        self._live[src] = 0
        self._positions[src] = 0

    def release(self, slots: list[int]) -> None:
        """Slots whose sequences finished: idle again (position 0)."""
        index = indices(slots, self.device)
        self._live[index] = 0
        self._positions[index] = 0
