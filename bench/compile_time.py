"""What compiled decoding costs before its first token, and what it saves after: for each kind of
compiled step, processes one after another (each a fresh interpreter, as every `attnlab sample
--compile` is) that share one inductor cache directory, new for the variant, so the first process
finds nothing cached and the later ones find what the first stored. Each process loads a run,
calls compile_decoding, and reports the seconds of its first `generate` of 8 tokens (compiling
included) and then the median ms per token of 128-token generations, with inductor's graph-cache
counts (hit, miss, bypass).

Variants: `packed` (compile_decoding's CPU defaults: C++ wrapper, weights frozen and packed for
inductor's GEMM template), `library` (linear="library": the weights stay inputs, ATen's products),
`library-python` (and the Python wrapper: cpp_wrapper=False).

    OMP_NUM_THREADS=2 python bench/compile_time.py RUN [--variants packed library library-python]
        [--processes 2] [--new-tokens 128] [--rounds 5] [--backend inductor]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {  # compile_decoding's arguments
    "packed": {}, "library": {"linear": "library"}, "library-python": {"linear": "library", "cpp_wrapper": False},
}


def child(run: str, variant: str, new_tokens: int, rounds: int, backend: str) -> dict:
    """One process's figures (this runs in the child)."""
    import torch
    from torch._dynamo.utils import counters

    from attnlab.generate.sampling import generate
    from attnlab.train.checkpoint import load_model

    model = load_model(run).eval()
    options = VARIANTS[variant] if backend == "inductor" else {}
    model.compile_decoding(backend=backend, **options)
    prompt = torch.tensor([list(b"def main():\n    return ")])  # [1, T]
    started = time.perf_counter()
    generate(model, prompt, 8, compile=True)
    first = time.perf_counter() - started
    per_token = []
    for _ in range(rounds):
        started = time.perf_counter()
        generate(model, prompt, new_tokens, compile=True)
        per_token.append((time.perf_counter() - started) / new_tokens * 1e3)
    graph_cache = {key.removeprefix("fxgraph_cache_"): value for key, value in counters["inductor"].items()
                   if key.startswith("fxgraph_cache_")}
    return {"first_generate_s": first, "ms_per_token": statistics.median(per_token), "graph_cache": graph_cache}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backend", default="inductor", help="torch.compile's (aot_eager: a quick check)")
    parser.add_argument("--child", metavar="VARIANT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.run, args.child, args.new_tokens, args.rounds, args.backend)))
        return
    rows = []
    for variant in args.variants:
        with tempfile.TemporaryDirectory(prefix="attnlab-compile-time-") as cache:
            for process in range(1, args.processes + 1):
                command = [sys.executable, __file__, args.run, "--child", variant, "--new-tokens", str(args.new_tokens),
                           "--rounds", str(args.rounds), "--backend", args.backend]
                output = subprocess.run(command, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}, check=True,
                                        capture_output=True, text=True).stdout
                row = {"variant": variant, "process": process, **json.loads(output.splitlines()[-1])}
                print(json.dumps(row), flush=True)
                rows.append(row)
    print("\n| step | process | first generate (s) | ms/token | graph cache |\n|---|---:|---:|---:|---|")
    for row in rows:
        cache = ", ".join(f"{key} {value}" for key, value in row["graph_cache"].items()) or "-"
        print(f"| {row['variant']} | {row['process']} | {row['first_generate_s']:.1f} | {row['ms_per_token']:.2f} | "
              f"{cache} |")


if __name__ == "__main__":
    main()
