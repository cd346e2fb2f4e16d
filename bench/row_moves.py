"""Moving rows of a [B, H, T, D] tensor: an element-wise gather / scatter-add with an index expanded
over D, against whole-row index_select / index_add_ on a [rows, D] view (what routing and sinkhorn
attention use, attention/gathered.py). Medians of repeated calls, in one process.

    OMP_NUM_THREADS=2 python bench/row_moves.py [--rows 6144] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def median_ms(function, repeats: int) -> float:
    function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=6144, help="rows picked per head")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, args.heads, args.tokens, 64, generator=generator)
    index = torch.randint(0, args.tokens, (1, args.heads, args.rows), generator=generator)
    rows = (index + torch.arange(args.heads)[None, :, None] * args.tokens).flatten()
    flat = x.view(-1, 64)
    grads = torch.randn(rows.numel(), 64, generator=generator)
    expanded = index[..., None].expand(-1, -1, -1, 64)
    results = {
        "gather": median_ms(lambda: x.gather(2, expanded), args.repeats),
        "index_select": median_ms(lambda: flat.index_select(0, rows), args.repeats),
        "scatter_add": median_ms(
            lambda: torch.zeros_like(x).scatter_add_(2, expanded, grads.view(1, args.heads, args.rows, 64)),
            args.repeats),
        "index_add": median_ms(lambda: torch.zeros_like(flat).index_add_(0, rows, grads), args.repeats),
    }
    print(f"{rows.numel()} rows of 64 floats, {torch.get_num_threads()} threads, median of {args.repeats}")
    for name, ms in results.items():
        print(f"{name:>12}: {ms:.3f} ms")


if __name__ == "__main__":
    main()
