"""Our Decoder's weights as a Hugging Face model's (`save_hf_weights`), which `from_pretrained` reads.
See docs/model.md, section "The model (`qerl_pipe/model/`)" (the table of files)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from torch import Tensor

from qerl_pipe.formats.checkpoint import ShardWriter
from qerl_pipe.formats.names import hf_name
from qerl_pipe.kernels.base_formats import base_format as format_entry
from qerl_pipe.model.decoder import Decoder
from qerl_pipe.model.linear import QuantLinear


def hf_tensors(model: Decoder) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) for every weight of a bf16-base model, in model order, views (no copies)."""
    if not format_entry(model.base_format).dense:
        raise ValueError(f"only a bf16 base has dense weights to save as a Hugging Face model, not {model.base_format}")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    for name, t in model.state_dict(keep_vars=True).items():
        module_name, _, kind = name.rpartition(".")
        linear = linears.get(module_name)
        if linear is not None:
            parent = module_name.rpartition(".")[0]
            for proj, part in zip(linear.names, t.detach().split(linear.out_sizes)):
                yield hf_name(f"{parent}.{proj}.{kind}"), part
        elif name == "lm_head.weight":
            if not model.config.tie_word_embeddings:
                yield name, t.detach()
        else:
            yield hf_name(name), t.detach()


def save_hf_weights(model: Decoder, out_dir: Path) -> int:
    """Write the model's weights, in its dtype, as `model.safetensors`, or HF-named shards plus their
    index past `checkpoint.SHARD_BYTES`. Returns the bytes written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out_dir)
    for name, t in hf_tensors(model):
        # clone: safetensors refuses views into a shared storage (the split projections).
        writer.add(name, t.to("cpu", model.dtype).clone())
    writer.finish()
    return writer.total
