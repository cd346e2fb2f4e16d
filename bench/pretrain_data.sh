#!/usr/bin/env bash
# Tokenization throughput of `attnlab data prepare` in MB/s of jsonl input: the built-in jsonl corpus
# (standard-library docstrings) repeated 10 times (~19 MB), a 6400-token BPE (MiniMind's size) trained on
# it, then `data prepare` with 1 and 2 worker processes, 3 runs each, side by side (report medians).
# The MB/s printed is measured inside prepare (read + parse + tokenize + write, pool start included);
# the wall time adds Python start-up and imports.
#   OMP_NUM_THREADS=2 bench/pretrain_data.sh [WORK]
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
WORK=${1:-/tmp/attnlab-bench-prepare}
ATTNLAB=${ATTNLAB:-.venv/bin/attnlab}
mkdir -p "$WORK"
JSONL=$($ATTNLAB data prepare builtin-jsonl --cache-dir "$WORK/cache" 2>/dev/null | tail -1)
for _ in $(seq 10); do cat "$JSONL"; done > "$WORK/corpus.jsonl"
ls -l "$WORK/corpus.jsonl"
[ -f "$WORK/tok/tokenizer_config.json" ] || $ATTNLAB tokenizer train --input "$JSONL" --vocab-size 6400 --out "$WORK/tok"
date -u
for run in 1 2 3; do
  for workers in 1 2; do
    echo "--- workers $workers, run $run, $(uptime)"
    start=$(date +%s.%N)
    $ATTNLAB data prepare --input "$WORK/corpus.jsonl" --tokenizer "$WORK/tok" --out "$WORK/data-$workers" \
      --workers "$workers" 2>/dev/null | tail -1
    echo "    wall $(echo "$(date +%s.%N) - $start" | bc) s"
  done
done
