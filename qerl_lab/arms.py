"""The QeRL paper's claims checked on training arms (bf16 LoRA, QLoRA, NVFP4, NVFP4 + AQN, full
fine-tuning, calibrated NVFP4, ...): the lab's layer over the product's `qerl-pipe compare`
(`qerl_pipe.compare`: the one reader, summary and figure of arms).

What the lab adds: arms read from a run's log where only the log came back (its per-step lines
and greedy accuracies; no entropy, settings or memory there), greedy answers a run kept graded
again with today's grader (`regraded`), the steps to a reward level, and a results JSON
(command, commit, gpu, per-arm summaries, a `targets` block holding the paper's claims).

    qerl-pipe bench arms --arm qerl=RUN_DIR --arm bf16=RUN.log ... --out-dir DIR
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qerl_lab.results import nulls_for_non_finite, results_file, target
from qerl_pipe import compare
from qerl_pipe.compare import SMOOTH, Arm
from qerl_pipe.errors import QerlError
from qerl_pipe.rl.task.rewards import RewardSpec, score
from qerl_pipe.rl.task.tasks import PACKAGED, Problem
from qerl_pipe.strict_json import write_json


# Reading a run back from its log (where its run directory was lost: the earlier bf16 arms in
# bench/results/train-smollm2-h200/seed1/logs). Lab support, so it lives here, not in rl/metrics.
_STEP_LINE = re.compile(r"train: step (\d+)/\d+ reward (\S+) accuracy (\S+) length (\S+) sigma (\S+) "
                        r"lr (\S+) (\S+) s")


def kind_of(problem_id: str) -> str:
    """The kind of the problem with this id, from the id scheme of `load_problems` ('<spec>:<row>',
    'arithmetic:<seed>:<i>', '<file name>:<row>'): what regrading a kept answer needs."""
    if problem_id.startswith(("arithmetic:", "addition:")):
        return "arithmetic"
    spec = problem_id.rsplit(":", 1)[0]
    return PACKAGED[spec][3] if spec in PACKAGED else "jsonl"


def parse_step_line(line: str) -> dict[str, Any] | None:
    """`step_line`'s fields back (rounded as printed), or None for any other line: a run's log is
    its record where its metrics.jsonl was lost."""
    m = _STEP_LINE.search(line)
    if m is None:
        return None
    keys = ("reward_mean", "accuracy", "response_length_mean", "sigma", "lr", "step_seconds")
    return {"step": int(m.group(1)), **{k: float(v) for k, v in zip(keys, m.groups()[1:])}}


_GREEDY_LINE = re.compile(r"train: greedy accuracy (before|after) training (\S+) \((\d+)/(\d+)")


def parse_greedy_line(line: str) -> tuple[str, dict[str, Any]] | None:
    """`greedy_line`'s when and result back (the accuracy from the counts, not as rounded in print),
    or None for any other line."""
    m = _GREEDY_LINE.search(line)
    if m is None:
        return None
    correct, total = int(m.group(3)), int(m.group(4))
    return m.group(1), {"accuracy": correct / total, "correct": correct, "total": total}


def read_log(log: Path, name: str = "") -> Arm:
    """An arm from its run's log: the per-step lines (a resumed run's repeated steps: the last
    printing wins, as in metrics.jsonl) and the greedy accuracies before and after."""
    steps: dict[int, dict[str, Any]] = {}
    evals: dict[str, dict[str, Any]] = {}
    for line in log.read_text(errors="replace").splitlines():
        record = parse_step_line(line)
        if record is not None:
            steps[record["step"]] = record
        elif (greedy := parse_greedy_line(line)) is not None:
            evals[greedy[0]] = greedy[1]
    if not steps:
        raise SystemExit(f"{log} has no 'train: step' lines; pass the log of a train or run command")
    return Arm(name or log.stem, [steps[k] for k in sorted(steps)], {}, evals)


def read_arm(run_dir: Path, name: str = "") -> Arm:
    """One arm as `compare.read_run` reads it, its kept greedy answers graded again; a log file
    instead of a run directory reads `read_log`."""
    if run_dir.is_file():
        return read_log(run_dir, name)
    if not (run_dir / "metrics.jsonl").is_file():
        raise SystemExit(f"{run_dir} has no metrics.jsonl; pass a train run artifact, its .runs work directory "
                         "or its log")
    arm = compare.read_run(run_dir, name or run_dir.name)
    arm.greedy = {when: regraded(run_dir, when, result) for when, result in arm.greedy.items()}
    return arm


def regraded(run_dir: Path, name: str, result: dict[str, Any]) -> dict[str, Any]:
    """A run's greedy evaluation `name` ('before' / 'after'; `result`, its summary as the run wrote
    it). Where the run kept its answers (`eval/<name>.jsonl`), they are extracted and graded again by
    today's grader, so runs made under an older one compare fairly; `graded_in_run` keeps the
    accuracy the run itself reported."""
    answers = run_dir / "eval" / f"{name}.jsonl"
    rows = [json.loads(line) for line in answers.read_text().splitlines() if line.strip()] if answers.is_file() else []
    if rows:  # graded as the eval stage grades: rewards.score, accuracy only
        problems = [Problem(r["id"], r["question"], r["answer"], kind_of(r["id"])) for r in rows]
        correct = sum(score([r["completion"] for r in rows], problems, RewardSpec()).correct)
        result = {**result, "graded_in_run": result["accuracy"], "accuracy": correct / len(rows),
                  "correct": correct, "total": len(rows)}
    return result


def first_step_reaching(records: list[dict[str, Any]], key: str, level: float) -> int | None:
    """The first step whose `SMOOTH`-step trailing mean of `key` reaches `level`."""
    for i in range(len(records)):
        if (compare.mean_of(records[max(0, i - SMOOTH + 1):i + 1], key) or 0.0) >= level:
            return records[i]["step"]
    return None


def summarize(name: str, arm: Arm) -> dict[str, Any]:
    """`compare.summarize`'s row under the lab's names, with what the claims need besides."""
    records, row = arm.records, compare.summarize(arm)
    return {
        "arm": name, "steps": row["steps"], "finished": "after" in arm.greedy, "lr": row["lr"], "aqn": row["aqn"],
        "adapter": row["adapter"],
        "greedy_accuracy_before": row["greedy_before"],
        "greedy_accuracy_after": row["greedy_after"],
        "greedy_accuracy_after_graded_in_run": arm.greedy.get("after", {}).get("graded_in_run"),
        "eval_problems": arm.greedy.get("after", arm.greedy.get("before", {})).get("total"),
        **{key: row[key] for key in ("reward_first_tenth", "reward_last_tenth", "entropy_first_tenth",
                                     "entropy_last_tenth")},
        "step_reward_0.5": first_step_reaching(records, "reward_mean", 0.5),
        "step_reward_0.8": first_step_reaching(records, "reward_mean", 0.8),
        "step_seconds_median": sorted(r["step_seconds"] for r in records)[len(records) // 2],
        "peak_gpu_memory_gib": row["peak_gpu_memory_gib"],
    }


def _pair_claims(rows: dict[str, dict[str, Any]], pairs: Sequence[tuple[str, str]], claim: str,
                 edge: str) -> list[dict[str, Any]]:
    """For each (arm, other) pair present: does `arm` reach reward 0.5 in fewer steps, and end
    with a higher greedy accuracy? `claim` names the finding, `edge` what `arm` has over `other`."""
    claims = []
    for arm, other in pairs:
        if arm not in rows or other not in rows:
            continue
        a, b = rows[arm]["step_reward_0.5"], rows[other]["step_reward_0.5"]
        if a is not None and b is not None:
            claims.append(target(f"{claim}: {arm} vs {other} (reward 0.5)", f"fewer steps {edge}", a - b,
                                 "steps difference", a < b))
        after_a, after_b = rows[arm]["greedy_accuracy_after"], rows[other]["greedy_accuracy_after"]
        if after_a is not None and after_b is not None:
            claims.append(target(f"{claim}: {arm} vs {other} (greedy accuracy after)", f"higher {edge}",
                                 after_a - after_b, "accuracy difference", after_a > after_b))
    return claims


# "On par with full-parameter fine-tuning" (QeRL: 90.8 against 91.2 on 7B GSM8K), checked as
# greedy accuracy after training at most this far below the full fine-tuning arm's.
PAR_WITH_FULL_FT = 0.01


def _par_claims(rows: dict[str, dict[str, Any]], pairs: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """For each (arm, full fine-tuning arm) pair present: is `arm`'s greedy accuracy after
    training within PAR_WITH_FULL_FT of the full fine-tuning arm's?"""
    claims = []
    for arm, other in pairs:
        after_a = rows.get(arm, {}).get("greedy_accuracy_after")
        after_b = rows.get(other, {}).get("greedy_accuracy_after")
        if after_a is not None and after_b is not None:
            claims.append(target(f"on par with full fine-tuning: {arm} vs {other} (greedy accuracy after)",
                                 f">= -{PAR_WITH_FULL_FT}", after_a - after_b, "accuracy difference",
                                 after_a - after_b >= -PAR_WITH_FULL_FT))
    return claims


def paper_claims(rows: dict[str, dict[str, Any]], quantized: list[str], full: str,
                 aqn_pairs: Sequence[tuple[str, str]],
                 qlora_pairs: Sequence[tuple[str, str]] = (), full_ft_pairs: Sequence[tuple[str, str]] = (),
                 calibrated_pairs: Sequence[tuple[str, str]] = ()) -> list[dict[str, Any]]:
    """QeRL's findings as checkable statements on these runs: early entropy and reward growth of
    each quantized arm against the full-precision one, AQN for each (with, without) pair, QeRL's
    edge over QLoRA for each (arm, QLoRA arm) pair, parity with full fine-tuning for each (arm,
    full fine-tuning arm) pair, and calibrated quantization's edge over round-to-nearest for each
    (calibrated arm, RTN arm) pair."""
    claims = []
    if full in rows:
        for q in quantized:
            if q not in rows:
                continue
            e_q, e_full = rows[q]["entropy_first_tenth"], rows[full]["entropy_first_tenth"]
            if e_q is not None and e_full is not None:
                claims.append(target(f"early entropy: {q} > {full}", "higher under quantization", e_q - e_full,
                                     "nats/token difference", e_q > e_full))
            a, b = rows[q]["step_reward_0.5"], rows[full]["step_reward_0.5"]
            if a is not None and b is not None:
                claims.append(target(f"reward 0.5 sooner: {q} vs {full}", "fewer steps under quantization",
                                     a - b, "steps difference", a < b))
    claims += _pair_claims(rows, aqn_pairs, "AQN helps", "with AQN")
    claims += _pair_claims(rows, qlora_pairs, "beats QLoRA", "than QLoRA")
    claims += _par_claims(rows, full_ft_pairs)
    claims += _pair_claims(rows, calibrated_pairs, "calibration helps", "with calibrated scales")
    return claims


def _pairs(option: str, value: str, form: str, example: str) -> list[tuple[str, str]]:
    """`a:b,c:d` as [(a, b), (c, d)]; anything else is an error naming the option and its form."""
    pairs = []
    for item in filter(None, value.split(",")):
        a, sep, b = item.partition(":")
        if not (sep and a and b):
            raise QerlError(f"{option} {value!r}: expected {form} pairs, e.g. {example}")
        pairs.append((a, b))
    return pairs


def summarize_arms(arm_specs: Sequence[str], out_dir: Path, title: str = "arms", full: str = "bf16",
                   quantized: str = "nvfp4,nf4", aqn_pairs: str = "qerl:nvfp4,bf16-aqn:bf16",
                   qlora_pairs: str = "qerl:nf4,nvfp4:nf4", note: str = "", gpu: str | None = None,
                   full_ft_pairs: str = "qerl:full,qerl-act-mse:full", calibrated_pairs: str = "qerl-act-mse:qerl") -> dict[str, Any]:
    """`qerl-pipe bench arms`: read each NAME=RUN_DIR arm, write the plots and `arms.json` into
    `out_dir`; returns the results file. A malformed option is a QerlError before anything is read."""
    pairs = _pairs("--aqn-pairs", aqn_pairs, "WITH:WITHOUT", "qerl:nvfp4")
    qlora = _pairs("--qlora-pairs", qlora_pairs, "ARM:QLORA", "qerl:nf4")
    par = _pairs("--full-ft-pairs", full_ft_pairs, "ARM:FULL", "qerl:full")
    calibrated = _pairs("--calibrated-pairs", calibrated_pairs, "CALIBRATED:RTN", "qerl-act-mse:qerl")
    arms = {}
    for spec in arm_specs:
        name, sep, path = spec.partition("=")
        if not sep:
            raise QerlError(f"--arm {spec!r}: expected NAME=RUN_DIR")
        arms[name] = read_arm(Path(path), name)
    rows = {name: summarize(name, arm) for name, arm in arms.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = ["compare.png"] if compare.plot(list(arms.values()), out_dir / "compare.png", title) else []
    claims = paper_claims(rows, [q for q in quantized.split(",") if q], full, pairs, qlora, par, calibrated)
    extra = {"gpu": gpu} if gpu else {}
    out = results_file(list(rows.values()), claims, note=note, plots=plots, **extra)
    write_json(out_dir / "arms.json", nulls_for_non_finite(out))
    return out
