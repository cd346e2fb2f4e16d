#!/usr/bin/env bash
# minimind-demo end to end on a fresh cache, as on a fresh machine: built-in jsonl corpus, BPE
# tokenizer, token shards, training, samples. Records wall clock (total and per stage), the validation
# loss curve and the median training tokens/s, with the load average before and after.
#   OMP_NUM_THREADS=2 bench/minimind_demo.sh [OUT]       (OUT default /tmp/attnlab-bench-minimind-demo)
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
OUT=${1:-/tmp/attnlab-bench-minimind-demo}
ATTNLAB=${ATTNLAB:-.venv/bin/attnlab}
PYTHON=${PYTHON:-.venv/bin/python}
rm -rf "$OUT"
mkdir -p "$OUT"
export ATTNLAB_CACHE="$OUT/cache"  # empty: every stage is built
date -u; uptime
start=$(date +%s.%N)
$ATTNLAB train -p minimind-demo out_dir="$OUT/runs" log.progress=false 2>&1 | tee "$OUT/train.log"
end=$(date +%s.%N)
uptime
echo "wall clock, fresh cache: $(echo "$end - $start" | bc) s"
second=$(date +%s.%N)
$ATTNLAB data info -p minimind-demo > /dev/null 2> "$OUT/second.log"  # every stage cached now
echo "data stages again (cached): $(echo "$(date +%s.%N) - $second" | bc) s"; grep -c cached "$OUT/second.log"
$PYTHON - "$OUT/runs/minimind-demo/metrics.jsonl" <<'PY'
import json, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1])]
print("validation loss:", [(r["step"], round(r["val_loss"], 3)) for r in records if "val_loss" in r])
print("validation bits per byte:", [(r["step"], round(r["val_bpb"], 3)) for r in records if "val_bpb" in r])
speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
print(f"training tokens/s: median {statistics.median(speeds):.0f} over {len(speeds)} logged steps")
print(f"training time (optimiser steps only): {max(r.get('elapsed_s', 0) for r in records):.1f} s")
PY
