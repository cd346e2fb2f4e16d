#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md (its "GPU (H100)" parts), on a machine with one CUDA GPU and
# a torch with CUDA and triton already installed (attnlab is installed without touching them).
#   bench/gpu.sh cached       full attention's call through a cache, triton kernels vs torch's masked
#                             attention, over storages as long as the text and twice as long, 1k-128k
#   bench/gpu.sh pair         train the seed-sized speculative pair (dim 512, depth 10 / 2) on the
#                             built-in corpus, the draft distilled from the target (kept in RUNS)
#   bench/gpu.sh speculative  speculative decoding of that pair against the target's own decoding,
#                             gamma 5, both compiled (CUDA graphs) at temperature 1 batch 1 and 4 and
#                             greedy, batch 1 with the triton decode kernels, by the token rule and
#                             at gamma 8, then eagerly (trains the pair first where RUNS lacks it)
#   bench/gpu.sh tests        pytest tests/test_gpu.py (Triton and FlexAttention at real sizes, every
#                             variant, compiled decoding under CUDA graphs)
#   bench/gpu.sh decode       per-token decoding with the cache at 8k-64k context, and a profile at 64k
#   bench/gpu.sh train        a short training run (4 layers, 8k tokens, bf16): tokens/s and MFU, NSA on
#                             triton and torch vs full attention
#   bench/gpu.sh layer        one NSA layer (triton back-end, torch reference) vs SDPA flash at 8k-64k
#                             tokens, bf16: forward, forward+backward, peak memory (bench/nsa_gpu.py)
#   bench/gpu.sh kernels      each NSA branch alone at 8k-64k: the triton kernels and FlexAttention's
#                             window vs the torch reference, and full attention alone
# No part given: all of them, in that order: the triton decode kernels first (a minute or two; whether
# auto should take them on CUDA rests on it), then the open goals.
#
# The whole command keeps to a budget of BUDGET_S seconds (default 540: one device call may run 600,
# and the install and the copy of the results take the rest). Parts run in order while at least
# MIN_PART_S seconds (default 60) remain; each is stopped when the budget is spent, keeping what
# it wrote. The last line lists the parts skipped or cut, to run in a next call (a warm machine keeps
# RUNS). timings.jsonl in OUT records each part's seconds and how it ended, for planning.
# OUT=dir (default docs/bench/gpu)  RUNS=dir (default runs/gpu)  SPEC_STEPS=n (default 1500)
set -euo pipefail
script=$(realpath "$0")
cd "$(dirname "$script")/.."
out=${OUT:-docs/bench/gpu}
runs=${RUNS:-runs/gpu}
budget=${BUDGET_S:-540}
min_part=${MIN_PART_S:-60}
all_parts=(cached pair speculative tests decode train layer kernels)
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
stamp() { echo "{\"date\": \"$(date -u +%FT%TZ)\"}"; }  # (a copied tree's git metadata may be stale)

train_pair() {
    # the seed's models; a short bf16 run with a larger batch and learning rate than the seed's (its
    # 100k steps at lr 1e-4 do not fit a GPU lease); the draft distilled from the trained target.
    # --resume: a pair stopped by the budget continues where it was saved, a finished one returns at
    # once (no step left), a missing one starts
    attnlab speculative train --target-preset spec-target --draft-preset spec-draft --distill 1.0 --resume \
        data.source=builtin out_dir="$runs" train.max_steps="${SPEC_STEPS:-1500}" train.batch_size=16 \
        train.grad_accum=1 train.lr=1e-3 train.schedule=cosine train.warmup_steps=100 train.grad_clip=1.0 \
        train.eval_every=500 train.eval_batches=8 train.sample_every=0 train.save_every=500 \
        log.progress=false >> "$out/spec-train.log" 2>&1 || { tail -30 "$out/spec-train.log"; return 1; }
    tail -4 "$out/spec-train.log"
}

speculative_runs() {
    train_pair
    : > "$out/speculative.jsonl"
    # issue 24's goals first: both models compiled (CUDA graphs), the target's compiled decoding as
    # the base; greedy shows the output equals the target's; then batch 1 again with the attention's
    # cached calls on the triton back-end's kernels (auto leaves them to torch on CUDA), with the
    # token rule instead of block verification, and at gamma 8 (a verification of 9 rows costs a GPU
    # about what one of 6 does; the block rule gains more the longer the draft), and by the shared
    # window (at batch 1 the same tokens, each step committed by eager operations between the
    # graphs where per-row commits inside them: commit_rows). Then eagerly, batch 4 both ways (each
    # row's caches rolled back to its own length, and all rows to the shortest). A later --gamma
    # overrides the first.
    for run in "1 auto 1 --compile" "1 auto 0 --compile" "4 per-row 1 --compile" \
               "1 auto 1 --compile --attention-backend=triton" "1 auto 1 --compile --verification=token" \
               "1 auto 1 --compile --gamma=8" "1 shared 1 --compile" \
               "1 auto 1" "4 per-row 1" "4 shared 1" "1 auto 0"; do
        read -r batch scheme temperature compile <<< "$run"
        attnlab speculative --target "$runs/spec-target" --draft "$runs/spec-draft" --gamma 5 --prime-from-val \
            --max-new-tokens 256 --batch-size "$batch" --batch-scheme "$scheme" --temperature "$temperature" \
            --repeats 5 --device cuda --json $compile > "$out/speculative-run.json" \
            || { echo "failed: attnlab speculative ... $run"; continue; }
        cat "$out/speculative-run.json" >> "$out/speculative.jsonl"
        python3 - "$out/speculative-run.json" <<'SUMMARY'
import json, sys
r = json.load(open(sys.argv[1]))
s = r["speculative"]
line = (f"batch {r['batch_size']} ({s['batch_scheme']}), temperature {r['sampling']['temperature']}, "
        f"{'compiled ' + str(r['compiled_entries']) if r['compile'] else 'eager'}, attention {r['attention_backend']}: base {r['base']['ms']:.0f} ms "
        f"({r['base']['ms'] / r['max_new_tokens']:.2f} ms/token, prefill included), speculative {s['ms']:.0f} ms, speedup "
        f"{r['speedup']:.2f}x (paired median {r['speedup_paired_median']:.2f}x), {s['mean_accepted']:.2f} of "
        f"{r['gamma']} accepted a step ({r['verification']} verification), cudagraph skips {r['cudagraph_skips']}")
if r["sampling"]["temperature"] == 0:
    line += f", greedy text equals the target's: {s['text'] == r['base']['text']}"
print(line)
SUMMARY
    done
    rm -f "$out/speculative-run.json"
}

run_part() {
    case $1 in
    pair) train_pair ;;
    speculative) stamp; speculative_runs ;;
    tests)
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
        python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
        # one line per test in the log, so a run stopped by the budget still says what passed
        python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider > "$out/tests.log" 2>&1 \
            || echo "tests/test_gpu.py failed or was stopped: see $out/tests.log"
        grep -E "FAILED|ERROR|passed|failed" "$out/tests.log" | grep -v DEBUG | tail -40
        ;;
    cached) stamp; python3 bench/cached_attention_gpu.py --out "$out" ;;
    layer) stamp; python3 bench/nsa_gpu.py --out "$out" --context ;;
    kernels) stamp; python3 bench/nsa_gpu.py --out "$out" --seq-len --context --kernels 8192 16384 32768 65536 ;;
    decode) stamp; python3 bench/nsa_gpu.py --out "$out" --seq-len --profile ;;
    train) stamp; python3 bench/nsa_gpu.py --out "$out" --seq-len --context --train ;;
    esac
}

run_within() {  # part, seconds -> prints done, cut or "failed (status)"; the part's output goes to stderr
    # in a process group of its own: when the time is up, every process of it gets SIGTERM (training
    # saves its last step), then SIGKILL whatever is left after a grace period; none outlives the part
    ATTNLAB_GPU_PART=$1 setsid bash "$script" >&2 &
    local pid=$! deadline=$((SECONDS + $2)) code=0
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM -- "-$pid" 2>/dev/null || true
        for _ in $(seq 15); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        echo cut
        return
    fi
    wait "$pid" || code=$?
    if ((code == 0)); then echo done; else echo "failed ($code)"; fi
}

if [[ ${ATTNLAB_GPU_PART:-} ]]; then  # one part, in a process group the budget's timeout can stop
    run_part "$ATTNLAB_GPU_PART"
    exit
fi

parts=("$@")
if [[ ${#parts[@]} -eq 0 ]]; then parts=("${all_parts[@]}"); fi
for part in "${parts[@]}"; do
    if [[ ! " ${all_parts[*]} " == *" $part "* ]]; then
        echo "unknown part $part (${all_parts[*]})"
        exit 2
    fi
done
if ! python3 -c "import attnlab" 2>/dev/null; then
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
fi

left_over=()
for part in "${parts[@]}"; do
    left=$((budget - SECONDS))
    if ((left < min_part)); then
        echo "== $part: skipped (${left} s of the budget left, a part needs ${min_part})"
        printf '{"part": "%s", "status": "skipped", "seconds": 0}\n' "$part" >> "$out/timings.jsonl"
        left_over+=("$part")
        continue
    fi
    echo "== $part (at most ${left} s)"
    started=$SECONDS
    status=$(run_within "$part" "$left")
    if [[ $status == cut ]]; then left_over+=("$part"); fi
    seconds=$((SECONDS - started))
    echo "== $part: $status after ${seconds} s"
    printf '{"part": "%s", "status": "%s", "seconds": %d, "date": "%s"}\n' \
        "$part" "$status" "$seconds" "$(date -u +%FT%TZ)" >> "$out/timings.jsonl"
done
if ((${#left_over[@]})); then
    echo "not done within the budget: bash bench/gpu.sh ${left_over[*]}"
else
    echo "every part ran"
fi
