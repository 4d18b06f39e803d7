"""`qerl-pipe calibrate`: activation and weight statistics of the unquantized model.

Per linear: the running max of |input| (NVFP4's `input_scale`), each input channel's mean square
(what `act-mse` weighs by) and weight amax / rms. See docs/pipeline.md, section
"What calibrate and quantize compute"."""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Any

import torch

from qerl_pipe.artifacts import Artifact, ArtifactStore, PendingArtifact
from qerl_pipe.dag import CALIBRATE, register
from qerl_pipe.errors import QerlError
from qerl_pipe.formats.calibration import CHANNELS_FILE, STATS_FILE
from qerl_pipe.formats.checkpoint import refuse_non_finite, save_safetensors
from qerl_pipe.hf import compute_dtype, count_parameters, load_hf_causal_lm, load_tokenizer, pick_device
from qerl_pipe.log import log, progress
from qerl_pipe.model.config import DecoderConfig
from qerl_pipe.recipe import CalibrateSection, Recipe
from qerl_pipe.runner import StageCall
from qerl_pipe.sources import model_config_key
from qerl_pipe.strict_json import write_json
from qerl_pipe.textdata import load_texts, pack_sequences
from qerl_pipe.userfiles import data_file_key, data_spec_key

STAGE = CALIBRATE


def _weight_stats(weight: torch.Tensor) -> dict[str, float]:
    w = weight.detach().float()
    amax = float(w.abs().max())
    rms = float(w.pow(2).mean().sqrt())
    return {"weight_amax": amax, "weight_rms": rms, "weight_amax_over_rms": amax / rms if rms > 0 else 0.0}


def collect_input_stats(model: torch.nn.Module, batches) -> tuple[dict[str, float], dict[str, torch.Tensor], int]:
    """Run the batches; return each nn.Linear's max |input|, its inputs' per-channel mean square
    (float32 [in_features]), and the token count."""
    amax: dict[str, torch.Tensor] = {}
    square_sums: dict[str, torch.Tensor] = {}
    handles = []

    def hook_for(name: str):
        def hook(_module, args):
            x = args[0].detach()
            current = x.abs().amax().float()
            amax[name] = torch.maximum(amax[name], current) if name in amax else current
            squares = x.float().pow(2).reshape(-1, x.shape[-1]).sum(0)
            square_sums[name] = square_sums[name] + squares if name in square_sums else squares
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            handles.append(module.register_forward_pre_hook(hook_for(name)))
    tokens = 0
    try:
        with torch.inference_mode():
            # The decoder body alone: lm_head is never quantized, and the logits are the costliest part.
            body = getattr(model, "model", model)
            for batch in batches:
                body(input_ids=batch, use_cache=False)
                tokens += batch.numel()
    finally:
        for handle in handles:
            handle.remove()
    mean_square = {name: (v / max(tokens, 1)).cpu().contiguous() for name, v in square_sums.items()}
    return {name: float(value) for name, value in amax.items()}, mean_square, tokens


def check_calibrate_recipe(recipe: Recipe, store: ArtifactStore) -> None:
    """The check before any work (and `run`'s before its first stage): the calibration text loads."""
    load_texts(recipe.calibrate.data, recipe.calibrate.field)


def _calibrate(pending: PendingArtifact, *, resolved: Any, section: CalibrateSection, trust_remote_code: bool) -> None:
    """The model's activation and weight statistics on the section's text, into `pending`."""
    started = time.perf_counter()
    device = pick_device(section.device)
    dtype = compute_dtype(section.dtype, device, count_parameters(resolved.config))
    tokenizer = load_tokenizer(resolved.dir, trust_remote_code)
    ids = pack_sequences(load_texts(section.data, section.field), tokenizer, section.num_samples, section.seq_len)
    model = load_hf_causal_lm(resolved.dir, dtype, device, trust_remote_code)
    for name, tensor in model.state_dict().items():  # a NaN norm would surface as some linear's input
        refuse_non_finite(name, tensor)
    log(f"calibrate: {section.num_samples} x {section.seq_len} tokens of {section.data} on {device} ({dtype})")
    batches = (chunk.to(device) for chunk in ids.split(section.batch_size))
    n_batches = -(-section.num_samples // section.batch_size)
    input_amax, mean_square, tokens = collect_input_stats(model, progress(batches, "calibrate", n_batches))
    linears = {name: {"input_amax": input_amax[name], **_weight_stats(module.weight)}
               for name, module in model.named_modules() if name in input_amax}
    _check_finite(linears, mean_square)
    stats = {"tokens": tokens, "data": section.data, "device": str(device), "dtype": str(dtype), "linears": linears}
    write_json(pending.dir / STATS_FILE, stats)
    save_safetensors({name: mean_square[name] for name in linears}, pending.dir / CHANNELS_FILE)
    worst = max(linears.items(), key=lambda kv: kv[1]["weight_amax_over_rms"])
    pending.summary.update({
        "tokens": tokens,
        "linears": len(linears),
        "max_input_amax": max(v["input_amax"] for v in linears.values()),
        "max_weight_amax_over_rms": {"module": worst[0], "value": worst[1]["weight_amax_over_rms"]},
        "seconds": round(time.perf_counter() - started, 2),
    })
    log(f"calibrate: {tokens} tokens through {len(linears)} linears in {pending.summary['seconds']} s")


@register(STAGE, check=check_calibrate_recipe)
def calibrate_stage(call: StageCall) -> Artifact:
    """Calibrate the recipe's model (no inputs, so `build_missing` changes nothing)."""
    recipe = call.recipe
    if not call.find_only:  # before a GGUF import
        check_calibrate_recipe(recipe, call.store)
    resolved = call.model()
    DecoderConfig.from_hf(resolved.config)
    section = recipe.calibrate
    config = {"model": model_config_key(resolved, recipe.model),
              "calibrate": section.model_dump() | {"data": data_spec_key(section.data)}}
    data_sha256 = data_file_key(section.data)
    if data_sha256 is not None:
        config["data_sha256"] = data_sha256  # an edited file is new data

    build = partial(_calibrate, resolved=resolved, section=section, trust_remote_code=recipe.model.trust_remote_code)
    return call.seal(config=config, parents=resolved.parents, build=build)


def _check_finite(linears: dict[str, dict[str, float]], mean_square: dict[str, torch.Tensor]) -> None:
    """NaN or inf statistics mean a damaged model; writing them would poison every later stage."""
    for name, stats in linears.items():
        bad = [key for key, value in stats.items() if not math.isfinite(value)]
        if bad or not bool(torch.isfinite(mean_square[name]).all()):
            what = "weight" if any(k.startswith("weight") for k in bad) else "input activation"
            raise QerlError(f"{name}: non-finite {what} statistics (NaN or inf); the model's weights are damaged, "
                            "re-download or re-convert it")
