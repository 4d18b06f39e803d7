"""Data-parallel training over several processes (torchrun), and the single-process no-op (`Dist()`).

Every rank holds the whole model; a prompt's G samples stay on its rank; rewards, loss counts and
LoRA gradients are made global by a few collectives; NVLink multicast stays off (`NVLS_OFF`, set
before the process group exists). See docs/training.md, section "Several GPUs"."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch

from qerl_pipe.errors import QerlError
from qerl_pipe.rl.algo.losses import LossNorm

NVLS_OFF: dict[str, str] = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                            "NVSHMEM_DISABLE_NVLS": "1"}
# Rank 0 alone evaluates and seals the artifact while the others wait in a barrier: give that
# wait room (the default would abort a long evaluation after 10-30 minutes).
COLLECTIVE_TIMEOUT = timedelta(hours=2)

T = TypeVar("T")


def disable_nvls(env: dict[str, str] | None = None) -> dict[str, str]:
    """Set the NVLS-off variables in `env` (default: this process's environment); returns it."""
    target = os.environ if env is None else env
    target.update(NVLS_OFF)
    return target  # type: ignore[return-value]


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def shard(count: int, rank: int, world: int) -> range:
    """The contiguous share [rank * count / world, (rank + 1) * count / world) of `count` prompts; equal
    shares only (the slowest rank of an uneven split would set the pace)."""
    if count % world:
        raise QerlError(f"train.prompts_per_step={count} does not split evenly over {world} processes; "
                        f"make it a multiple of {world}")
    size = count // world
    return range(rank * size, (rank + 1) * size)


@dataclass(frozen=True)
class Dist:
    """This process's place in the data-parallel group (defaults: one process, no collectives)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, count: int) -> range:
        return shard(count, self.rank, self.world_size)

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's `obj` (small, picklable), in rank order."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks, in float64 (token counts and metric sums stay exact)."""
        return self._reduce(values, "SUM")

    def max(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, "MAX")

    def _reduce(self, values: Sequence[float], op: str) -> list[float]:
        if not self.enabled:
            return [float(v) for v in values]
        nccl = torch.distributed.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        t = torch.tensor(list(values), dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op))
        return t.tolist()

    def sum_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """All-reduce (sum) the gradients of `params` in one flat float32 bucket: losses are already
        over the global normaliser, so the sum is the batch's gradient. A rank without rows adds
        zeros; a gradient stays None only where every rank's is (AdamW skips it, as in one
        process). Every rank ends with the same gradients and optimizer step."""
        if not self.enabled:
            return
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.float32)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in params] + [present.to(params[0].device)])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p, seen in zip(params, flat[-len(params):].tolist()):
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).to(p.dtype) if seen else None
            offset += n

    def broadcast_parameters(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Rank 0's values everywhere: the ranks start (and stay) on the same adapter."""
        if not self.enabled:
            return
        with torch.no_grad():
            for p in params:
                torch.distributed.broadcast(p.data, src=0)


def init_distributed(device_choice: str) -> tuple[Dist, str]:
    """Join the torchrun group when WORLD_SIZE > 1; returns (Dist, the device this rank uses): CUDA ranks
    cuda:LOCAL_RANK and NCCL, CPU ranks gloo; one process (Dist(), choice)."""
    if not launched_by_torchrun():
        return Dist(), device_choice
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    if cuda and torch.cuda.device_count() <= local:
        raise QerlError(f"process {rank} needs GPU {local} but {torch.cuda.device_count()} are visible; "
                        "launch at most one process per GPU")
    disable_nvls()
    if not torch.distributed.is_initialized():
        if cuda:
            torch.cuda.set_device(local)
        torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return Dist(rank, world, local), f"cuda:{local}" if cuda else "cpu"


@contextmanager
def group_lifetime() -> Iterator[None]:
    """Around a process's distributed work: on the way out, destroy the group it joined (gloo's
    threads must be joined before exit, or SIGABRT after a good run). After success every rank gets
    here: wait, destroy. After an error gloo's group goes at once; an NCCL group is left to the
    exiting process (destroying it could wait on collectives peers never finish)."""
    try:
        yield
    except BaseException:
        if _joined() and torch.distributed.get_backend() == "gloo":
            torch.distributed.destroy_process_group()
        raise
    if _joined():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _joined() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def current_dist() -> Dist:
    """The group this process already joined (or Dist() when none)."""
    if _joined():
        return Dist(torch.distributed.get_rank(), torch.distributed.get_world_size(),
                    int(os.environ.get("LOCAL_RANK", "0")))
    return Dist()


def global_loss_norm(local: LossNorm, dist: Dist) -> LossNorm:
    """The whole batch's counts from each rank's: DAPO's token mean, GRPO's and Dr. GRPO's
    sequence counts then divide by every rank's tokens/sequences, as one process would."""
    sequences, tokens = dist.sum([local.sequences, local.tokens])
    return LossNorm(int(sequences), int(tokens))
