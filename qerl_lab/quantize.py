"""`qerl-pipe bench quantize`: what the quantize stage costs and how much quality it keeps.

Runs the stage in a fresh store on (a) the given model source and (b) a random-init model of
Qwen2.5-0.5B's shapes saved in many shards, and reports time, peak host memory against the size
of one shard plus one tensor (the streaming design's promise), and the quality figures. Each run
is a fresh `qerl-pipe quantize` process: in one long process, memory freed by an earlier run
would hide what the next one needs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from qerl_lab.layer_errors import compare_methods, print_comparison, read_layer_errors
from qerl_lab.results import results_file, target
from qerl_pipe.errors import QerlError

# Qwen2.5-0.5B's layer shapes (with a 32k vocabulary, so no single tensor dominates a shard): big
# enough that a whole-model load would dwarf one shard.
SHARDED_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=True,
                     max_position_embeddings=4096)


def _largest_tensor_bytes(model_dir: Path) -> int:
    from qerl_pipe.formats.checkpoint import list_shards, open_shard

    largest = 0
    for shard in list_shards(model_dir):
        with open_shard(shard) as fh:
            for name in fh.keys():
                sl = fh.get_slice(name)
                numel = 1
                for d in sl.get_shape():
                    numel *= d
                largest = max(largest, numel * 2)
    return largest


def _input_dir(artifact: Path) -> Path:
    """The model directory a quantize artifact was made from (an import artifact or a local dir)."""
    config = json.loads((artifact / "manifest.json").read_text())["config"]["model"]
    content = config.get("content") or {}
    if content.get("artifact"):
        return artifact.parent / f"import-{content['artifact']}"
    return Path(config["source"]["source"])


def _stage(stage: str, source: str, store: Path, options: list[str]) -> Path:
    """Run one stage command in a fresh process; the artifact it printed."""
    command = [sys.executable, "-m", "qerl_pipe", stage, "--model", source, "--artifacts", str(store), *options]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise QerlError(f"bench quantize: `{stage}` failed on {source}: {done.stderr.strip().splitlines()[-1]}")
    return Path(done.stdout.strip().splitlines()[-1])


def _quantize(source: str, store: Path, overrides: list[str], force: bool = False,
              calibration: Path | None = None) -> Path:
    """One `qerl-pipe quantize` in a fresh process; the artifact."""
    options = (["--force"] if force else []) + (["--calibration", str(calibration)] if calibration else [])
    for override in overrides:
        options += ["--set", override]
    return _stage("quantize", source, store, options)


def _row(source: str, artifact: Path) -> dict[str, Any]:
    s = json.loads((artifact / "manifest.json").read_text())["summary"]
    return {"source": source, **{k: s.get(k) for k in (
        "method", "quantized_linears", "mean_relative_error", "max_relative_error", "mean_output_relative_error",
        "max_output_relative_error", "size_mb", "shards", "largest_shard_mb", "peak_host_memory_mb", "perplexity",
        "seconds")}}


def _quantize_row(source: str, store: Path, overrides: list[str], force: bool = False,
                  calibration: Path | None = None) -> dict[str, Any]:
    return _row(source, _quantize(source, store, overrides, force, calibration))


def _sharded_model(out: Path, shard_mb: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SHARDED_SHAPE), dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=f"{shard_mb}MB")
    (out / "tokenizer_config.json").write_text("{}\n")
    return out


def run_quantize_bench(source: str, shard_mb: int = 64) -> dict[str, Any]:
    rows = []
    targets = []
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "artifacts"
        # The first run also imports a GGUF source, which loads the whole model in that process and
        # would hide the stage's own memory; the figures come from a second, forced run.
        _quantize_row(source, store, ["quantize.quality.perplexity=always"])
        rows.append(_quantize_row(source, store, ["quantize.quality.perplexity=always"], force=True))
        sharded_dir = _sharded_model(Path(tmp) / "sharded", shard_mb)
        tensor_mb = _largest_tensor_bytes(sharded_dir) / 2**20
        row = _quantize_row(str(sharded_dir), store, ["quantize.quality.perplexity=never"])
        row["source"] = f"random Qwen2.5-0.5B layer shapes, 32k vocab, {shard_mb} MB shards"
        row["largest_tensor_mb"] = tensor_mb
        rows.append(row)
    bound = row["largest_shard_mb"] + tensor_mb
    targets.append(target(
        "quantize peak host memory near one shard plus one tensor (<= 1.5x their sum)",
        f"<= {1.5 * bound:.0f} MB (shard {row['largest_shard_mb']:.0f} MB + tensor {tensor_mb:.0f} MB, x1.5)",
        round(row["peak_host_memory_mb"], 1), "MB", row["peak_host_memory_mb"] <= 1.5 * bound))
    targets.append(target(
        "quantize peak host memory well under the whole bf16 model (< 50%)",
        f"< {0.5 * row['size_mb']['in']:.0f} MB", round(row["peak_host_memory_mb"], 1), "MB",
        row["peak_host_memory_mb"] < 0.5 * row["size_mb"]["in"]))
    return results_file(rows, targets)


# The calibrated-quantization target: perplexity increase over bf16 on the held-out quality text.
METHODS_TARGET_PCT = 12.0


def run_quantize_methods_bench(source: str, methods: list[str]) -> dict[str, Any]:
    """Each block-scale method on one model: perplexity vs bf16 (the quality section's held-out
    text), time, and per-layer weight and expected output error side by side with rtn's. One
    calibrate run (default recipe: gsm8k:train) serves every method: act-mse's search and every
    method's output error (the weights of rtn and mse do not depend on it); each quantize is a
    fresh process."""
    if "rtn" not in methods:
        methods = ["rtn", *methods]  # the baseline of the per-layer comparison
    rows = []
    layers = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "artifacts"
        calibration = _stage("calibrate", source, store, [])
        for method in methods:
            artifact = _quantize(source, store, ["quantize.quality.perplexity=always", f"quantize.method={method}"],
                                 calibration=calibration)
            rows.append(_row(source, artifact))
            rows[-1]["largest_tensor_mb"] = _largest_tensor_bytes(_input_dir(artifact)) / 2**20
            layers[method] = read_layer_errors(artifact)
    comparison = compare_methods(layers)
    print_comparison(comparison)
    targets = []
    for row in rows:
        if row["method"] != "rtn":
            pct = row["perplexity"]["increase_pct"]
            targets.append(target(f"{row['method']}: perplexity increase over bf16", f"<= +{METHODS_TARGET_PCT}%",
                                  pct, "%", pct <= METHODS_TARGET_PCT))
        # The stage streams one shard at a time whatever the method (today's bound, issue 19).
        bound = row["largest_shard_mb"] + row["largest_tensor_mb"]
        targets.append(target(
            f"{row['method']}: quantize peak host memory near one shard plus one tensor (<= 1.5x their sum)",
            f"<= {1.5 * bound:.0f} MB (shard {row['largest_shard_mb']:.0f} MB + tensor {row['largest_tensor_mb']:.0f} MB, x1.5)",
            round(row["peak_host_memory_mb"], 1), "MB", row["peak_host_memory_mb"] <= 1.5 * bound))
    if "act-mse" in layers:
        # What act-mse minimises per block, summed per layer: it can only match or beat rtn.
        worse = comparison["methods"]["act-mse"]["vs_rtn"]["layers_output_worse"]
        targets.append(target("act-mse: layers whose expected output error is above rtn's", "0", worse, "layers",
                              worse == 0))
    return results_file(rows, targets, calibration="default calibrate recipe (128 x 256 tokens of gsm8k:train)",
                        layer_errors=comparison)
