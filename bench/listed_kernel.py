"""The `cpu` back-end's listed-key kernel (attention/kernels/listed_cpu.py) against the reference
paths of the variant files, on the attention core alone: routed attention (clusters) and sinkhorn's bucket attention
(chosen buckets + own), forward + backward, the two paths interleaved in one process, medians.

    OMP_NUM_THREADS=2 python bench/listed_kernel.py --seq-len 4096 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnlab.attention import routing, sinkhorn
from attnlab.attention.kernels.listed_cpu import bucket_attention_cpu, routed_attention_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim-head", type=int, default=64)
    parser.add_argument("--window", type=int, default=64, help="routing window and sinkhorn bucket size")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.manual_seed(0)
    shape = (1, args.heads, args.seq_len, args.dim_head)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape)
    clusters = torch.randint(0, args.seq_len // args.window, shape[:3])
    means = [sinkhorn.bucket_means(x.detach(), args.window) for x in (q, k)]
    chosen, weights = sinkhorn.sort_buckets(*means, 1, 5, 0.75, gumbel=False)
    weights.requires_grad_()

    def routed(path: str) -> None:
        if path == "kernel":
            y = routed_attention_cpu(q, k, v, clusters, args.window)[0]
        else:
            y = routing.routed_attention(q, k, v, clusters, args.window)
        torch.autograd.grad(y, (q, k, v), grad)

    def bucketed(path: str) -> None:  # what SinkhornAttention._sorted runs for a whole sequence
        if path == "kernel":
            y = bucket_attention_cpu(q, k, v, chosen, weights, args.window)[0]
        else:
            y = sinkhorn.bucket_attention(q, k, v, chosen, weights, args.window)
        torch.autograd.grad(y, (q, k, v, weights), grad)

    paths = ("kernel", "torch")
    times = {(name, path): [] for name in ("routing", "sinkhorn") for path in paths}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, function in (("routing", routed), ("sinkhorn", bucketed)):
            for path in paths:
                started = time.perf_counter()
                function(path)
                if round_:
                    times[name, path].append(time.perf_counter() - started)
    print(f"seq_len {args.seq_len}, heads {args.heads}, dim_head {args.dim_head}, window/bucket {args.window}, "
          f"{torch.get_num_threads()} threads, forward + backward, median of {args.rounds}")
    print()
    print("| attention core | kernel (ms) | reference (ms) | speed-up |")
    print("|---|---:|---:|---:|")
    for name in ("routing", "sinkhorn"):
        kernel, plain = (statistics.median(times[name, path]) * 1e3 for path in paths)
        print(f"| {name} | {kernel:.1f} | {plain:.1f} | {plain / kernel:.2f}x |")


if __name__ == "__main__":
    main()
