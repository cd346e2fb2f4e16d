#!/usr/bin/env bash
# The NSA figures of docs/benchmarks.md (section "NSA"): training throughput and peak memory of NSA
# vs full attention at 4096 and 8192 tokens (dim 256, depth 4, heads 4, kv_heads 2, window 64,
# compress 16 stride 8, selection 16, 4 selected, batch 1, fp32, CPU), with 2 threads and with 1;
# decode latency and key/value tokens loaded per step; the nsa-small vs full quality run.
# Writes JSON lines and markdown tables to $OUT (default docs/bench/nsa-kernel/). Run on an otherwise
# idle machine. ATTNLAB_CPU_KERNELS=0 gives the pure-torch path's figures.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-docs/bench/nsa-kernel}
mkdir -p "$out"
nsa=(kv_heads=2 attention.nsa.sliding_window_size=64 attention.nsa.compress_block_size=16
     attention.nsa.compress_stride=8 attention.nsa.selection_block_size=16 attention.nsa.num_selected=4)
part=${1:-all}

if [[ $part == all || $part == train ]]; then
    # "2-passive": 2 threads with OMP_WAIT_POLICY=PASSIVE (idle OpenMP threads sleep instead of
    # spinning; on a machine loaded by other jobs spinning threads slow many-op layers like NSA most)
    for run in ${NSA_THREADS:-2 2-passive 1}; do
        threads=${run%-passive}
        settings=(OMP_NUM_THREADS="$threads")
        if [[ $run == *-passive ]]; then settings+=(OMP_WAIT_POLICY=PASSIVE); fi
        uptime
        env "${settings[@]}" attnlab bench train --attention full nsa \
            --threads "$threads" --set "${nsa[@]}" --seq-len 4096 8192 --batch-size 1 --steps 5 --warmup 3 \
            --out "$out/nsa-train-$run.jsonl" --markdown "$out/nsa-train-$run.md"
        uptime
    done
    # the step-time ratio with both models stepping in turn in one process (same load for both)
    for run in ${NSA_THREADS:-2 2-passive 1}; do
        threads=${run%-passive}
        settings=(OMP_NUM_THREADS="$threads")
        if [[ $run == *-passive ]]; then settings+=(OMP_WAIT_POLICY=PASSIVE); fi
        uptime
        env "${settings[@]}" python bench/nsa_interleaved.py --seq-len 4096 --steps 5 | tee -a "$out/nsa-interleaved.jsonl"
    done
    uptime
    # NSA with straight-through top-k (the presets' setting), on the kernel and on the torch path
    for kernels in 1 0; do
        ATTNLAB_CPU_KERNELS=$kernels OMP_NUM_THREADS=2 python bench/nsa_interleaved.py --seq-len 4096 --steps 5 \
            --diff-topk | tee -a "$out/nsa-interleaved-diff-topk.jsonl"
    done
    uptime
    # the kernel against the torch path, branch by branch (attention cores only)
    OMP_NUM_THREADS=2 python bench/nsa_kernel.py --seq-len 4096 --rounds 9 | tee "$out/nsa-kernel.txt"
    uptime
    # where the time goes: the same NSA with the parameter-free mean compressor instead of the MLP
    OMP_NUM_THREADS=1 attnlab bench train --attention nsa --threads 1 --set "${nsa[@]}" attention.nsa.compressor=mean \
        --seq-len 4096 --batch-size 1 --steps 5 --warmup 3 \
        --out "$out/nsa-train-mean-1.jsonl" --markdown "$out/nsa-train-mean-1.md"
    uptime
fi

if [[ $part == all || $part == decode ]]; then
    uptime
    OMP_NUM_THREADS=2 attnlab bench decode --attention full nsa --set "${nsa[@]}" \
        --context 1024 4096 8192 --new-tokens 16 --no-uncached \
        --out "$out/nsa-decode.jsonl" --markdown "$out/nsa-decode.md"
    uptime
    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2 attnlab bench decode --attention full nsa --set "${nsa[@]}" \
        --context 1024 4096 8192 --new-tokens 16 --no-uncached \
        --out "$out/nsa-decode-passive.jsonl" --markdown "$out/nsa-decode-passive.md"
    uptime
fi

if [[ $part == all || $part == quality ]]; then
    # nsa-small and the same model with full attention: same seed, data and steps; one thread each,
    # the two runs side by side
    steps=${NSA_QUALITY_STEPS:-100}
    runs=runs/nsa-quality/$(date -u +%Y%m%d-%H%M%S)  # a new directory per run: attnlab never overwrites a run
    uptime
    for kind in nsa full; do
        OMP_NUM_THREADS=1 attnlab train -p nsa-small model.attention.kind=$kind name=nsa-small-$kind \
            out_dir="$runs" train.max_steps=$steps train.batch_size=8 train.eval_every=50 \
            train.eval_batches=8 train.sample_every=0 train.save_every=$steps log.progress=false \
            > "$out/nsa-quality-$kind.log" 2>&1 &
    done
    wait
    uptime
    grep -h "validation" "$out"/nsa-quality-*.log
fi
