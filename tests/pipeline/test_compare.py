"""`qerl-pipe compare`: two arms (a train run and an eval artifact of another run's adapter) as one
table and one figure; bad arms refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.stage_cli import cli


def _run(store: Path, run_id: str, rewards: list[float], lr: float, peak: float | None) -> Path:
    run = store / f"train-{run_id}"
    (run / "eval").mkdir(parents=True)
    records = [{"step": i + 1, "reward_mean": r, "accuracy": r, "entropy": 1.0 - r / 2, "response_length_mean": 10 + i,
                "step_seconds": 36.0, "peak_gpu_memory_gib": peak} for i, r in enumerate(rewards)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "run.json").write_text(json.dumps({"train": {"lr": lr, "adapter": "lora", "aqn": {"schedule": "none"}}}))
    for when, acc in (("before", 0.1), ("after", rewards[-1])):
        (run / "eval" / f"{when}.json").write_text(json.dumps({"accuracy": acc, "correct": 1, "total": 10}))
    return run


def test_two_arms_side_by_side(tmp_path):
    store = tmp_path / "store"
    first = _run(store, "aaaa", [0.1] * 10 + [0.5] * 10, 1e-5, 7.5)
    second = _run(store, "bbbb", [0.2] * 20, 5e-6, None)
    evaluated = store / "eval-cccc"
    evaluated.mkdir()
    (evaluated / "report.json").write_text(json.dumps({"pass@1": 0.42, "data": "gsm8k:test",
                                                      "adapter": {"artifact": "bbbb"}}))
    out = tmp_path / "out"
    result = cli("compare", f"qerl={first}", f"bf16={evaluated}", "--reference", "qerl=GSM8K 90.8", "--out-dir", out)
    table = result.stdout.strip().splitlines()
    assert table[0].startswith("| arm | steps | reward, first tenth | reward, last tenth | greedy before | greedy after "
                               "| pass@1 |")
    assert table[2].startswith("| qerl | 20 | 0.100 | 0.500 | 0.100 | 0.500 | - |") and "GSM8K 90.8" in table[2]
    assert table[3].startswith("| bf16 | 20 | 0.200 | 0.200 | 0.100 | 0.200 | 0.420 |")
    rows = {r["arm"]: r for r in json.loads((out / "compare.json").read_text())["arms"]}
    assert rows["qerl"]["gpu_hours"] == pytest.approx(20 * 36 / 3600) and rows["qerl"]["peak_gpu_memory_gib"] == 7.5
    assert rows["bf16"]["gpu_hours"] is None  # no GPU figure in its records: not a GPU run
    pytest.importorskip("matplotlib")
    assert (out / "compare.png").stat().st_size > 10_000


@pytest.mark.parametrize(("args", "needle"), [
    (["nowhere"], "is not a directory"),
    (["--reference", "x", "."], "write ARM=FIGURE"),
])
def test_bad_arms_are_refused_in_one_line(tmp_path, args, needle):
    result = cli("compare", *[str(tmp_path / a) if a == "nowhere" else a for a in args], ok=False)
    assert result.exit_code == 1 and needle in result.stderr


def test_an_eval_of_a_run_elsewhere_and_repeated_names_are_refused(tmp_path):
    store = tmp_path / "store"
    run = _run(store, "aaaa", [0.1, 0.2], 1e-5, None)
    lone = tmp_path / "eval-x"
    lone.mkdir()
    (lone / "report.json").write_text(json.dumps({"pass@1": 0.1, "adapter": {"artifact": "zzzz"}}))
    assert "train-zzzz, which is not beside it" in cli("compare", lone, ok=False).stderr
    assert "two arms share a name" in cli("compare", f"a={run}", f"a={run}", ok=False).stderr
