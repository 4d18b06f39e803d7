#!/usr/bin/env bash
# Copies what `qerl-pipe bench arms` and `bench seeds` read from each finished arm of a
# `bench/train_arms.sh` session: the train artifact named on the last `train: DIR` line of the
# arm's log (or `train: up to date, reusing DIR`, an arm that finished in an earlier session),
# without checkpoints or weights, plus the log itself (an unfinished arm: its log only).
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
  run=$(grep -E '^train: (up to date, reusing )?/?[^ ]*train-[0-9a-f]+$' "$log" | tail -1 | awk '{print $NF}')
  if [ -z "$run" ] || [ ! -d "$run" ]; then
    echo "$name: not finished (no train artifact in its log); log copied" >&2
    continue
  fi
  # checkpoints/, adapter/ (LoRA) and model/ (full fine-tuning) hold the weights and their configs
  (cd "$run" && find . \( -path ./checkpoints -o -path ./adapter -o -path ./model \) -prune -o -type f \
    \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.png' -o -name '*.txt' \) \
    ! -name manifest.json -print) |
    while read -r f; do
      mkdir -p "$out/$name/$(dirname "$f")"
      cp "$run/$f" "$out/$name/$f"
    done
  echo "$name: $run -> $out/$name ($(wc -l <"$out/$name/metrics.jsonl" 2>/dev/null || echo 0) steps)"
done
