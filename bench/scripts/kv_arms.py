"""Issue 50's accuracy row: greedy accuracy after training with a coded KV cache against the bf16 one.

Each run is a train artifact of the same recipe that differs only in `engine.kv_cache` and
`train.seed` (e.g. the quickstart's 16 steps of one-digit addition, stages up to train). Per run:
the held-out greedy accuracy before and after training (`compare.read_run`), the mean of
the rollout-vs-trainer mismatch metrics the steps logged, and the training time. Targets: each
coded cache's mean accuracy after training over the seeds within 2 points of the bf16 cache's.

python3 bench/scripts/kv_arms.py --run bf16@0=STORE/train-... --run int8@0=STORE/train-... --out FILE.json
"""
import argparse
import statistics
from pathlib import Path

from qerl_lab.results import results_file, target
from qerl_pipe import compare
from qerl_pipe.strict_json import write_json

POINTS = 0.02  # issue 50: within 2 points of the bf16 cache's accuracy


def run_row(name: str, directory: Path) -> dict:
    kv, seed = name.split("@")
    arm = compare.read_run(directory, name)
    mismatch = sorted({key for step in arm.records for key in step if key.startswith(("mismatch", "tis"))})
    return {"kv_cache": kv, "seed": int(seed), "artifact": directory.name, "steps": len(arm.records),
            "greedy_before": arm.greedy["before"], "greedy_after": arm.greedy["after"],
            "train_seconds": round(sum(step["step_seconds"] for step in arm.records), 1),
            "mismatch_means": {key: compare.mean_of(arm.records, key) for key in mismatch}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, help="KV@SEED=TRAIN_ARTIFACT_DIR (repeat)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    rows = [run_row(name, Path(directory)) for name, directory in (spec.split("=", 1) for spec in args.run)]
    after = {}
    for r in rows:
        after.setdefault(r["kv_cache"], []).append(r["greedy_after"]["accuracy"])
    base = statistics.fmean(after["bf16"])
    targets = [target(f"greedy accuracy after training, {kv} KV cache against bf16's (mean of {len(acc)} seeds: "
                      f"{statistics.fmean(acc):.3f} vs {base:.3f})", f"within {POINTS * 100:.0f} points",
                      round((statistics.fmean(acc) - base) * 100, 2), "points", abs(statistics.fmean(acc) - base) <= POINTS)
               for kv, acc in after.items() if kv != "bf16"]
    for r in rows:
        print(f"{r['kv_cache']:5} seed {r['seed']}: greedy {r['greedy_before']['correct']}/{r['greedy_before']['total']} -> "
              f"{r['greedy_after']['correct']}/{r['greedy_after']['total']}, {r['train_seconds']:.0f} s, {r['mismatch_means']}")
    write_json(args.out, results_file(rows, targets, note=args.note), indent=1)


if __name__ == "__main__":
    main()
