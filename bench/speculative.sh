#!/usr/bin/env bash
# Speculative decoding on CPU (issue 5, docs/benchmarks.md "Speculative decoding"): train the
# 6-layer target and the 1-layer draft (dim 256) on the same batches of the built-in corpus, then
# time the target's own cached decoding against speculative decoding (gamma 5) at batch 1 and 4,
# with the load average written before and after every figure. Outputs JSON lines in $OUT.
#   RUNS=dir (trained pair, reused when present)  OUT=dir  REPEATS=n  STEPS=n  TRAIN_THREADS=n
#   THREADS=n (default 2; on a machine busier than its cores, 1: two OpenMP threads that must
#   meet at a barrier make each small forward many times slower there)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-runs/bench-speculative}
out=${OUT:-docs/bench/speculative}
repeats=${REPEATS:-7}
steps=${STEPS:-1200}
attnlab=${ATTNLAB:-attnlab}
python=${PYTHON:-python}
mkdir -p "$out"
target=$runs/spec-small-target
draft=$runs/spec-small-draft

if ! ls "$draft"/checkpoints/* >/dev/null 2>&1; then
    # both runs see exactly the same batches (target first, then the draft); one thread each is
    # faster than two on a busy 2-core machine
    OMP_NUM_THREADS=${TRAIN_THREADS:-2} $attnlab speculative train --target-preset spec-small-target \
        --draft-preset spec-small-draft out_dir="$runs" train.max_steps="$steps" log.progress=false
fi

export OMP_NUM_THREADS=${THREADS:-2}
stamp() { echo "{\"date\": \"$(date -u +%FT%TZ)\", \"uptime\": \"$(uptime | sed 's/.*load average: //')\"}"; }
{
    stamp
    $python bench/speculative_costs.py "$target" "$draft" --rounds "${ROUNDS:-200}"
    stamp
} | tee "$out/costs.jsonl"
: > "$out/decode.jsonl"
for temperature in 1 0; do
    for batch in 1 4; do
        stamp | tee -a "$out/decode.jsonl"
        $attnlab speculative --target "$target" --draft "$draft" --gamma 5 --prime-from-val \
            --max-new-tokens 256 --batch-size "$batch" --temperature "$temperature" \
            --repeats "$repeats" --json | tee -a "$out/decode.jsonl"
    done
done
stamp | tee -a "$out/decode.jsonl"
