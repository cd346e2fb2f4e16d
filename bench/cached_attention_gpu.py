"""Full attention's call through a cache on a GPU, as a decode step or a speculative verification
makes it: the triton back-end's kernels (kernels/decode_triton.py, which read only the positions
each query sees) against the torch back-end (torch's attention over the cache's whole storage with
the mask, the mask made as the cache makes it), over a storage as long as the text and over one
twice as long (a compiled model's caches are a power of two long, so up to twice the text:
transformer.decode_capacity). bf16 keys, values and queries; microseconds a call, the median of
`--repeats` timings of `--calls` calls each, both back-ends timed in turn in one process: launched
one by one from Python, and on CUDA also replayed from a CUDA graph of the calls, as a compiled
decode step runs them (no launch cost: the kernels' own time).

    python bench/cached_attention_gpu.py --out docs/bench/gpu        # bench/gpu.sh cached

Writes cached_attention.jsonl and cached_attention.md in --out. On a CPU (`--device cpu`, small
sizes, TRITON_INTERPRET=1 for the triton kernels) it is a dry run of the script itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from attnlab.attention.base import masked_attention
from attnlab.attention.full import FullCache
from attnlab.attention.kernels import decode_triton
from attnlab.bench.measure import DTYPES, environment


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_microseconds(function, device: torch.device, calls: int, repeats: int) -> float:
    """The median over repeats of one call's mean time in a run of `calls` calls (after one warm run)."""
    timings = []
    for _ in range(repeats + 1):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(calls):
            function()
        synchronize(device)
        timings.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(timings[1:])


def graphed_microseconds(function, calls: int, repeats: int) -> float:
    """One call's time replayed from a CUDA graph of `calls` calls (median of `repeats` replays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture (triton compiles, allocator settles)
        for _ in range(3):
            function()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            function()
    return call_microseconds(graph.replay, torch.device("cuda"), 1, repeats) / calls


def case(args, batch: int, queries: int, context: int, storage: int, device: torch.device) -> dict:
    """Both back-ends' time for one shape: queries at the last `queries` positions of `context`."""
    dtype = DTYPES[args.dtype]
    lengths = torch.full((batch,), context - queries, device=device)
    cache = FullCache(lengths, storage, args.kv_heads, args.dim_head, dtype)
    cache.keys.normal_()
    cache.values.normal_()
    q = torch.randn(batch, args.heads, queries, args.dim_head, device=device, dtype=dtype)
    positions = cache.positions(queries)  # [B, T]
    backends = {
        "torch": lambda: masked_attention(q, cache.keys, cache.values, cache.visible(positions)),
        "triton": lambda: decode_triton.cached_attention(q, cache.keys, cache.values, positions),
    }
    with torch.inference_mode():
        difference = (backends["triton"]().float() - backends["torch"]().float()).abs().max().item()
        times = {name: call_microseconds(function, device, args.calls, args.repeats)
                 for name, function in backends.items()}
        graphed = {}
        if device.type == "cuda":
            for name, function in backends.items():
                try:
                    graphed[f"{name}_graphed_us"] = graphed_microseconds(function, args.calls, args.repeats)
                except Exception as error:  # noqa: BLE001 - the launched figures stand; the row says why
                    graphed[f"{name}_graphed_error"] = f"{type(error).__name__}: {error}"[:200]
    read_mib = 2 * batch * args.kv_heads * context * args.dim_head * cache.keys.element_size() / 2**20
    return {"batch": batch, "queries": queries, "context": context, "storage": storage,
            "torch_us": times["torch"], "triton_us": times["triton"],
            "torch_over_triton": times["torch"] / times["triton"], **graphed, "keys_values_seen_mib": read_mib,
            "max_abs_difference": difference}


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| batch | queries | context | storage | torch (us) | triton (us) | torch / triton "
             "| graphed: torch (us) | triton (us) | torch / triton | keys and values seen (MiB) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "torch_graphed_us" in r and "triton_graphed_us" in r:
            graphed = (f"{r['torch_graphed_us']:.1f} | {r['triton_graphed_us']:.1f} | "
                       f"{r['torch_graphed_us'] / r['triton_graphed_us']:.2f}x")
        else:  # on the CPU, or a capture that failed (its error is in the JSON line)
            graphed = "- | - | -"
        lines.append(f"| {r['batch']} | {r['queries']} | {r['context']} | {r['storage']} | {r['torch_us']:.1f} | "
                     f"{r['triton_us']:.1f} | {r['torch_over_triton']:.2f}x | {graphed} | "
                     f"{r['keys_values_seen_mib']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 6], help="1: a decode step; 6: a verification")
    parser.add_argument("--storage-factors", type=float, nargs="+", default=[1.0, 2.0],
                        help="the storage's length over the context's")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim-head", type=int, default=128)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    info = environment(device, args.dtype)
    rows = []
    with (args.out / "cached_attention.jsonl").open("a") as log:
        for batch in args.batch_sizes:
            for queries in args.queries:
                for context in args.contexts:
                    for factor in args.storage_factors:
                        row = case(args, batch, queries, context, int(context * factor), device)
                        rows.append(row)
                        log.write(json.dumps({**row, **info}) + "\n")
                        print(json.dumps(row), flush=True)
    header = (f"Machine: {info.get('gpu', info['machine'])}, torch {info.get('torch')}, {args.dtype}; "
              f"{args.heads} query heads of {args.dim_head} over {args.kv_heads} key/value heads; medians of "
              f"{args.repeats} runs of {args.calls} calls.")
    table = markdown(rows, header)
    (args.out / "cached_attention.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
