"""Training checkpoints: everything a resumed run needs to continue bit for bit (adapter or float32
masters, optimizer, LR schedule, RNG states, the trainer's state). Written into a hidden sibling and
renamed into place, so a kill leaves the previous checkpoint or the new one, never half of one.
See docs/training.md, section "Checkpoints and resume"."""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qerl_pipe.errors import ArtifactError, QerlError
from qerl_pipe.model.full import FullTraining
from qerl_pipe.model.peft import ADAPTER_WEIGHTS, load_adapter_weights
from qerl_pipe.model.lora import lora_state_dict
from qerl_pipe.strict_json import write_json

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.pt"
INFO_FILE = "trainer_state.json"
# Full fine-tuning: the optimizer's float32 masters. The model's bf16 weights are their rounding,
# so the masters (not the weights) are what a resume must restore to continue bit for bit.
FULL_WEIGHTS = "full_weights.safetensors"
_NAME = re.compile(r"step-(\d+)")


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, trainer_state: dict[str, Any],
                    rank_rng_states: list[dict[str, Any]] | None = None, full: FullTraining | None = None) -> Path:
    """Write checkpoint `step` (steps done) atomically; returns its directory. `rank_rng_states`:
    every data-parallel rank's RNG states in rank order (else this process's); `full`: a fully
    fine-tuned model's masters, saved instead of the adapter."""
    from qerl_pipe.formats.checkpoint import save_safetensors

    root = run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step-{step:06d}", root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = full.state_dict() if full is not None else lora_state_dict(model)
    host = {k: v.detach().to("cpu").contiguous().clone() for k, v in weights.items()}
    save_safetensors(host, tmp / (FULL_WEIGHTS if full is not None else ADAPTER_WEIGHTS))
    del host
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": rank_rng_states[0] if rank_rng_states else rng_state(), "trainer": trainer_state}
    if rank_rng_states:
        state["rng_ranks"] = rank_rng_states
    try:  # torch.save's failed write (a full disk) is a RuntimeError without the file or errno
        torch.save(state, tmp / STATE_FILE)
    except RuntimeError as exc:
        free_mb = shutil.disk_usage(tmp).free / 2**20
        raise QerlError(f"cannot write the checkpoint {tmp / STATE_FILE} ({str(exc).splitlines()[0]}; {free_mb:.0f} MB "
                        "free on its disk): free space, then run the same command again, which resumes from the last "
                        f"checkpoint (the run's work directory {run_dir} is kept)") from None
    write_json(tmp / INFO_FILE, trainer_state)
    if final.exists():  # the same step written again (a resumed run that redid it)
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in root.iterdir():
        if old != final and _NAME.fullmatch(old.name):
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.fullmatch(p.name))]
    return max(found)[1] if found else None


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    rank: int = 0, full: FullTraining | None = None) -> dict[str, Any]:
    """Restore the adapter (or `full`'s masters), optimizer, scheduler and RNG states from `path`;
    returns the trainer state. `rank` gets its own RNG states where the checkpoint has them, else
    rank 0's."""
    try:
        if full is not None:
            from safetensors.torch import load_file

            full.load_state_dict(load_file(str(path / FULL_WEIGHTS)))
        else:
            load_adapter_weights(model, path / ADAPTER_WEIGHTS)
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise ArtifactError(f"cannot resume from {path} ({exc}); start the run over with --force") from None
    per_rank = state.get("rng_ranks") or [state["rng"]]
    set_rng_state(per_rank[rank] if rank < len(per_rank) else state["rng"])
    return state["trainer"]
