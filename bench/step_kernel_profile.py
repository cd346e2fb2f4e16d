"""Where a compiled decode step of the CPU pair's target goes, kernel by kernel: the one-token step
and the verification of gamma + 1 tokens (spec-small-target's shapes, weights as initialised),
under torch's profiler with inductor's kernel profile on (each generated C++ kernel recorded by
name beside the library calls it makes, such as torch's fused attention).

The cache holds `--context` tokens in a storage of `--capacity` (speculative_generate's is the
prompt, the new tokens and two windows: 128 + 256 + 12 = 396 for the benchmark's settings, which a
compiled model rounds up to 512). Prints the median time of each step unprofiled, then for each the
share of the attention's call and of the products (the GEMM template's kernels, attnlab's operator
or ATen's calls), the products' arithmetic rate (each row multiplies every weight of the model's
Linear layers, in the products' share of the unprofiled median), and the profiler's table. The
profiler adds its own cost to every kernel: compare shares, not times. bench/small_gemm.py prints
the rate a large product attains on the machine (its `attainable` line).

    OMP_NUM_THREADS=2 python bench/step_kernel_profile.py [--batch-size 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from attnlab.cli import arguments  # the decoding commands' --dtype names (bf16 too)
from attnlab.config import load_config
from attnlab.model import Transformer

ATTENTION_CALLS = ("scaled_dot_product", "cached_attention_cpu")  # torch's fused attention, kernels/decode_cpu.py
# the products: inductor's GEMM template kernels, attnlab's operator (model/linear_cpu.py), ATen's calls
PRODUCT_CALLS = ("_gemm_", "attnlab::linear_cpu", "aten::mm", "aten::addmm", "mkl_linear")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--dtype", type=arguments.dtype, default="float32")
    parser.add_argument("--rows", type=int, default=15, help="rows of each profiler table")
    parser.add_argument("--backend", default="inductor", help="torch.compile's (aot_eager: no generated kernels)")
    args = parser.parse_args()
    inductor_config.cpp.enable_kernel_profile = True
    torch.manual_seed(0)
    model = Transformer(load_config("spec-small-target").model).to(getattr(torch, args.dtype)).eval()
    # multiply-adds of the products per row of a step: every weight of the Linear layers once
    multiply_adds = sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))
    model.compile_decoding(backend=args.backend)
    tokens = torch.randint(0, 256, (args.batch_size, args.context + args.gamma + 1))
    widths = {"one token": 1, "verification": args.gamma + 1}
    with torch.inference_mode():
        cache = model.new_cache(args.batch_size, args.capacity)
        model(tokens[:, : args.context], cache=cache)

        def call(width: int) -> None:
            model(tokens[:, args.context : args.context + width], cache=cache)
            cache.truncate(args.context)

        for _ in range(5):  # the graphs are made here
            for width in widths.values():
                call(width)
        for name, width in widths.items():
            times = []
            for _ in range(args.calls):
                started = time.perf_counter()
                call(width)
                times.append(time.perf_counter() - started)
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                for _ in range(args.calls):
                    call(width)
            events = profiler.key_averages()
            total = sum(event.self_cpu_time_total for event in events)
            # the attention's call, torch's fused attention or the cpu back-end's operator (not a generated
            # kernel fused around it, which carries the op's name too)
            attention = sum(event.self_cpu_time_total for event in events
                            if any(name in event.key for name in ATTENTION_CALLS) and "cpp_fused" not in event.key)
            products = sum(event.self_cpu_time_total for event in events
                           if any(name in event.key for name in PRODUCT_CALLS))
            median = statistics.median(times)
            products_seconds = median * products / total  # a step's, unprofiled
            print(json.dumps({"step": name, "batch_size": args.batch_size, "dtype": args.dtype,
                              "context": args.context, "capacity": args.capacity, "median_ms": median * 1e3,
                              "attention_share": attention / total, "products_share": products / total,
                              "products_gflops": 2 * multiply_adds * args.batch_size * width / products_seconds / 1e9}))
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60),
                  flush=True)


if __name__ == "__main__":
    main()
