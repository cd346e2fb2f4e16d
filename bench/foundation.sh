#!/usr/bin/env bash
# The foundation benchmarks of docs/benchmarks.md: decode latency with and without the cache, and
# training throughput/memory of full vs local attention (dim 256, depth 4, heads 4, 2 threads, CPU).
# Writes JSON lines and markdown tables to docs/bench/. Run on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench
mkdir -p "$out"
export OMP_NUM_THREADS=2
attnlab bench decode --attention full local --set attention.local.window_size=64 \
    --context 64 256 1024 --new-tokens 32 --out "$out/decode.jsonl" --markdown "$out/decode.md"
attnlab bench train --attention full local --set attention.local.window_size=64 \
    --seq-len 512 1024 2048 4096 --steps 5 --warmup 2 --out "$out/train.jsonl" --markdown "$out/train.md"
