"""The Triton kernels under TRITON_INTERPRET=1 on CPU tensors, against the torch reference.

Triton decides at import time whether `@triton.jit` functions (its own `tl.cdiv`, `tl.sum` too)
run in the interpreter, and a test session may have imported Triton already. So one subprocess
with the variable set runs every case (this file run as a script) and prints each case's relative
error as JSON; the tests below check them. Shapes are tiny: the interpreter executes every program
of the grid in Python. Outputs start as NaN, so an element the kernel never writes fails the test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qerl_pipe.formats.nf4 import NF4Weight, dequantize_nf4, quantize_nf4
from qerl_pipe.formats.nvfp4 import NVFP4Weight, dequantize_nvfp4, quantize_nvfp4
from qerl_pipe.kernels.configs import KernelConfig
from qerl_pipe.kernels.packing import prepare_nf4, prepare_nvfp4

SK = "skinny"
TI = "tiled"
DQ = "dequant"
CASES = [
    # (op, fmt, M, N, K, config): M off the tile, M = 1, the smallest K, odd N, split-K.
    ("fwd", "nvfp4", 1, 33, 16, KernelConfig(SK, 1, 16, 64)),
    ("fwd", "nvfp4", 3, 33, 96, KernelConfig(SK, 2, 8, 32, split_k=2)),
    ("fwd", "nvfp4", 1, 40, 256, KernelConfig(SK, 1, 16, 64, split_k=4)),
    ("fwd", "nvfp4", 1, 33, 272, KernelConfig("gemv", 1, 16, 128)),
    ("fwd", "nvfp4", 3, 17, 256, KernelConfig("gemv", 2, 8, 64, split_k=2)),
    ("fwd", "nf4", 1, 33, 192, KernelConfig("gemv", 1, 8, 128)),
    ("fwd", "nvfp4", 17, 33, 48, KernelConfig(TI, 16, 16, 32, num_stages=1)),
    ("fwd", "nvfp4", 5, 24, 128, KernelConfig(TI, 16, 16, 32, split_k=2, num_stages=1)),
    ("fwd", "nvfp4", 1, 16, 16, KernelConfig(TI, 16, 16, 16, num_stages=1)),
    ("fwd", "nf4", 1, 33, 64, KernelConfig(SK, 1, 16, 64)),
    ("fwd", "nf4", 3, 17, 192, KernelConfig(SK, 2, 8, 64, split_k=2)),
    ("fwd", "nf4", 19, 33, 128, KernelConfig(TI, 16, 16, 64, num_stages=1)),
    ("fwd", "nf4", 2, 16, 64, KernelConfig(TI, 16, 16, 64, split_k=2, num_stages=1)),
    ("dx", "nvfp4", 1, 33, 16, KernelConfig(TI, 16, 16, 16, num_stages=1)),
    ("dx", "nvfp4", 19, 33, 96, KernelConfig(TI, 16, 16, 32, num_stages=1)),
    ("dx", "nf4", 17, 40, 128, KernelConfig(TI, 16, 16, 64, num_stages=1)),
    ("dx", "nf4", 1, 17, 64, KernelConfig(TI, 16, 32, 64, num_stages=1)),
    # Decode into the scratch buffer, then torch.matmul: edges in N and K, K below one tile.
    ("fwd", "nvfp4", 5, 33, 96, KernelConfig(DQ, 1, 16, 64)),
    ("fwd", "nvfp4", 2, 17, 16, KernelConfig(DQ, 1, 16, 64)),
    ("fwd", "nf4", 3, 17, 192, KernelConfig(DQ, 1, 8, 128)),
    ("dx", "nvfp4", 4, 33, 48, KernelConfig(DQ, 1, 16, 64)),
    ("dx", "nf4", 2, 40, 128, KernelConfig(DQ, 1, 16, 64)),
]


def _case_id(case: tuple) -> str:
    op, fmt, m, n, k, cfg = case
    return f"{op}-{fmt}-m{m}-n{n}-k{k}-{cfg.kernel}{cfg.block_m}x{cfg.block_n}x{cfg.block_k}s{cfg.split_k}"


def _weight(fmt: str, n: int, k: int, gen: torch.Generator) -> NVFP4Weight | NF4Weight:
    # Rows of very different magnitude, so block scales spread widely (some hit E4M3 subnormals).
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).pow(4) * 3
    return quantize_nvfp4(w) if fmt == "nvfp4" else quantize_nf4(w)


def _run_case(case: tuple, seed: int) -> float:
    """Relative error of one kernel launch vs x @ dequantized W in fp32 (runs in the worker)."""
    from qerl_pipe.kernels import triton_matmul as tm

    op, fmt, m, n, k, cfg = case
    gen = torch.Generator().manual_seed(seed)
    w = _weight(fmt, n, k, gen)
    packed = prepare_nvfp4(w) if fmt == "nvfp4" else prepare_nf4(w)  # type: ignore[arg-type]
    dense = (dequantize_nvfp4 if fmt == "nvfp4" else dequantize_nf4)(w, torch.float32)  # type: ignore[operator]
    if op == "fwd":
        a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        out = tm.launch_forward(a, fmt, packed, cfg, out=torch.full((m, n), float("nan"),
                                                                     dtype=torch.bfloat16))
        ref = a.float() @ dense.T
    else:
        a = torch.randn(m, n, generator=gen).to(torch.bfloat16)
        out = tm.launch_dx(a, fmt, packed, cfg, out=torch.full((m, k), float("nan"),
                                                                dtype=torch.bfloat16))
        ref = a.float() @ dense
    if out.shape != ref.shape or out.dtype != torch.bfloat16:
        raise AssertionError(f"output {tuple(out.shape)} {out.dtype}, expected {tuple(ref.shape)}")
    if not bool(torch.isfinite(out).all()):
        raise AssertionError("non-finite output: an element was not written")
    return float((out.float() - ref).norm() / ref.norm())


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        raise AssertionError(f"interpreter worker failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_reference(results: dict[str, dict], case: tuple) -> None:
    r = results[_case_id(case)]
    assert "error" not in r, f"seed {r['seed']}: {r.get('error')}"
    assert r["rel_err"] < 1e-2, f"seed {r['seed']}: relative error {r['rel_err']:.3g}"


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run through the tests (sets TRITON_INTERPRET)"
    out: dict[str, dict] = {}
    for case in CASES:
        seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh data every run; printed on failure
        try:
            out[_case_id(case)] = {"seed": seed, "rel_err": _run_case(case, seed)}
        except Exception as e:  # noqa: BLE001 - reported per case by the test
            out[_case_id(case)] = {"seed": seed, "error": repr(e)}
    print(json.dumps(out))
