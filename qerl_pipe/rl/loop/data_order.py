"""Which problems each step trains on: a seeded permutation per epoch, and the position in it."""

from __future__ import annotations

from typing import Any

import torch


class DataOrder:
    """Hands out problem indices B at a time: epoch e visits all `size` problems in the order of
    randperm(size, seed + e); `state_dict` (epoch, position) is what a checkpoint keeps."""

    def __init__(self, size: int, seed: int):
        if size < 1:
            raise ValueError("no problems to train on")
        self.size, self.seed = size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def take(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            n = min(count - len(out), self.size - self.position)
            out += self._order[self.position:self.position + n]
            self.position += n
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["size"], state["seed"]) != (self.size, self.seed):
            raise ValueError(f"checkpoint data order is for {state['size']} problems / seed {state['seed']}, "
                             f"this run has {self.size} / {self.seed}")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation()
