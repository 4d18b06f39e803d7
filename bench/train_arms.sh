#!/usr/bin/env bash
# Learning-dynamics arms on one GPU: the same recipe (same seeds, data order and step count) with
# one setting changed per arm, all started at once. The 135M model leaves the H200 mostly idle, so
# the arms share it; their step times are therefore not the single-run step time (see
# `qerl-pipe bench train-step` for that). The shared stages (calibrate, quantize, build-engine)
# are built once: the artifact store's per-id lock makes the other arms wait and reuse them.
#
# usage: bench/train_arms.sh RECIPE OUT_DIR SECONDS 'name|--set a=b --set c=d' ...
# Each arm's log goes to OUT_DIR/NAME.log (a NAME may hold a folder: seed1/qerl). A run killed at
# SECONDS resumes from its last checkpoint when started again with the same sets; the logs are
# appended to, each session after a header line, so the log keeps every session's steps (the
# `bench arms` log reader keeps a step's last printing) and the `train: DIR` line that
# `bench/collect_arms.sh` reads, also for an arm that finished in an earlier session.
# The artifact store (and the train work directories, <store>/.runs/) is qerl-pipe's:
# $QERL_ARTIFACTS, else ./artifacts.
set -uo pipefail
recipe=$1 out=$2 seconds=$3
shift 3
mkdir -p "$out"
pids=()
for arm in "$@"; do
  name=${arm%%|*} sets=${arm#*|}
  mkdir -p "$(dirname "$out/$name")"
  echo "== bench/train_arms.sh $(date -u +%FT%TZ): $recipe $sets (stopped after $seconds s)" | tee -a "$out/$name.out" >>"$out/$name.log"
  # shellcheck disable=SC2086  # the --set options are meant to split
  timeout "$seconds" python3 -m qerl_pipe run "$recipe" $sets >>"$out/$name.out" 2>>"$out/$name.log" &
  pids+=($!)
  sleep 2
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
