#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md (the "GPU (H100)" parts of its NSA and speculative decoding
# sections), on a machine with one CUDA GPU and a torch
# with CUDA and triton already installed (attnlab is installed without touching them).
#   bench/gpu.sh tests        pytest tests/test_gpu.py (Triton and FlexAttention at real sizes, every variant)
#   bench/gpu.sh layer        one NSA layer (triton back-end, torch reference) vs SDPA flash at 8k-64k
#                             tokens, bf16: forward, forward+backward, peak memory (bench/nsa_gpu.py)
#   bench/gpu.sh kernels      each NSA branch alone at 8k-64k: the triton kernels (compressed branch with
#                             the selection, selected branch) and FlexAttention's window vs the torch
#                             reference, and full attention alone (SDPA flash, flash-attn if installed)
#   bench/gpu.sh train        a short training run (4 layers, 8k tokens, bf16): tokens/s and MFU, NSA on
#                             triton and torch vs full attention
#   bench/gpu.sh decode       per-token decoding with the cache at 8k-64k context, and a profile at 64k
#   bench/gpu.sh speculative  train the seed-sized pair (dim 512, depth 10 / 2) on the built-in corpus
#                             and time speculative decoding at gamma 5, batch 1 and 4 (per-row and shared),
#                             eager and with compiled steps (CUDA graphs)
# No part given: all of them, in one command (planned to fit 25 minutes on one H100; not yet timed).
# OUT=dir (default docs/bench/gpu)  RUNS=dir (default runs/gpu)  SPEC_STEPS=n (default 1500)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-docs/bench/gpu}
runs=${RUNS:-runs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
if ! python3 -c "import attnlab" 2>/dev/null; then
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
fi
stamp() { echo "{\"date\": \"$(date -u +%FT%TZ)\"}"; }  # (a copied tree's git metadata may be stale)

parts=("$@")
if [[ ${#parts[@]} -eq 0 ]]; then parts=(tests layer kernels decode train speculative); fi
for part in "${parts[@]}"; do
case $part in
tests)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    # a failing test is reported, and the benchmark parts after it still run
    python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tee "$out/tests.log" | grep -v DEBUG | tail -40 \
        || echo "tests/test_gpu.py failed: see $out/tests.log"
    ;;
layer)
    stamp
    python3 bench/nsa_gpu.py --out "$out" --context
    ;;
kernels)
    stamp
    python3 bench/nsa_gpu.py --out "$out" --seq-len --context --kernels 8192 16384 32768 65536
    ;;
decode)
    stamp
    python3 bench/nsa_gpu.py --out "$out" --seq-len --profile
    ;;
train)
    stamp
    python3 bench/nsa_gpu.py --out "$out" --seq-len --context --train
    ;;
speculative)
    stamp
    if ! ls "$runs"/spec-draft/checkpoints/* >/dev/null 2>&1; then
        # the seed's models; a short bf16 run with a larger batch and learning rate than the seed's
        # (its 100k steps at lr 1e-4 do not fit a GPU lease)
        attnlab speculative train --target-preset spec-target --draft-preset spec-draft data.source=builtin \
            out_dir="$runs" train.max_steps="${SPEC_STEPS:-1500}" train.batch_size=16 train.grad_accum=1 \
            train.lr=1e-3 train.schedule=cosine train.warmup_steps=100 train.grad_clip=1.0 \
            train.eval_every=500 train.eval_batches=8 train.sample_every=0 train.save_every=100000 \
            log.progress=false > "$out/spec-train.log" 2>&1 || { tail -30 "$out/spec-train.log"; exit 1; }
        tail -8 "$out/spec-train.log"
    fi
    : > "$out/speculative.jsonl"
    # eager: temperature 1 and 0; batch 4 twice: each row's caches rolled back to its own length, and
    # all rows to the shortest. Then compiled (both models' steps under CUDA graphs, the target's own
    # compiled decoding as the base: issue 24's goals) at temperature 1, batch 1 and 4 per-row.
    for run in "1 auto 1" "4 per-row 1" "4 shared 1" "1 auto 0" "4 per-row 0" "4 shared 0" \
               "1 auto 1 --compile" "4 per-row 1 --compile"; do
        read -r batch scheme temperature compile <<< "$run"
        attnlab speculative --target "$runs/spec-target" --draft "$runs/spec-draft" --gamma 5 --prime-from-val \
            --max-new-tokens 256 --batch-size "$batch" --batch-scheme "$scheme" --temperature "$temperature" \
            --repeats 5 --device cuda --json $compile | tee -a "$out/speculative.jsonl"
    done
    ;;
*) echo "unknown part $part (tests, layer, kernels, decode, train, speculative)"; exit 2 ;;
esac
done
