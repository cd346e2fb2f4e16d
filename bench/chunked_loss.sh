#!/usr/bin/env bash
# Peak training memory and speed with and without model.loss_chunk_size at a 6400-token vocabulary
# (MiniMind's), dim 512, depth 2, batch 8 x 512 tokens. Figures: docs/benchmarks.md.
set -euo pipefail
export OMP_NUM_THREADS=2
uptime
for chunk in 0 1024; do
  attnlab bench train --attention full --dim 512 --depth 2 --heads 8 \
      --set num_tokens=6400 loss_chunk_size=$chunk --seq-len 512 --batch-size 8 --steps 3 --warmup 1
done
uptime
