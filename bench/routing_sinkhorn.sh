#!/usr/bin/env bash
# Issue 3 figures of docs/benchmarks.md ("Routing and Sinkhorn"): training throughput and peak
# memory at 4096 tokens, decode latency with and without the cache, the share of full attention
# in a training step (the ceiling of any speed-up from sparse attention), and short training runs
# of the *-small presets against full attention. Model: dim 256, depth 4, heads 4, window/bucket
# 64, batch 1, 2 threads, fp32, CPU. Writes JSON lines and tables to docs/bench/routing-sinkhorn/.
# Usage: bench/routing_sinkhorn.sh [train|decode|share|quality|all]   (default all)
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/routing-sinkhorn
mkdir -p "$out"
export OMP_NUM_THREADS=2
attnlab=${ATTNLAB:-.venv/bin/attnlab}
python=${PYTHON:-.venv/bin/python}
sizes="attention.local.window_size=64 attention.routing.window_size=64 attention.sinkhorn.bucket_size=64"
what=${1:-all}

if [[ $what == train || $what == all ]]; then
    # each configuration in a fresh process, one after the other: compare ratios
    uptime
    $attnlab bench train --attention full routing sinkhorn --seq-len 4096 --set $sizes \
        --steps 7 --warmup 3 --out "$out/train.jsonl" --markdown "$out/train.md"
    uptime
fi

if [[ $what == decode || $what == all ]]; then
    uptime
    $attnlab bench decode --attention full routing sinkhorn --context 64 256 1024 --new-tokens 16 --set $sizes \
        --out "$out/decode.jsonl" --markdown "$out/decode.md"
    uptime
fi

if [[ $what == share || $what == all ]]; then
    # full, routing, sinkhorn and a model whose attention core is free, steps interleaved in one process
    uptime
    $python bench/attention_share.py --seq-len 4096 --rounds 5 | tee "$out/share.md"
    uptime
fi

if [[ $what == quality || $what == all ]]; then
    # short runs on the built-in corpus; the same preset with full attention is the reference
    steps=${STEPS:-100}
    runs=${RUNS:-runs/routing-sinkhorn-quality}
    for preset in routing-small sinkhorn-small; do
        for kind in own full; do
            override=()
            [[ $kind == full ]] && override=(model.attention.kind=full)
            OMP_NUM_THREADS=1 $attnlab train -p "$preset" out_dir="$runs" name="$preset-$kind" \
                train.max_steps="$steps" train.batch_size=8 train.eval_every=50 train.eval_batches=8 \
                train.save_every=1000000 log.progress=false "${override[@]}" &
        done
        wait
    done
    $python - "$runs" <<'PY' | tee "$out/quality.md"
import json, sys
from pathlib import Path
runs = Path(sys.argv[1])
print("| preset | attention | step | validation bits per byte | vs full |")
print("|---|---|---:|---:|---:|")
for preset in ("routing-small", "sinkhorn-small"):
    last = {}
    for kind in ("own", "full"):
        records = [json.loads(line) for line in (runs / f"{preset}-{kind}" / "metrics.jsonl").read_text().splitlines()]
        last[kind] = [r for r in records if "val_bpb" in r][-1]
    for kind in ("own", "full"):
        ratio = last[kind]["val_bpb"] / last["full"]["val_bpb"]
        name = preset.split("-")[0] if kind == "own" else "full"
        print(f"| {preset} | {name} | {last[kind]['step']} | {last[kind]['val_bpb']:.4f} | {ratio:.3f} |")
PY
fi
