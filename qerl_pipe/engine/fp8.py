"""FP8 rollouts (`engine.activations: fp8`): E4M3 copies of the dense linears' bases, made once when
the engine starts (`Fp8Linears`), serve the rollout projections of at least `min_rows` rows with
per-token E4M3 activations, which the norm kernel writes beside its bf16 output (elsewhere our row
kernel, down's with the gate fused); the adapter stays bf16 and training never sees FP8.
`check_activations` and `check_kv_cache` refuse what cannot run here. docs/kernels.md#fp8-rollouts has the design."""

from __future__ import annotations


import torch
from torch import Tensor, nn

from qerl_pipe.errors import QerlError
from qerl_pipe.kernels.base_formats import BaseFormat
from qerl_pipe.kernels.base_formats import base_format as format_entry
from qerl_pipe.kernels.fp8 import Fp8Rows, Fp8Weight, fp8_linear, quantize_rows, quantize_weight, runs_fp8
from qerl_pipe.kernels.triton_fp8 import gated_rows
from qerl_pipe.log import log
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.model.moe import SparseMoE

ACTIVATIONS = ("bf16", "fp8")

# The fewest rows a projection of an NVFP4 base must have to run in FP8. Measured on an H100
# (bench/results/fp8/fp8-rows-triton-h100.json, 7B layer-weighted, quantization included): our
# W4A16 GEMM 74.3 us against FP8's 114.1 at M = 16, 142.6 against 124.1 at M = 64 (every layer
# faster in FP8 there). A bf16 base runs FP8 from one row.
NVFP4_MIN_ROWS = 64


def min_rows(fmt: BaseFormat) -> int:
    """The fewest rows a projection of base format `fmt` runs in FP8."""
    return 1 if fmt.dense else NVFP4_MIN_ROWS


def check_activations(activations: str, base_format: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, in one line that names the fix, what cannot run FP8 activations here."""
    if activations not in ACTIVATIONS:
        raise QerlError(f"engine.activations={activations!r}: choose one of {', '.join(ACTIVATIONS)}")
    if activations != "fp8":
        return
    fmt = format_entry(base_format)
    if not (fmt.dense or fmt.hopper_dispatch):
        raise QerlError(f"engine.activations=fp8 takes an nvfp4 or bf16 base, not {base_format} (the QLoRA "
                        "baseline runs bitsandbytes' kernels as its users do); set engine.activations=bf16")
    if device.type == "cuda" and not runs_fp8(device):
        name = torch.cuda.get_device_name(device)
        raise QerlError(f"engine.activations=fp8 needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper or "
                        f"newer); {name} has none; set engine.activations=bf16")
    if device.type == "cuda" and dtype != torch.bfloat16:  # the FP8 GEMM writes bf16
        raise QerlError(f"engine.activations=fp8 runs bfloat16 models on a GPU, not {str(dtype).removeprefix('torch.')}; "
                        "set engine.dtype=bfloat16 or engine.activations=bf16")


def check_kv_cache(kv_cache: str, device: torch.device) -> None:
    """Refuse an FP8 KV cache where its kernels cannot run (Triton's E4M3 needs FP8 hardware)."""
    if kv_cache == "fp8" and device.type == "cuda" and not runs_fp8(device):
        name = torch.cuda.get_device_name(device)
        raise QerlError(f"engine.kv_cache=fp8 needs FP8 support (compute capability 8.9+: Ada, Hopper or newer); "
                        f"{name} has none; set engine.kv_cache=bf16")


def fp8_linears(model: nn.Module) -> list[QuantLinear]:
    """The linears that get an FP8 copy: every decoder layer's attention and dense-MLP projections
    whose sizes the FP8 GEMM takes (multiples of 16; every real model's are)."""
    out = []
    for layer in model.layers:
        out += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
        if not isinstance(layer.mlp, SparseMoE):
            out += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return [linear for linear in out if linear.in_features % 16 == 0 and linear.out_features % 16 == 0]


def _dense_base(linear: QuantLinear) -> Tensor:
    if linear.fmt.dense:
        return linear.weight
    return linear.fmt.dense_copy(linear.kernel_weight, torch.bfloat16)


class Fp8Linears:
    """The FP8 copies of a model's linears (`fp8_linears`) and the rows they serve."""

    def __init__(self, model: nn.Module):
        self.copies: dict[QuantLinear, Fp8Weight] = {}
        self.min_rows = min_rows(format_entry(model.base_format))
        with torch.no_grad():
            for linear in fp8_linears(model):
                dense = _dense_base(linear)
                self.copies[linear] = quantize_weight(dense)
                del dense
        log(f"engine: FP8 copies of {len(self.copies)} linears ({self.nbytes / 2**30:.2f} GiB); projections of "
            f"{self.min_rows}+ rows run FP8 activations")

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.copies.values())

    def serves(self, linear: QuantLinear, rows: int) -> bool:
        return rows >= self.min_rows and linear in self.copies

    def forward(self, linear: QuantLinear, x: Tensor, q: Fp8Rows | None,
                lora: tuple[Tensor, Tensor] | None) -> Tensor:
        """x [M, K] @ W^T (+ bias) (+ u @ B^T, lora = (u, B)) through the FP8 copy, rounded once; `q`:
        x's E4M3 rows if a kernel upstream made them, else they are made here."""
        if q is None:
            q = gated_rows(x)[1] if x.is_cuda else quantize_rows(x)
        return fp8_linear(q, self.copies[linear], x.dtype, linear.bias, lora)
