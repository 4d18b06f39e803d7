"""`bench quantize-methods`' side-by-side table of per-layer errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qerl_pipe.formats.quant_error import LayerError


def test_compare_methods_needs_the_baseline_and_handles_missing_output() -> None:
    from qerl_lab.layer_errors import compare_methods

    with pytest.raises(ValueError, match="rtn"):
        compare_methods({"mse": {"a": LayerError(0.1)}})
    table = compare_methods({"rtn": {"a": LayerError(0.2), "b": LayerError(0.1)},
                             "mse": {"a": LayerError(0.1), "b": LayerError(0.3)}}, worst=1)
    assert table["methods"]["mse"]["mean_output_error"] is None
    vs = table["methods"]["mse"]["vs_rtn"]
    assert vs["layers_weight_better"] == 1 and vs["layers_weight_worse"] == 1 and "layers_output_worse" not in vs
    assert list(table["worst_layers"]) == ["a", "b"]  # rtn's worst first, then mse's


def _artifact(root: Path, method: str, weight: dict[str, float], output: dict[str, float] | None) -> Path:
    (root / method).mkdir()
    quality = {"method": method, "relative_error": weight, "output_relative_error": output}
    (root / method / "quality.json").write_text(json.dumps(quality))
    return root / method


def test_the_table_of_quantize_artifacts_reads_each_quality_report(tmp_path) -> None:
    from qerl_lab.layer_errors import compare_methods, read_layer_errors

    rtn = _artifact(tmp_path, "rtn", {"a": 0.2, "b": 0.1}, {"a": 0.4, "b": 0.3})
    act = _artifact(tmp_path, "act-mse", {"a": 0.25, "b": 0.1}, {"a": 0.3, "b": 0.3})
    plain = _artifact(tmp_path, "plain", {"a": 0.2}, None)  # no calibration: no output errors
    assert read_layer_errors(plain) == {"a": LayerError(0.2, None)}
    table = compare_methods({"rtn": read_layer_errors(rtn), "act-mse": read_layer_errors(act)}, worst=1)
    vs = table["methods"]["act-mse"]["vs_rtn"]
    assert vs["layers_output_worse"] == 0 and vs["layers_weight_worse"] == 1
    assert vs["output_error_ratio_max"] == pytest.approx(1.0) and len(table["per_layer"]) == 2
    assert table["worst_layers"]["a"]["rtn"] == [0.2, 0.4]
