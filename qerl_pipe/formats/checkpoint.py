"""Read a (possibly NVFP4-quantized) Hugging Face checkpoint tensor by tensor from memory-mapped
safetensors shards (never torch.load), so peak memory is one module's tensors; write shards
(`ShardWriter`). See docs/formats.md, section "Reading checkpoints"."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from qerl_pipe.errors import ModelSourceError, QuantizationError
from qerl_pipe.formats import compressed_tensors as ct
from qerl_pipe.formats.modelopt_layout import QUANT_ALGOS
from qerl_pipe.formats.nvfp4 import BLOCK_SIZE, NVFP4Weight
from qerl_pipe.strict_json import write_json
from qerl_pipe.userfiles import read_user_json

QuantFormat = Literal["modelopt", "compressed-tensors"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_MODELOPT_PARTS = ("weight", "weight_scale", "weight_scale_2", "input_scale")
_CT_PARTS = (*ct.WEIGHT_SUFFIXES, ct.INPUT_SUFFIX)
# Suffix that marks a quantized module -> the suffixes of all that module's tensors.
_MARKERS: dict[str, tuple[str, ...]] = {"weight_scale_2": _MODELOPT_PARTS, "weight_packed": _CT_PARTS}


# Elements per isfinite pass: the test's bool temporary stays ~4 MB, not the size of an embedding.
_FINITE_CHUNK = 1 << 22


def refuse_non_finite(name: str, tensor: Tensor) -> None:
    """Refuse a floating tensor holding NaN or inf, naming it: any such weight (a norm's included)
    makes every later figure NaN, and a stage that wrote on would seal NaN into its artifact."""
    if not tensor.is_floating_point():
        return
    flat = tensor.reshape(-1)
    if not all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(_FINITE_CHUNK)):
        raise QuantizationError(f"{name} has non-finite values (NaN or inf): the model's weights are damaged; "
                                "re-download or re-convert the model")


def detect_quant_format(config: dict[str, Any]) -> QuantFormat | None:
    """Which NVFP4 layout a config.json describes; None when unquantized. A ModelSourceError for what we
    cannot read (GPTQ, AWQ, FP8, ...), rather than packed bytes loaded as if they were weights."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "modelopt":
        algo = qc.get("quant_algo")
        if algo not in QUANT_ALGOS:
            raise ModelSourceError(f"modelopt quant_algo {algo!r} is not supported; qerl-pipe reads "
                                   f"{' and '.join(QUANT_ALGOS)} checkpoints")
        return "modelopt"
    if method == "compressed-tensors":
        formats = {qc.get("format")} | {g.get("format") for g in qc.get("config_groups", {}).values()}
        if formats - {ct.FORMAT, None} or formats == {None}:
            raise ModelSourceError(f"compressed-tensors format {sorted(map(str, formats))} is not supported; "
                                   f"qerl-pipe reads {ct.FORMAT!r} (NVFP4)")
        return "compressed-tensors"
    raise ModelSourceError(f"quantization method {method!r} is not supported; use an unquantized model or an NVFP4 "
                           "checkpoint from modelopt or llm-compressor")


def _read_index(model_dir: Path) -> dict[str, Path] | None:
    """The index's tensor key -> shard path map; None for a single-file checkpoint."""
    index_path = model_dir / INDEX_FILE
    if not index_path.exists():
        return None
    try:
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        return {key: model_dir / file for key, file in weight_map.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ModelSourceError(f"cannot read {index_path}: {err}") from err


def list_shards(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files in order: from the index, else the single file."""
    model_dir = Path(model_dir)
    index = _read_index(model_dir)
    if index is not None:
        paths = list(dict.fromkeys(index.values()))
    elif (model_dir / SINGLE_FILE).exists():
        paths = [model_dir / SINGLE_FILE]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise ModelSourceError(f"no .safetensors files in {model_dir}; qerl-pipe reads only safetensors")
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise ModelSourceError(f"{model_dir} lacks shard {missing[0]} named by {INDEX_FILE}; download it again")
    return paths


# safetensors reports a failed write as SafetensorError("I/O error: No space left on device (os error
# 28)"): the errno it carries makes it the OSError it is, which the CLI reports as one line with the fix.
_OS_CODE = re.compile(r"os error (\d+)|Os \{ code: (\d+)")


def _as_os_error(exc: SafetensorError, path: Path) -> Exception:
    match = _OS_CODE.search(str(exc))
    if match is None:
        return exc
    code = int(match.group(1) or match.group(2))
    return OSError(code, os.strerror(code), str(path))


def save_safetensors(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, the file then 0666 minus the umask (safetensors makes it 0600: a
    serving process of another user could not read a checkpoint or adapter written here)."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        raise _as_os_error(exc, path) from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def open_shard(path: Path) -> Any:
    """`safe_open` a shard (memory-mapped, no pickle); a truncated or foreign file is a ModelSourceError."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (OSError, SafetensorError) as err:
        raise ModelSourceError(f"cannot read {path}: {err}; the file is missing, truncated or not safetensors") from err


class _Shards:
    """Open shards (memory-mapped) and the file of each tensor key."""

    def __init__(self, paths: list[Path], index: dict[str, Path] | None) -> None:
        self.handles: dict[Path, Any] = {path: open_shard(path) for path in paths}
        self.file_of: dict[str, Path] = {key: path for path, handle in self.handles.items() for key in handle.keys()}
        for key, file in (index or {}).items():
            if self.file_of.get(key) != file:
                raise ModelSourceError(f"{INDEX_FILE} puts {key} in {file.name}, but that file does not hold it; "
                                       "the checkpoint is incomplete")

    def get(self, key: str) -> Tensor:
        path = self.file_of[key]
        try:
            return self.handles[path].get_tensor(key)
        except SafetensorError as err:
            raise ModelSourceError(f"cannot read tensor {key} from {path}: {err}") from err


def _nvfp4_parts(module: str, parts: dict[str, Tensor]) -> tuple[NVFP4Weight, Tensor | None]:
    is_ct = "weight_packed" in parts
    required = ct.WEIGHT_SUFFIXES if is_ct else _MODELOPT_PARTS[:3]
    missing = [s for s in required if s not in parts]
    if missing:
        raise ModelSourceError(f"quantized module {module} lacks {', '.join(missing)}")
    if is_ct:
        weight, input_scale = ct.nvfp4_from_compressed(parts)
    else:
        # Some exporters store the 0-dim scales as [1]; both mean one scale per tensor.
        weight = NVFP4Weight(parts["weight"], parts["weight_scale"], parts["weight_scale_2"].float().reshape(()))
        input_scale = parts.get("input_scale")
        input_scale = None if input_scale is None else input_scale.float().reshape(())
    packed, scales = weight.packed, weight.block_scales
    if (packed.dtype != torch.uint8 or scales.dtype != torch.float8_e4m3fn or packed.dim() != 2
            or scales.shape != (packed.shape[0], packed.shape[1] * 2 // BLOCK_SIZE)):
        raise ModelSourceError(f"quantized module {module} has packed {packed.dtype} {tuple(packed.shape)} and scales "
                               f"{scales.dtype} {tuple(scales.shape)}; NVFP4 needs uint8 [N, K/2] and "
                               "float8_e4m3fn [N, K/16]")
    return weight, input_scale


def iter_quantized_checkpoint(model_dir: Path) -> Iterator[tuple[str, NVFP4Weight | Tensor, Tensor | None]]:
    """Yield (name, weight, input_scale) for every tensor group of a checkpoint, one at a time:
    quantized linears as (module name, NVFP4Weight, input_scale or None), other tensors as (full
    name, tensor, None). config.json is checked first: an unsupported quantization fails clearly."""
    model_dir = Path(model_dir)
    if (model_dir / "config.json").exists():
        detect_quant_format(read_user_json(model_dir / "config.json", "model config", ModelSourceError))
    shards = _Shards(list_shards(model_dir), _read_index(model_dir))

    quantized: dict[str, tuple[str, ...]] = {}  # module -> its part suffixes
    for key in shards.file_of:
        module, _, suffix = key.rpartition(".")
        if suffix in _MARKERS:
            quantized[module] = _MARKERS[suffix]

    done: set[str] = set()
    for key in shards.file_of:  # shard order, then each shard's own key order
        module, _, suffix = key.rpartition(".")
        if module in quantized and suffix in quantized[module]:
            if module in done:
                continue
            done.add(module)
            parts = {s: shards.get(f"{module}.{s}") for s in quantized[module] if f"{module}.{s}" in shards.file_of}
            yield module, *_nvfp4_parts(module, parts)
        else:
            yield key, shards.get(key), None


# Output shards close at this size: it bounds the host memory of a writer (one shard buffered).
SHARD_BYTES = 2 * 2**30


def cast_floating(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    """`tensor` in `dtype` if it is floating point (integer tensors such as packed codes stay)."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def shard_names(count: int) -> list[str]:
    """Hugging Face's names for a checkpoint of `count` safetensors shards."""
    return [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class ShardWriter:
    """A Hugging Face checkpoint's safetensors shards, written as they fill (up to SHARD_BYTES: host
    memory holds one), then the index; quantize and export. With `shards` (one output shard per
    input shard, `close_shard`) files get their final names at once, else hidden parts that
    `finish` renames once the count is known."""

    def __init__(self, out: Path, max_bytes: float | None = None, shards: int | None = None) -> None:
        self.out, self.max_bytes = out, max_bytes or SHARD_BYTES
        self.final_names = shard_names(shards) if shards else None
        self.buffer: dict[str, Tensor] = {}
        self.buffered = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.buffered + nbytes > self.max_bytes:
            self.close_shard()
        self.buffer[name] = tensor.contiguous()
        self.buffered += nbytes
        self.total += nbytes

    def close_shard(self) -> None:
        """End the current shard here, even an empty one."""
        n = len(self.files)
        name = self.final_names[n] if self.final_names else f".part-{n:05d}.safetensors"
        save_safetensors(self.buffer, self.out / name, metadata={"format": "pt"})
        self.files.append((self.out / name, list(self.buffer)))
        self.buffer, self.buffered = {}, 0

    def finish(self) -> None:
        if self.buffer or not self.files:
            self.close_shard()
        names = shard_names(len(self.files))
        weight_map = {}
        for (path, keys), name in zip(self.files, names):
            if path.name != name:
                path.rename(self.out / name)
            weight_map.update({k: name for k in keys})
        if len(names) > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            write_json(self.out / INDEX_FILE, index)
