#!/usr/bin/env bash
# "Memory stays flat over a long run": RSS at step 100 vs step 1000 of a small tokenized CPU run
# (minimind-demo data and recipe; evaluation every 100 steps, samples and checkpoints every 500),
# dense SwiGLU and MoE (aux losses), one JSON line each. See bench/memory_flat.py.
#   OMP_NUM_THREADS=2 bench/memory_flat.sh [OUT]
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
OUT=${1:-/tmp/attnlab-memory-flat}
PYTHON=${PYTHON:-.venv/bin/python}
SMALL=(model.dim=32 model.depth=1 model.heads=2 model.kv_heads=1 model.ff_hidden=64 train.seq_len=32
       train.batch_size=4 train.eval_batches=2)
for feed_forward in swiglu moe; do
  date -u; uptime
  $PYTHON bench/memory_flat.py --out "$OUT" --feed-forward "$feed_forward" "${SMALL[@]}" 2>/dev/null
  uptime
done
