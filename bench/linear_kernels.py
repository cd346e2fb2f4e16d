"""One float32 product with a weight, by each of compile_decoding's CPU linear kernels, side by side
in one process: attnlab's operator over its own packing (`cpu`, model/linear_cpu.py), inductor's
C++ GEMM template over its packing (`packed`: a compiled Linear with frozen weights, the call's
overhead included) and ATen's call (`library`: the BLAS). For each shape M x N x K (rows, outputs,
input width), the median over rounds of each kernel's median time per call, and its arithmetic
rate. The weight is the same each call, so it stays in cache where it fits: these are the kernels'
rates, not a decode step's (bench/verification_products.py times the steps).

    OMP_NUM_THREADS=2 python bench/linear_kernels.py [--shapes 24x1024x256 6x4096x4096] [--rounds 3]

Prints one JSON line per shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch._inductor import config as inductor_config

from attnlab.model import linear_cpu
from attnlab.model.decode_compile import packed_linear_options

SHAPES = ("6x1024x256", "24x1024x256", "6x4096x4096", "24x4096x4096", "24x1024x4096", "96x4096x1024")


def median_us(call, calls: int, repeats: int = 7) -> float:
    """Median over `repeats` of the mean microseconds of `calls` calls."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(times)


def kernels(rows: int, outputs: int, width: int) -> dict:
    """name -> a call of that kernel on x [rows, width] and one weight [outputs, width]."""
    layer = torch.nn.Linear(width, outputs, bias=False).eval().requires_grad_(False)
    x = torch.randn(rows, width)
    packed = linear_cpu.pack(layer.weight)
    options = {**packed_linear_options(), "cpp_wrapper": True}
    with torch.no_grad(), inductor_config.patch(freezing=True):  # the weight a constant only while freezing
        template = torch.compile(layer, fullgraph=True, dynamic=False, options=options)
        template(x)
    return {"cpu": lambda: linear_cpu.linear(x, packed, None, outputs), "packed": lambda: template(x),
            "library": lambda: layer(x)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="MxNxK: rows x outputs x input width")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not linear_cpu.available():
        raise SystemExit("attnlab's float32 operator is not built here")
    for shape in args.shapes:
        rows, outputs, width = (int(size) for size in shape.split("x"))
        calls = kernels(rows, outputs, width)
        flops = 2 * rows * outputs * width
        repeats = max(5, min(2000, int(2e9 / flops)))  # about a second of arithmetic, at most 2000 calls
        times = {name: [] for name in calls}
        with torch.no_grad():
            for _ in range(args.rounds):  # the kernels in turn, round after round
                for name, call in calls.items():
                    times[name].append(median_us(call, repeats))
        report = {"shape": shape, "threads": torch.get_num_threads()}
        for name, measured in times.items():
            us = statistics.median(measured)
            # three significant figures: a toy shape's rate is well under 0.1 GFLOP/s
            report[name] = {"us": float(f"{us:.3g}"), "gflops": float(f"{flops / us / 1e3:.3g}")}
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
