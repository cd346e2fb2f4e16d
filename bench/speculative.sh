#!/usr/bin/env bash
# Speculative decoding on CPU (issue 5, docs/benchmarks.md "Speculative decoding"): train the
# 6-layer target and the 1-layer draft (dim 256) on the same batches of the built-in corpus, and a
# second 1-layer draft distilled from that target (--distill 1.0, --draft-steps: the target's
# batches, then the stream's next ones, DRAFT_STEPS in all, default 3000); then time the
# target's own cached decoding against speculative decoding (gamma 5) with each draft, at batch 1
# and 4 (batch 4 with each row's caches rolled back to its own length, and with all rows rolled
# back to the shortest one), temperature 1 without and with the seed's top-k 26 filter, and
# greedy, each with the draft's float weights and with int8 weights (--draft-quantize), side by
# side; with the load average written before and after every figure. Outputs JSON lines in $OUT.
#   RUNS=dir (trained runs, reused when present)  OUT=dir  REPEATS=n  STEPS=n (default 1200)
#   TRAIN_THREADS=n  THREADS=n (default 2; on a machine busier than its cores, 1: two OpenMP
#   threads that must meet at a barrier make each small forward many times slower there)
#   DRAFTS="plain distilled" (which drafts to time)  QUANTIZE="none int8" (the draft's weights)
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
declare -A draft_dirs=([plain]=$runs/spec-small-draft [distilled]=$runs/spec-small-draft-distill)
trained() { ls "$1"/checkpoints/* >/dev/null 2>&1; }

train_threads=${TRAIN_THREADS:-2}
if ! trained "$target"; then
    # the target, then the draft on exactly the same batches, each with its own optimiser
    OMP_NUM_THREADS=$train_threads $attnlab speculative train --target-preset spec-small-target \
        --draft-preset spec-small-draft out_dir="$runs" train.max_steps="$steps" log.progress=false
fi
if ! trained "${draft_dirs[plain]}"; then
    OMP_NUM_THREADS=$train_threads $attnlab speculative train --target "$target" \
        --draft-preset spec-small-draft out_dir="$runs" log.progress=false
fi
if ! trained "${draft_dirs[distilled]}"; then
    # the same batches again, the loss pulled toward the trained target's distribution
    OMP_NUM_THREADS=$train_threads $attnlab speculative train --target "$target" \
        --draft-preset spec-small-draft --distill 1.0 --draft-steps "${DRAFT_STEPS:-3000}" \
        draft.name=spec-small-draft-distill out_dir="$runs" log.progress=false
fi

export OMP_NUM_THREADS=${THREADS:-2}
stamp() { echo "{\"date\": \"$(date -u +%FT%TZ)\", \"uptime\": \"$(uptime | sed 's/.*load average: //')\"}"; }
for kind in ${DRAFTS:-plain distilled}; do
    draft=${draft_dirs[$kind]}
    {
        for quantize in ${QUANTIZE:-none int8}; do
            stamp
            echo "{\"draft_quantize\": \"$quantize\"}"
            $python bench/speculative_costs.py "$target" "$draft" --rounds "${ROUNDS:-200}" --draft-quantize "$quantize"
        done
        stamp
    } | tee "$out/costs-$kind.jsonl"
    : > "$out/decode-$kind.jsonl"
    for sampling in "--temperature 1" "--temperature 1 --top-k 26" "--temperature 0"; do
        # batch 4 twice: each row rolled back to its own length (per-row), and all rows to the
        # shortest committed prefix (shared), side by side
        for run in "1 auto" "4 per-row" "4 shared"; do
            read -r batch scheme <<< "$run"
            for quantize in ${QUANTIZE:-none int8}; do
                stamp | tee -a "$out/decode-$kind.jsonl"
                # shellcheck disable=SC2086  # $sampling is two or four words on purpose
                $attnlab speculative --target "$target" --draft "$draft" --gamma 5 --prime-from-val \
                    --max-new-tokens 256 --batch-size "$batch" --batch-scheme "$scheme" $sampling \
                    --draft-quantize "$quantize" --repeats "$repeats" --json | tee -a "$out/decode-$kind.jsonl"
            done
        done
    done
    stamp | tee -a "$out/decode-$kind.jsonl"
done
