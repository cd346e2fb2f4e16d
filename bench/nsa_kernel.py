"""The NSA `cpu` back-end (attention/kernels/nsa_cpu.py) against the reference path, branch by branch
on one layer's attention cores (no projections, no compressor): the compressed branch with the
block selection, the selected branch and the sliding branch, forward and backward timed
separately, the two paths interleaved in one process, medians.

    OMP_NUM_THREADS=2 python bench/nsa_kernel.py --seq-len 4096 --rounds 9
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from attnlab.attention import nsa
from attnlab.attention.base import AttentionSpec
from attnlab.config import NSAAttentionConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim-head", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    config = NSAAttentionConfig(sliding_window_size=64, compress_block_size=16, compress_stride=8,
                                selection_block_size=16, num_selected=4)
    spec = AttentionSpec(dim=args.heads * args.dim_head, n_heads=args.heads, dim_head=args.dim_head,
                         n_kv_heads=args.kv_heads, dropout=0.0, max_seq_len=args.seq_len, layer_index=0, n_layers=1,
                         rotary=None)
    layers = {path: nsa.NativeSparseAttention(spec, dataclasses.replace(config, backend=backend))
              for path, backend in (("kernel", "cpu"), ("torch", "torch"))}
    torch.manual_seed(0)
    n_tokens, n_groups = args.seq_len, args.kv_heads
    n_blocks = nsa.n_complete_blocks(n_tokens, config.compress_block_size, config.compress_stride)
    q = torch.randn(1, args.heads, n_tokens, args.dim_head, requires_grad=True)
    k, v = (torch.randn(1, n_groups, n_tokens, args.dim_head, requires_grad=True) for _ in range(2))
    keys, values = (torch.randn(1, n_groups, 1 + n_blocks, args.dim_head, requires_grad=True) for _ in range(2))
    positions = torch.arange(n_tokens)

    with torch.no_grad():  # the selection both paths' selected branch reads
        _, indices, valid, _ = nsa.compressed_branch(q, keys, values, positions, 0, config)
    branches = {  # NativeSparseAttention.forward's branches of a whole sequence, on each layer's back-end
        "compressed + selection": (lambda layer: layer._compressed(q, keys, values, positions, False)[0],
                                   (q, keys, values)),
        "selected": (lambda layer: layer._selected(q, k, v, indices, valid, None, positions), (q, k, v)),
        "sliding": (lambda layer: layer._sliding(q, k, v), (q, k, v)),
    }
    paths = ("kernel", "torch")
    times = {(name, path, part): [] for name in branches for path in paths for part in ("forward", "backward")}
    grad = torch.randn(q.shape)
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, (function, inputs) in branches.items():
            for path in paths:
                started = time.perf_counter()
                y = function(layers[path])
                middle = time.perf_counter()
                torch.autograd.grad(y, inputs, grad)
                if round_:
                    times[name, path, "forward"].append(middle - started)
                    times[name, path, "backward"].append(time.perf_counter() - middle)
    print(f"seq_len {n_tokens}, heads {args.heads}, kv_heads {n_groups}, dim_head {args.dim_head}, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} (ms)")
    print()
    print("| branch | kernel forward | reference forward | kernel backward | reference backward "
          "| forward + backward speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in branches:
        median = {(path, part): statistics.median(times[name, path, part]) * 1e3
                  for path in paths for part in ("forward", "backward")}
        kernel = median["kernel", "forward"] + median["kernel", "backward"]
        plain = median["torch", "forward"] + median["torch", "backward"]
        print(f"| {name} | {median['kernel', 'forward']:.1f} | {median['torch', 'forward']:.1f} | "
              f"{median['kernel', 'backward']:.1f} | {median['torch', 'backward']:.1f} | {plain / kernel:.2f}x |")


if __name__ == "__main__":
    main()
