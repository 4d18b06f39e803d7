"""The calibration artifact's files: what `calibrate` writes and `quantize` reads.

`calibration.json` holds per-linear statistics (input amax, weight amax/rms);
`channel_mean_square.safetensors` each linear's per-input-channel mean square of its inputs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

STATS_FILE = "calibration.json"
CHANNELS_FILE = "channel_mean_square.safetensors"


def read_input_amax(calibration_dir: Path) -> dict[str, float]:
    stats = json.loads((calibration_dir / STATS_FILE).read_text())
    return {name: v["input_amax"] for name, v in stats["linears"].items()}


def read_channel_mean_square(calibration_dir: Path) -> dict[str, torch.Tensor]:
    """Each linear's per-input-channel mean square of its calibration inputs."""
    path = calibration_dir / CHANNELS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{calibration_dir} has no {CHANNELS_FILE}; re-run `qerl-pipe calibrate`")
    return load_file(str(path))
