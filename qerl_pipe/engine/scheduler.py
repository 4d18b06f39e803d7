"""The continuous-batching scheduler: which queued sequence decodes in which KV slot, and when.
Pure host bookkeeping on sequence and slot numbers, never a tensor: the engine asks `should_admit`,
`admit`, `plan_step` and `release`, and applies each answer to its KV cache and slot buffers. It
decides where a sequence decodes, never what it draws. See docs/engine.md, section "Scheduling"."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import takewhile

# Refill when at least this fraction of the slots is free (or the next prompt's remaining samples
# fit): each refill costs a prefill, so refilling one slot per step would prefill the same prompt
# n times, while waiting for a whole batch would idle it through the long tail.
REFILL_FRACTION = 0.25

# A group of one admission wave: the (sequence, slot) pairs of one prompt's samples, in queue
# order. The prompt is prefilled into the first pair's slot and copied into the others'.
Group = list[tuple[int, int]]


class Scheduler:
    """The queue and slot table of one generate call: `prompts[i]`, the prompt index of sequence i, prompt-major
    (all samples of a prompt together, as `Engine.generate` numbers them); `slots`, the KV cache's slot count."""

    def __init__(self, prompts: Sequence[int], slots: int, refill_fraction: float = REFILL_FRACTION):
        if slots < 1:
            raise ValueError(f"a scheduler needs at least one slot; got {slots}")
        self.slots = slots
        self._prompt = list(prompts)
        self.queue: deque[int] = deque(range(len(self._prompt)))
        self.active: dict[int, int] = {}  # slot -> sequence; read-only outside this class
        self._slot_of: dict[int, int] = {}  # sequence -> slot, the same table the other way
        self.refill_min = max(1, math.ceil(slots * refill_fraction))

    @property
    def busy(self) -> bool:
        """Whether a sequence still waits or decodes."""
        return bool(self.queue or self.active)

    def slot_of(self, sequence: int) -> int:
        """The slot an active sequence decodes in."""
        return self._slot_of[sequence]

    def should_admit(self) -> bool:
        """Whether to run an admission wave now: when nothing decodes, or when the free slots
        take the queue head's remaining samples or `refill_fraction` of the slots."""
        free = self.slots - len(self.active)
        if not self.queue or free == 0:
            return False
        if not self.active:
            return True
        head = self._prompt[self.queue[0]]
        remaining = sum(1 for _ in takewhile(lambda i: self._prompt[i] == head, self.queue))
        return free >= min(remaining, self.refill_min)

    def admit(self) -> list[Group]:
        """Move queued sequences into the lowest free slots (as many as are free) and mark them
        active; returns them grouped by prompt, in queue order."""
        free = [s for s in range(self.slots) if s not in self.active]
        taken = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
        groups: list[Group] = []
        for i, slot in zip(taken, free):
            if groups and self._prompt[groups[-1][0][0]] == self._prompt[i]:
                groups[-1].append((i, slot))
            else:
                groups.append([(i, slot)])
            self.active[slot] = i
            self._slot_of[i] = slot
        return groups

    def plan_step(self, batch_size_for: Callable[[int], int], bucketed: bool) -> tuple[int, list[tuple[int, int]]]:
        """The rows the next decode step runs on, and the (source, destination) slot moves to copy
        first (already in the slot table). `batch_size_for(slots)`: the rows a step over slots
        0..slots-1 runs on. Sequences above a smaller size holding them all move to the lowest free
        slots: whenever one would do when `bucketed` (graphs), else when at most half are live."""
        if not self.active:
            raise ValueError("no active sequence to step")
        high = max(self.active) + 1
        b = batch_size_for(high)
        count = len(self.active)
        moves: list[tuple[int, int]] = []
        if count < high:
            target = batch_size_for(count)
            if target < b and (bucketed or count <= high // 2):
                moves = self._compact(target)
                b = batch_size_for(max(self.active) + 1)
        return b, moves

    def _compact(self, target: int) -> list[tuple[int, int]]:
        """Move the sequences in slots >= target into the free slots below it, lowest first."""
        movers = sorted(s for s in self.active if s >= target)
        holes = [s for s in range(target) if s not in self.active][: len(movers)]
        for src, dst in zip(movers, holes):
            sequence = self.active.pop(src)
            self.active[dst] = sequence
            self._slot_of[sequence] = dst
        return list(zip(movers, holes))

    def release(self, slots: Iterable[int]) -> None:
        """Free the slots of sequences that finished."""
        for slot in slots:
            del self._slot_of[self.active.pop(slot)]
