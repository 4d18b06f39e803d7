"""A step's rollouts cut over the data-parallel ranks, so that every rank's view of a step is the one
a single process would have: `Draw.gather` joins the ranks' shares of a draw in prompt order, and
`KeptGroups` makes the same keep/stop decisions on every rank, advantages over the whole batch.
See docs/training.md, section "Several GPUs"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor

from qerl_pipe.rl.algo.advantages import group_advantages
from qerl_pipe.rl.loop.distributed import Dist

G = TypeVar("G")


@dataclass
class Draw:
    """The figures of one rollout draw's P prompts x G samples, in prompt order: one rank's share
    (small and picklable, what the other ranks need to see) or, gathered, the whole draw."""

    rewards: Tensor  # [P * G]
    correct: list[bool]
    lengths: list[int]
    finish_reasons: list[str]
    tokens: int
    seconds: float  # gathered: the slowest rank's, which sets the pace
    sample: tuple[str, str]  # (question, completion) of its first rollout: kept in metrics.jsonl

    def gather(self, dist: Dist) -> "Draw":
        """The whole draw from every rank's share (this one included)."""
        parts = dist.all_gather(self)
        return Draw(torch.cat([p.rewards for p in parts]), [c for p in parts for c in p.correct],
                    [n for p in parts for n in p.lengths], [f for p in parts for f in p.finish_reasons],
                    sum(p.tokens for p in parts), max(p.seconds for p in parts), parts[0].sample)


class KeptGroups(Generic[G]):
    """The groups kept so far in a step, in whole-batch order, up to `wanted` of them."""

    def __init__(self, share: range, group_size: int, wanted: int):
        self.share, self.group_size, self.wanted = share, group_size, wanted
        self._rewards: list[Tensor] = []  # every kept group's, whatever rank holds it
        self._groups: list[G | None] = []  # this rank's groups; None: another rank's

    def keep(self, prompt: int, rewards: Tensor, make: Callable[[int], G]) -> None:
        """Keep the group of the draw's prompt `prompt` (its index in the whole draw), with its G
        `rewards`; `make(i)` builds the group of this rank's i-th prompt, called for its own only."""
        self._rewards.append(rewards)
        self._groups.append(make(prompt - self.share.start) if prompt in self.share else None)

    def __len__(self) -> int:
        return min(len(self._groups), self.wanted)

    def full(self) -> bool:
        return len(self._groups) >= self.wanted

    def with_advantages(self, scale_rewards: str) -> list[tuple[G, Tensor]]:
        """This rank's kept groups, each with its advantages over the whole batch (the 'batch'
        scaling needs the std of every rank's rewards: computed on all of them)."""
        groups, rewards = self._groups[:self.wanted], self._rewards[:self.wanted]
        if not groups:
            return []
        g = self.group_size
        advantages = group_advantages(torch.cat(rewards), g, scale_rewards)
        return [(group, advantages[i * g:(i + 1) * g]) for i, group in enumerate(groups) if group is not None]
