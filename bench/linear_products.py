"""One weight product y = x W^T of a few rows, in the two layouts of attnlab.model.linear:
F.linear(x, W) and the column product (W x^T)^T that attnlab's Linear takes when decoding on a
CPU. A pool of distinct weights of --pool-mb megabytes is cycled through, as decoding cycles
through a model's weights: a pool far larger than the caches (the default, 40 MB) makes every
product read its weight from memory, a small one from the caches. The layouts alternate within
every round; medians in microseconds per product, one JSON line per pool, weight shape and row
count.

    python bench/linear_products.py [--rows 1 2 4 6 12 24 32] [--pool-mb 40] [--rounds 15] [--dim 256]
        [--ff-mult 4] [--row-major-columns]

--row-major-columns adds a third product, torch.mm(W, x^T) with x^T stored row-major (the rows of
x strided): what the column product cost before it made the rows of x contiguous, for inputs that
arrive as the transposed result of another column product (the feed-forward's down projection).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from attnlab.model.linear import column_product


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 6, 12, 24, 32])
    parser.add_argument("--pool-mb", type=float, nargs="+", default=[40.0],
                        help="megabytes of distinct weights cycled through (the working set)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--ff-mult", type=int, default=4)
    parser.add_argument("--row-major-columns", action="store_true",
                        help="also time W x^T with x^T row-major (the module docstring)")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    hidden = args.ff_mult * args.dim
    products = {"linear": lambda x, weight: F.linear(x, weight), "columns": column_product}
    if args.row_major_columns:  # x^T copied once per row count, outside the timing
        products["row_major_columns"] = lambda x, weight: torch.mm(weight, row_major).T
    with torch.inference_mode():
        for pool_mb in args.pool_mb:
            for shape in ((args.dim, args.dim), (hidden, args.dim), (args.dim, hidden)):  # attention, up, down
                n_weights = max(1, int(pool_mb * 2**20 / (4 * shape[0] * shape[1])))
                passes = max(1, 64 // n_weights)  # at least 64 products per round
                weights = [torch.randn(shape, generator=generator) for _ in range(n_weights)]
                for rows in args.rows:
                    x = torch.randn(rows, shape[1], generator=generator)
                    row_major = x.T.contiguous()  # [K, N] row-major, for row_major_columns
                    torch.testing.assert_close(column_product(x, weights[0]), F.linear(x, weights[0]),
                                               rtol=1e-4, atol=1e-4)
                    times = {name: [] for name in products}
                    for _ in range(args.rounds):
                        for name, product in products.items():
                            started = time.perf_counter()
                            for _ in range(passes):
                                for weight in weights:
                                    product(x, weight)
                            times[name].append((time.perf_counter() - started) / (passes * n_weights))
                    medians = {f"{name}_us": round(1e6 * statistics.median(values), 1)
                               for name, values in times.items()}
                    print(json.dumps({"pool_mb": pool_mb, "weight": list(shape), "rows": rows,
                                      "threads": torch.get_num_threads(), **medians,
                                      "linear_over_columns": round(medians["linear_us"] / medians["columns_us"], 2)}),
                          flush=True)

if __name__ == "__main__":
    main()
