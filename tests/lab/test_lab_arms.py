"""The arms summary read from run directories and from run logs (where only a log came back)."""

from __future__ import annotations

import json

import pytest

from qerl_lab import arms
from qerl_pipe import compare
from qerl_pipe.compare import Arm
from qerl_lab.arms import parse_greedy_line, parse_step_line
from qerl_pipe.errors import QerlError
from qerl_pipe.rl.loop.metrics import greedy_line, step_line


def _record(step: int, reward: float, **extra) -> dict:
    return {"step": step, "reward_mean": reward, "accuracy": reward, "response_length_mean": 12.34,
            "sigma": 0.00073, "lr": 3.1e-6, "step_seconds": 2.94, **extra}


def test_step_line_parses_back_as_printed():
    line = step_line(_record(7, 0.12345), total=120)
    assert parse_step_line(f"[12:00:00] {line}") == {
        "step": 7, "reward_mean": 0.123, "accuracy": 0.123, "response_length_mean": 12.3, "sigma": 0.00073,
        "lr": 3.1e-6, "step_seconds": 2.9}
    assert parse_step_line("train: greedy accuracy before training 0.051 (13/256 of arithmetic)") is None


def test_greedy_line_parses_back_as_printed():
    line = greedy_line("after", {"accuracy": 0.8359375, "correct": 214, "total": 256}, "arithmetic")
    assert parse_greedy_line(f"{line}; before 0.051") == ("after", {"accuracy": 214 / 256, "correct": 214, "total": 256})
    # the form printed before the line had its data name after training
    assert parse_greedy_line("train: greedy accuracy after training 0.844 (216/256); before 0.168")[0] == "after"
    assert parse_greedy_line(line.replace("greedy", "sampled")) is None


def _log(tmp_path, rewards_first: list[float], resumed_from: int, rewards_resumed: list[float], after: bool):
    lines = ["import: reusing artifacts/import-1 (bf16 copy of smol.gguf)",
             "train: greedy accuracy before training 0.031 (8/256 of arithmetic)"]
    lines += [step_line(_record(i + 1, r), 120) for i, r in enumerate(rewards_first)]
    lines += [step_line(_record(resumed_from + i, r), 120) for i, r in enumerate(rewards_resumed)]
    if after:
        lines.append("train: greedy accuracy after training 0.844 (216/256); before 0.031")
    path = tmp_path / "arm.log"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_log_read_arm_keeps_each_steps_last_printing_and_its_greedy_accuracies(tmp_path):
    # killed after step 6, resumed from the step-4 checkpoint: steps 5 and 6 printed twice
    log = _log(tmp_path, [0.1, 0.2, 0.3, 0.4, 0.9, 0.9], 5, [0.5, 0.6, 0.9], after=True)
    arm = arms.read_arm(log)
    assert [r["step"] for r in arm.records] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["reward_mean"] for r in arm.records] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.9]
    assert arm.greedy == {"before": {"accuracy": 8 / 256, "correct": 8, "total": 256},
                           "after": {"accuracy": 216 / 256, "correct": 216, "total": 256}}
    row = arms.summarize("nvfp4", arm)
    assert row["finished"] and row["greedy_accuracy_after"] == 216 / 256 and row["eval_problems"] == 256
    assert row["entropy_first_tenth"] is None and row["peak_gpu_memory_gib"] is None
    assert row["step_reward_0.5"] == 7  # trailing 5-step means: 0.4 at step 6, 0.54 at step 7


def test_claims_skip_what_a_log_cannot_tell(tmp_path):
    full = arms.summarize("bf16", Arm("bf16", [_record(1, 0.6, entropy=0.7)]))
    from_log = arms.summarize("nvfp4", arms.read_arm(_log(tmp_path, [0.2, 0.8, 0.8], 4, [], after=False)))
    assert not from_log["finished"]
    claims = arms.paper_claims({"bf16": full, "nvfp4": from_log}, ["nvfp4"], "bf16", [("qerl", "nvfp4")])
    assert [c["name"] for c in claims] == ["reward 0.5 sooner: nvfp4 vs bf16"]  # no entropy claim
    assert claims[0]["measured"] == 1 and claims[0]["met"] is False


def test_a_log_read_arm_plots_without_the_metrics_a_log_lacks(tmp_path):
    pytest.importorskip("matplotlib")
    arm = arms.read_arm(_log(tmp_path, [0.1, 0.5], 3, [], after=False))
    assert compare.plot([arm], tmp_path / "arms.png", "t") and (tmp_path / "arms.png").stat().st_size > 0


def test_a_log_without_step_lines_is_refused_with_what_to_pass(tmp_path):
    log = tmp_path / "empty.log"
    log.write_text("calibrate: up to date\n")
    with pytest.raises(SystemExit, match="no 'train: step' lines"):
        arms.read_arm(log)


def test_run_directory_arms_read_as_before(tmp_path):
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(_record(i, 0.1 * i, entropy=0.5, peak_gpu_memory_gib=2.0))
                                                 for i in range(1, 11)) + "\n")
    (run / "run.json").write_text(json.dumps({"train": {"lr": 1e-4, "aqn": {"schedule": "exponential"}}}))
    (run / "eval" / "after.json").write_text(json.dumps({"accuracy": 0.5, "total": 8}))
    row = arms.summarize("qerl", arms.read_arm(run))
    assert (row["lr"], row["aqn"], row["finished"], row["entropy_first_tenth"], row["peak_gpu_memory_gib"]) == (
        1e-4, "exponential", True, 0.5, 2.0)
    assert (row["greedy_accuracy_after"], row["greedy_accuracy_after_graded_in_run"]) == (0.5, None)


def test_kept_greedy_answers_are_graded_again_by_todays_grader(tmp_path):
    # A run graded under the grader that evaluated expressions: it reported 3/3, today's grader says 1/3.
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps(_record(1, 0.9)) + "\n")
    (run / "eval" / "after.json").write_text(json.dumps({"accuracy": 1.0, "correct": 3, "total": 3}))
    # Extraction is redone too: math has no last-number fallback ("So 5." has no answer there).
    answers = [("arithmetic:1:0", "\\boxed{(27 + 82)} 27 + 82", "109"), ("arithmetic:1:1", "It is 60.", "60"),
               ("math500:test:4", "So 5.", "5")]
    (run / "eval" / "after.jsonl").write_text("".join(
        json.dumps({"id": i, "question": "?", "completion": c, "extracted": "stale", "answer": a, "correct": True})
        + "\n"
        for i, c, a in answers))
    row = arms.summarize("nf4", arms.read_arm(run))
    assert row["greedy_accuracy_after"] == pytest.approx(1 / 3)
    assert row["greedy_accuracy_after_graded_in_run"] == 1.0
    (run / "eval" / "after.jsonl").write_text("")  # no answers kept: the run's own figure stands
    assert arms.summarize("nf4", arms.read_arm(run))["greedy_accuracy_after"] == 1.0


@pytest.mark.parametrize("problem_id, kind", [
    ("arithmetic:3:17", "arithmetic"), ("addition:test:0", "arithmetic"), ("gsm8k:test:4", "gsm8k"),
    ("math500:test:0", "math"), ("mine.jsonl:2", "jsonl")])
def test_a_problem_id_names_its_kind(problem_id, kind):
    from qerl_lab.arms import kind_of
    assert kind_of(problem_id) == kind


def test_seeds_give_each_figures_spread_and_how_often_a_claim_held(tmp_path):
    from qerl_lab import seeds

    def arms_file(after: dict, met: bool) -> dict:
        return {"results": [{"arm": a, "greedy_accuracy_after": v} for a, v in after.items()],
                "targets": [{"name": "AQN helps", "target": "higher with AQN", "measured": 0.0, "unit": "",
                             "met": met}]}

    files = [arms_file({"bf16": 0.8, "qerl": 0.7}, True), arms_file({"bf16": 0.9}, False),
             arms_file({"bf16": 1.0, "qerl": 0.5}, True)]
    results, targets = seeds.across_seeds(files)
    bf16, qerl = results
    assert (bf16["arm"], bf16["seeds"], qerl["seeds"]) == ("bf16", 3, 2)
    after = bf16["greedy_accuracy_after"]
    assert after["values"] == [0.8, 0.9, 1.0] and after["mean"] == pytest.approx(0.9)
    assert after["std"] == pytest.approx(0.1) and (after["min"], after["max"]) == (0.8, 1.0)
    assert qerl["greedy_accuracy_after"]["values"] == [0.7, None, 0.5]
    assert bf16["step_reward_0.5"] == {"values": [None, None, None], "n": 0}
    assert [(t["measured"], t["unit"], t["met"]) for t in targets] == [(2, "of 3 seeds held", False)]


def test_seeds_refuses_a_missing_arms_file(tmp_path):
    from qerl_lab import seeds

    with pytest.raises(QerlError, match="no such arms file"):
        seeds.summarize_seeds([tmp_path / "nope.json"], tmp_path / "s.json")
    assert not (tmp_path / "s.json").exists()


def test_aqn_is_checked_for_every_pair_given():
    def row(name: str, step: int, after: float) -> dict:
        return {"arm": name, "entropy_first_tenth": None, "step_reward_0.5": step, "greedy_accuracy_after": after}

    rows = {r["arm"]: r for r in (row("qerl", 30, 0.84), row("nvfp4", 29, 0.85), row("bf16-aqn", 19, 0.90),
                                  row("bf16", 16, 0.88))}
    claims = arms.paper_claims(rows, [], "bf16", [("qerl", "nvfp4"), ("bf16-aqn", "bf16"), ("x", "bf16")])
    assert [(c["name"].split(": ", 1)[1], c["measured"], c["met"]) for c in claims] == [
        ("qerl vs nvfp4 (reward 0.5)", 1, False), ("qerl vs nvfp4 (greedy accuracy after)", pytest.approx(-0.01), False),
        ("bf16-aqn vs bf16 (reward 0.5)", 3, False), ("bf16-aqn vs bf16 (greedy accuracy after)", pytest.approx(0.02), True)]


def test_each_arm_is_checked_against_qlora():
    def row(name: str, step: int | None, after: float | None) -> dict:
        return {"arm": name, "entropy_first_tenth": None, "step_reward_0.5": step, "greedy_accuracy_after": after}

    rows = {r["arm"]: r for r in (row("qerl", 30, 0.84), row("nvfp4", 20, None), row("nf4", 22, 0.87))}
    claims = arms.paper_claims(rows, [], "bf16", [], [("qerl", "nf4"), ("nvfp4", "nf4"), ("mxfp4", "nf4")])
    assert [(c["name"], c["target"], c["measured"], c["met"]) for c in claims] == [
        ("beats QLoRA: qerl vs nf4 (reward 0.5)", "fewer steps than QLoRA", 8, False),
        ("beats QLoRA: qerl vs nf4 (greedy accuracy after)", "higher than QLoRA", pytest.approx(-0.03), False),
        ("beats QLoRA: nvfp4 vs nf4 (reward 0.5)", "fewer steps than QLoRA", -2, True)]


def test_full_fine_tuning_parity_and_calibration_are_checked_per_pair():
    def row(name: str, step: int | None, after: float | None) -> dict:
        return {"arm": name, "entropy_first_tenth": None, "step_reward_0.5": step, "greedy_accuracy_after": after}

    rows = {r["arm"]: r for r in (row("qerl", 30, 0.836), row("full", 20, 0.883), row("qerl-act-mse", 22, 0.879),
                                  row("late", 40, None))}
    claims = arms.paper_claims(rows, [], "bf16", [], [], [("qerl", "full"), ("qerl-act-mse", "full"), ("late", "full")],
                               [("qerl-act-mse", "qerl"), ("late", "qerl")])
    assert [(c["name"], c["target"], c["measured"], c["met"]) for c in claims] == [
        ("on par with full fine-tuning: qerl vs full (greedy accuracy after)", ">= -0.01", pytest.approx(-0.047), False),
        ("on par with full fine-tuning: qerl-act-mse vs full (greedy accuracy after)", ">= -0.01",
         pytest.approx(-0.004), True),
        ("calibration helps: qerl-act-mse vs qerl (reward 0.5)", "fewer steps with calibrated scales", -8, True),
        ("calibration helps: qerl-act-mse vs qerl (greedy accuracy after)", "higher with calibrated scales",
         pytest.approx(0.043), True),
        ("calibration helps: late vs qerl (reward 0.5)", "fewer steps with calibrated scales", 10, False)]


def test_new_arm_names_go_through_arms_and_seeds(tmp_path):
    """Arms are named freely: a full fine-tuning arm and a calibrated one next to qerl, in the
    results (with the adapter each trained), the default claims and the seeds summary."""
    pytest.importorskip("matplotlib")
    from qerl_lab import seeds

    files = []
    for seed, (full_after, calibrated_step) in enumerate([(0.845, 20), (0.90, 40)]):
        specs = []
        for name, adapter, step, after in (("qerl", None, 30, 0.84), ("full", "full", 14, full_after),
                                           ("qerl-act-mse", None, calibrated_step, 0.86)):
            run = tmp_path / f"seed{seed}" / name
            (run / "eval").mkdir(parents=True)
            rewards = [0.0] * (step - 1) + [1.0] * 5  # the 5-step mean reaches 0.5 at step + 2
            # a CPU run's metrics have no GPU memory (null)
            gpu = {"peak_gpu_memory_gib": None if name == "full" else 3.0}
            (run / "metrics.jsonl").write_text("".join(json.dumps(_record(i + 1, r, entropy=0.5, **gpu)) + "\n"
                                                       for i, r in enumerate(rewards)))
            (run / "run.json").write_text(json.dumps({"train": {"lr": 1e-5, **({"adapter": adapter} if adapter else {})}}))
            (run / "eval" / "after.json").write_text(json.dumps({"accuracy": after, "correct": 1, "total": 4}))
            specs.append(f"{name}={run}")
        out = arms.summarize_arms(specs, tmp_path / f"out{seed}")
        assert [(r["arm"], r["adapter"], r["step_reward_0.5"], r["peak_gpu_memory_gib"]) for r in out["results"]] == [
            ("qerl", "lora", 32, 3.0), ("full", "full", 16, None), ("qerl-act-mse", "lora", calibrated_step + 2, 3.0)]
        files.append(tmp_path / f"out{seed}" / "arms.json")
    result = seeds.summarize_seeds(files, tmp_path / "seeds.json")
    assert [r["arm"] for r in result["results"]] == ["qerl", "full", "qerl-act-mse"]
    held = {t["name"]: (t["measured"], t["met"]) for t in result["targets"]}
    assert held["on par with full fine-tuning: qerl vs full (greedy accuracy after) (in every seed checked)"] == (1, False)
    assert held["calibration helps: qerl-act-mse vs qerl (reward 0.5) (in every seed checked)"] == (1, False)
    assert held["calibration helps: qerl-act-mse vs qerl (greedy accuracy after) (in every seed checked)"] == (2, True)


@pytest.mark.parametrize(("option", "form"), [("--aqn-pairs", "WITH:WITHOUT"), ("--qlora-pairs", "ARM:QLORA"),
                                              ("--full-ft-pairs", "ARM:FULL"), ("--calibrated-pairs", "CALIBRATED:RTN")])
@pytest.mark.parametrize("pairs", ["qerl:", "qerl", ":nvfp4", "qerl:nvfp4,nf4"])
def test_a_malformed_pair_is_refused(tmp_path, option, form, pairs):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps(_record(1, 0.5)) + "\n")
    keyword = option.removeprefix("--").replace("-", "_")
    with pytest.raises(QerlError, match=f"{option} .*expected {form} pairs"):
        arms.summarize_arms([f"qerl={run}"], tmp_path / "out", **{keyword: pairs})
    assert not (tmp_path / "out" / "arms.json").exists()
