"""Issue 50's accuracy row: greedy accuracy after training with a coded KV cache against the bf16 one.

Each run is a train artifact of the same recipe that differs only in `engine.kv_cache` and
`train.seed` (e.g. the quickstart's 16 steps of one-digit addition, stages up to train). Per run:
the held-out greedy accuracy before and after training (the artifact's report.json), the mean of
the rollout-vs-trainer mismatch metrics the steps logged, and the training time. Targets: each
coded cache's mean accuracy after training over the seeds within 2 points of the bf16 cache's.

python3 bench/scripts/kv_arms.py --run bf16@0=STORE/train-... --run int8@0=STORE/train-... --out FILE.json
"""
import argparse
import json
import statistics
from pathlib import Path

from qerl_lab.results import results_file, target
from qerl_pipe.strict_json import write_json

POINTS = 0.02  # issue 50: within 2 points of the bf16 cache's accuracy


def run_row(name: str, directory: Path) -> dict:
    kv, seed = name.split("@")
    report = json.loads((directory / "report.json").read_text())
    steps = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line.strip()]
    mismatch = sorted({key for step in steps for key in step if key.startswith(("mismatch", "tis"))})
    return {"kv_cache": kv, "seed": int(seed), "artifact": directory.name, "steps": report["steps"],
            "greedy_before": report["eval_before"], "greedy_after": report["eval_after"],
            "train_seconds": report["step_seconds_total"],
            "mismatch_means": {key: statistics.fmean(s[key] for s in steps if isinstance(s.get(key), (int, float)))
                               for key in mismatch if any(isinstance(s.get(key), (int, float)) for s in steps)}}


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
