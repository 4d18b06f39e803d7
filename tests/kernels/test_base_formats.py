"""The base-format registry (`kernels.base_formats`): every entry answers what the code asks of a
format, its bytes per weight are what its buffers really hold, an unknown name fails clearly at
the boundary, and no module outside the registry decides by comparing a format's name."""

from __future__ import annotations

import ast
import pickle
import typing
from pathlib import Path

import pytest
import torch

from qerl_pipe.model.random_init import init_random_model
from qerl_pipe.errors import QerlError
from qerl_pipe.kernels.base_formats import FORMATS, NAMES, NVFP4, UnknownBaseFormat, base_format
from qerl_pipe.model.linear import QuantLinear
from qerl_pipe.recipe import EngineSection
from tests.conftest import TINY_DIMS

PACKAGE = Path(__file__).parents[2] / "qerl_pipe"
REGISTRY = PACKAGE / "kernels" / "base_formats.py"
N, K = 128, 256


@pytest.mark.parametrize("name", NAMES)
def test_each_entry_answers_the_questions(name):
    fmt = base_format(name)
    assert fmt.name == name and str(fmt) == name and base_format(fmt) is fmt
    # The buffers a linear holds, on the meta device, in the container's field order.
    empty = fmt.empty_buffers(N, K, torch.bfloat16)
    assert tuple(empty) == fmt.buffers and all(t.device.type == "meta" for t in empty.values())
    # How it loads: the model's weight -> its checkpoint form -> the kernels' container.
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)) * 0.02
    container = fmt.to_container(fmt.quantize(w, "w", torch.float32))
    assert isinstance(container, fmt.container)
    tensors = fmt.tensors(container)
    assert tuple(tensors) == fmt.buffers
    assert all(tensors[key].shape == empty[key].shape and tensors[key].dtype == empty[key].dtype
               for key in fmt.buffers if key != "weight")  # a dense base keeps the dtype it is given
    assert isinstance(fmt.make_container(tensors, N, K), fmt.container)
    dense = fmt.dense_copy(container, torch.float32)
    assert dense.shape == (N, K) and float((dense - w).norm() / w.norm()) < (1e-6 if fmt.dense else 0.2)
    # Bytes per weight: what the buffers hold (per-linear extras apart), in a bf16 model.
    held = fmt.tensors(fmt.to_container(fmt.quantize(w, "w", torch.bfloat16)))
    stored = sum(t.numel() * t.element_size() for t in held.values())
    assert stored == N * K * fmt.weight_bytes(2) + fmt.bytes_per_linear
    # Which kernels serve it: none for a dense base (a plain matmul), else forward and dX.
    if fmt.dense:
        assert fmt.kernels is None and fmt.bytes_per_weight is None
    else:
        x = torch.randn(3, K, generator=torch.Generator().manual_seed(1))
        dy = torch.randn(3, N, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(fmt.kernels.forward(x, container), x @ dense.T)
        torch.testing.assert_close(fmt.kernels.dx(dy, container), dy @ dense)
    # A linear of this format holds it and runs it.
    linear = QuantLinear(K, [N], ["proj"], name, torch.float32, "cpu")
    linear.set_base(fmt.quantize(w, "w", torch.float32))
    assert linear.fmt is fmt and isinstance(linear.kernel_weight, fmt.container)
    torch.testing.assert_close(linear(torch.ones(2, K)), torch.ones(2, K) @ dense.T)


def test_the_entries_agree_with_each_other_and_with_the_recipe():
    assert NAMES == tuple(FORMATS) and len(set(NAMES)) == len(NAMES)
    recipe_choices = set(typing.get_args(EngineSection.model_fields["base_format"].annotation))
    assert recipe_choices == set(NAMES)  # a new entry is a new recipe value, and no value lacks one
    for fmt in FORMATS.values():
        # Built from the NVFP4 checkpoint means loaded from one; the dispatch's copies are NVFP4's.
        assert not fmt.from_quantize_artifact or fmt.loads_nvfp4_checkpoint
        assert not fmt.hopper_dispatch or fmt.container is NVFP4.container
        assert pickle.loads(pickle.dumps(fmt)) is fmt  # a pickled model refers to the registered entry
    assert sum(f.from_quantize_artifact for f in FORMATS.values()) == 1


def test_an_unknown_format_gets_a_clear_error():
    with pytest.raises(UnknownBaseFormat, match=r"unknown base format 'fp8'; choose one of bf16, nvfp4, nf4"):
        base_format("fp8")
    for bad in ("NVFP4", "", None):
        with pytest.raises(UnknownBaseFormat):
            base_format(bad)  # type: ignore[arg-type]
    assert issubclass(UnknownBaseFormat, QerlError) and issubclass(UnknownBaseFormat, ValueError)
    config = {"model_type": "llama", "vocab_size": 320, **TINY_DIMS}
    with pytest.raises(UnknownBaseFormat, match="'int4'"):
        init_random_model(config, "int4")
    with pytest.raises(UnknownBaseFormat):
        QuantLinear(64, [64], ["proj"], "int4", torch.float32, "cpu")


# ---------------------------------------------------------------------------- no name comparisons

# Comparisons of these strings that are not about a base format, each with why.
NOT_A_BASE_FORMAT = {
    ("qerl_pipe/kernels/dispatch_measure.py", "bf16"): "the label of the cuBLAS-over-bf16-weights column the "
                                                       "dispatch is measured against, not a model's base",
    ("qerl_pipe/formats/bnb_nf4.py", "nf4"): "bitsandbytes' own quant_type of a Params4bit (nf4 or fp4), not a "
                                             "model's base",
}


def _names_in(node: ast.AST) -> set[str]:
    """The base-format names a comparison operand spells: a string, or a tuple/list/set of them."""
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {e.value for e in elts if isinstance(e, ast.Constant) and e.value in NAMES}


def format_decisions(source: str) -> list[tuple[int, str]]:
    """(line, name) of each place `source` decides by a base-format name: a comparison (==, !=,
    in, ...) with one, a `case` on one, or a lookup table keyed by two or more of them."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found += [(node.lineno, name) for name in _names_in(operand)]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, name) for name in _names_in(node.value)]
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in NAMES}
            if len(keys) >= 2:
                found += [(node.lineno, name) for name in keys]
    return sorted(found)


def test_the_scanner_finds_what_it_looks_for():
    source = '''
if fmt == "nvfp4": pass
if "bf16" != model.base_format: pass
ok = fmt not in ("bf16", None)
table = {"nvfp4": 1, "nf4": 2}[fmt]
match fmt:
    case "nf4": pass
if dtype == "float32" or {"bf16": 1}: pass
'''
    assert format_decisions(source) == [(2, "nvfp4"), (3, "bf16"), (4, "bf16"), (5, "nf4"), (5, "nvfp4"), (7, "nf4")]


def test_no_module_outside_the_registry_compares_a_base_format_name():
    lab = PACKAGE.parent / "qerl_lab"
    modules = [p for p in [*PACKAGE.rglob("*.py"), *lab.glob("*.py")] if p != REGISTRY]
    assert len(modules) > 100 and lab / "train_step.py" in modules  # the whole package is read, and the lab's modules
    found = {}
    for path in modules:
        for line, name in format_decisions(path.read_text()):
            found.setdefault((str(path.relative_to(PACKAGE.parent)), name), []).append(line)
    allowed = {key: lines for key, lines in found.items() if key in NOT_A_BASE_FORMAT}
    assert set(allowed) == set(NOT_A_BASE_FORMAT)  # each exception still exists (the list cannot rot)
    assert {key: lines for key, lines in found.items() if key not in NOT_A_BASE_FORMAT} == {}, (
        "ask the format's entry (qerl_pipe/kernels/base_formats.py) instead of comparing its name")
