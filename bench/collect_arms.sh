#!/usr/bin/env bash
# Copies what `python -m qerl_pipe.bench.arms` and `bench.seeds` read from each finished arm of a
# `bench/train_arms.sh` session: the train artifact named on the last `train: DIR` line of the
# arm's log, without checkpoints or weights, plus the log itself (an unfinished arm: its log only).
#
# usage: bench/collect_arms.sh LOG_DIR OUT_DIR
# Each LOG_DIR/NAME.log becomes OUT_DIR/NAME/ (metrics.jsonl, run.json, report.*, eval/, plots/)
# and OUT_DIR/logs/NAME.log.
set -uo pipefail
logs=$1 out=$2
mkdir -p "$out/logs"
for log in "$logs"/*.log; do
  name=$(basename "$log" .log)
  cp "$log" "$out/logs/$name.log"
  run=$(grep -o '^train: .*' "$log" | tail -1 | cut -d' ' -f2-)
  if [ -z "$run" ] || [ ! -d "$run" ]; then
    echo "$name: not finished (no train artifact in its log); log copied" >&2
    continue
  fi
  (cd "$run" && find . -path ./checkpoints -prune -o -type f \
    \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' -o -name '*.txt' \) -print) |
    while read -r f; do
      mkdir -p "$out/$name/$(dirname "$f")"
      cp "$run/$f" "$out/$name/$f"
    done
  echo "$name: $run -> $out/$name ($(wc -l <"$out/$name/metrics.jsonl" 2>/dev/null || echo 0) steps)"
done
