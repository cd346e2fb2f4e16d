"""What a speculative verification's matrix products cost against a one-token step's, on this CPU:
torch's linear layer (the BLAS behind it) at the weight shapes of the CPU pair's target
(spec-small-target: dim 256, feed-forward 1024, 256 tokens, the fused query/key/value projection)
for 1 row (a decoded token) and for gamma + 1 rows (a verification window), side by side in one
process, medians. A product of a few rows reads its weights once, as one row's does: where it costs
much more than one row's, the verification costs more than a token for that reason alone, and the
speculative speed-up is bounded below what the draft's acceptance alone would give.

    OMP_NUM_THREADS=2 python bench/small_gemm.py [--rows 1 6] [--repeats 300] [--attainable-size 2048]

Prints one JSON line per weight shape: microseconds per product for each row count, the ratio of
the largest row count's to one row's, the weights' bytes read per microsecond (GB/s) at one row and
the arithmetic rate (GFLOP/s) at the most rows; then one line with the rate of a large square
product (`--attainable-size`, the library at its best on this CPU: what a compute-bound product of
many rows can reach here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"query/key/value": (768, 256), "output": (256, 256), "feed-forward up": (1024, 256),
          "feed-forward down": (256, 1024), "head": (256, 256)}  # (out features, in features)


def median_microseconds(function, repeats: int) -> float:
    for _ in range(20):  # warm: the weights in cache, the library's paths chosen
        function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 6])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--attainable-size", type=int, default=2048)
    args = parser.parse_args()
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, (out_features, in_features) in SHAPES.items():
            weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
            microseconds = {}
            for rows in args.rows:
                x = torch.randn(rows, in_features)
                microseconds[rows] = median_microseconds(lambda x=x, w=weight, b=bias: F.linear(x, w, b), args.repeats)
            one, most = microseconds[min(args.rows)], microseconds[max(args.rows)]
            print(json.dumps({"weight": name, "shape": [out_features, in_features], "threads": torch.get_num_threads(),
                              "microseconds": {str(rows): round(value, 1) for rows, value in microseconds.items()},
                              "most_over_fewest_rows": round(most / one, 2),
                              "gb_per_s_fewest_rows": round(weight.numel() * 4 / one / 1e3, 1),
                              "gflop_per_s_most_rows": round(2 * max(args.rows) * weight.numel() / most / 1e3, 1)}),
                  flush=True)
        size = args.attainable_size
        a, b = torch.randn(size, size), torch.randn(size, size)
        microseconds = median_microseconds(lambda: a @ b, max(5, args.repeats // 50))
        print(json.dumps({"attainable": [size, size, size], "threads": torch.get_num_threads(),
                          "gflop_per_s": round(2 * size**3 / microseconds / 1e3, 1)}), flush=True)


if __name__ == "__main__":
    main()
