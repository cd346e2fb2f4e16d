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
# where the time goes: one in-process prepare (1 worker) of the 1.9 MB corpus under cProfile
echo "--- profile, $(uptime)"
PYTHON=${PYTHON:-.venv/bin/python}
$PYTHON - "$JSONL" "$WORK" <<'PY'
import cProfile, pstats, sys
from pathlib import Path
from attnlab.data.shards import prepare_token_shards
jsonl, work = Path(sys.argv[1]), Path(sys.argv[2])
cProfile.run("prepare_token_shards([jsonl], work / 'tok', work / 'profiled', workers=1)", str(work / "prepare.prof"))
stats = pstats.Stats(str(work / "prepare.prof"))
total = stats.total_tt
encode = sum(v[3] for k, v in stats.stats.items() if k[2] == "<method 'encode_batch' of 'tokenizers.Tokenizer' objects>")
print(f"total {total:.2f} s, of which tokenizers' encode_batch {encode:.2f} s ({100 * encode / total:.0f}%)")
PY
