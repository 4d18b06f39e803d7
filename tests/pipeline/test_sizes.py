"""Line budgets per layer (docs/architecture.md, "Size budgets"): physical lines of `*.py`. Each
layer has a target (issue 51) and a ceiling, today's size: a change may not grow a layer past its
ceiling, and a change that shrinks one lowers its ceiling here, until the target is reached."""

from __future__ import annotations

from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "qerl_pipe"
FACE_AND_PIPELINE = ("cli", "launch", "__main__", "dag", "recipe", "runner", "pipeline", "orchestration", "sources",
                     "lineage", "eval_inputs", "quality", "recipe_keys")
LAYERS = {
    "product": ["**/*.py"],
    "kernels": ["kernels/**/*.py"],
    "engine runtime": ["engine/**/*.py"],
    "pipeline + face": [f"{name}.py" for name in FACE_AND_PIPELINE],
}
# layer: (target, ceiling). Lower a ceiling when a change shrinks its layer; never raise one. A layer
# within its target has the target as its ceiling.
BUDGETS = {
    "product": (15_800, 15_800),
    "kernels": (3_000, 3_000),
    "engine runtime": (1_300, 1_300),
    "pipeline + face": (2_300, 2_300),
}


def lines(layer: str) -> int:
    files = {path for pattern in LAYERS[layer] for path in PACKAGE.glob(pattern)}
    return sum(len(path.read_text().splitlines()) for path in files)


@pytest.mark.parametrize("layer", sorted(BUDGETS))
def test_no_layer_grows_past_its_ceiling(layer):
    target, ceiling = BUDGETS[layer]
    assert target <= ceiling
    size = lines(layer)
    assert size <= ceiling, (f"{layer}: {size} lines, over its ceiling of {ceiling} (target {target}); "
                             "make room in the same layer, or say in docs/architecture.md why the budget moves")


def test_the_layers_are_counted_from_files_that_exist():
    assert all(any(PACKAGE.glob(p)) for ps in LAYERS.values() for p in ps)
    assert all((PACKAGE / f"{name}.py").is_file() for name in FACE_AND_PIPELINE)
    assert lines("kernels") + lines("engine runtime") + lines("pipeline + face") < lines("product")
