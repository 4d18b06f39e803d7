"""Issues 47 and 50's accuracy rows: greedy accuracy after training with FP8 rollouts against bf16 ones.

Each run is a train artifact of the same recipe that differs only in one engine setting, `engine.kv_cache`
(issue 50: a coded KV cache) or `engine.activations` (issue 47: FP8 activations), and `train.seed`
(e.g. the quickstart's 16 steps of one-digit addition, stages up to train). Per run: the held-out greedy
accuracy before and after training (`compare.read_run`), the mean of the rollout-vs-trainer mismatch
metrics the steps logged, and the training time. Targets: each FP8 arm's mean accuracy after training over
the seeds within 2 points of the bf16 arm's. `--baseline FILE` takes the bf16 arm's rows from an earlier
results file of this script (their artifacts need not exist any more; the rows say where they came from).

python3 bench/scripts/fp8_arms.py --setting kv_cache --run bf16@0=STORE/train-... --run int8@0=STORE/train-... \
    --out FILE.json
"""
import argparse
import json
import statistics
from pathlib import Path

from qerl_lab.results import results_file, target
from qerl_pipe import compare
from qerl_pipe.strict_json import write_json

POINTS = 0.02  # issues 47 and 50: within 2 points of the bf16 arm's accuracy
SETTINGS = ("kv_cache", "activations")


def run_row(setting: str, name: str, directory: Path) -> dict:
    value, seed = name.split("@")
    arm = compare.read_run(directory, name)
    mismatch = sorted({key for step in arm.records for key in step if key.startswith(("mismatch", "tis"))})
    return {setting: value, "seed": int(seed), "artifact": directory.name, "steps": len(arm.records),
            "greedy_before": arm.greedy["before"], "greedy_after": arm.greedy["after"],
            "train_seconds": round(sum(step["step_seconds"] for step in arm.records), 1),
            "mismatch_means": {key: compare.mean_of(arm.records, key) for key in mismatch}}


def baseline_rows(setting: str, path: Path) -> list[dict]:
    """The bf16 arm's rows of an earlier results file (any setting's bf16 arm is the same run)."""
    earlier = json.loads(path.read_text())
    rows = [r for r in earlier["results"] if any(r.get(s) == "bf16" for s in SETTINGS)]
    if not rows:
        raise SystemExit(f"--baseline {path}: no bf16 rows in it")
    return [{setting: "bf16", **{k: v for k, v in r.items() if k not in SETTINGS},
             "from": f"{path.name} at {earlier.get('commit')}"} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=SETTINGS, default="kv_cache", help="the engine setting the arms differ in")
    parser.add_argument("--run", action="append", required=True, help="VALUE@SEED=TRAIN_ARTIFACT_DIR (repeat)")
    parser.add_argument("--baseline", type=Path, help="an earlier results file whose bf16 rows are the bf16 arm")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    specs = [spec.split("=", 1) for spec in args.run]
    rows = [run_row(args.setting, name, Path(directory)) for name, directory in specs]
    if args.baseline is not None:
        rows = baseline_rows(args.setting, args.baseline) + rows
    after: dict[str, list[float]] = {}
    for r in rows:
        after.setdefault(r[args.setting], []).append(r["greedy_after"]["accuracy"])
    if "bf16" not in after:
        raise SystemExit("no bf16 arm: pass --run bf16@SEED=... or --baseline FILE")
    base = statistics.fmean(after["bf16"])
    what = {"kv_cache": "KV cache", "activations": "activations"}[args.setting]
    targets = []
    for value, acc in after.items():
        if value != "bf16":
            gap = statistics.fmean(acc) - base
            targets.append(target(f"greedy accuracy after training, {value} {what} against bf16's (mean of "
                                  f"{len(acc)} seeds: {statistics.fmean(acc):.3f} vs {base:.3f})",
                                  f"within {POINTS * 100:.0f} points", round(gap * 100, 2), "points",
                                  abs(gap) <= POINTS))
    for r in rows:
        before, done = r["greedy_before"], r["greedy_after"]
        print(f"{r[args.setting]:5} seed {r['seed']}: greedy {before['correct']}/{before['total']} -> "
              f"{done['correct']}/{done['total']}, {r['train_seconds']:.0f} s, {r['mismatch_means']}")
    write_json(args.out, results_file(rows, targets, note=args.note), indent=1)


if __name__ == "__main__":
    main()
