"""The target's two compiled forwards of speculative decoding, a one-token step and a verification
of gamma + 1 tokens (Transformer.decode_then with the acceptance rule, as the loop calls it), with
each kind of linear kernels of compile_decoding (`packed`: inductor's C++ template over weights
packed once; `library`: ATen's calls), side by side in one process, at each batch size.

Each forward is timed warm (a cache filled with `--context` tokens once, then `--repeats` calls, the
cache rolled back after each, untimed), the two models in turn, round after round; the figure is the
median over rounds of each round's packed / library ratio (below 1: packed is faster). The shapes
are spec-small-target's (dim 256, depth 6; weights as initialised: a forward's cost does not
depend on them).

    OMP_NUM_THREADS=2 python bench/verification_products.py [--batch-size 1 4] [--rounds 11] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from compiled_speculative_costs import timed_call, warm_ms  # this folder's: the same calls, timed alike

from attnlab.cli import arguments  # the decoding commands' --dtype names (bf16 too)
from attnlab.config import load_config
from attnlab.model import Transformer

LINEAR_KERNELS = ("packed", "library")
KINDS = ("target token", "verification")  # compiled_speculative_costs.timed_call's: a one-token step, a verification


def build(linear: str, dtype: torch.dtype) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(load_config("spec-small-target").model).to(dtype).eval()
    model.compile_decoding(linear=linear)
    return model


def measure(batch: int, context: int, rounds: int, repeats: int, gamma: int, dtype: torch.dtype) -> dict:
    models = {linear: build(linear, dtype) for linear in LINEAR_KERNELS}
    prompt = torch.randint(0, 256, (batch, context), generator=torch.Generator().manual_seed(0))
    times = {(linear, kind): [] for linear in LINEAR_KERNELS for kind in KINDS}
    with torch.inference_mode():
        calls = {}
        for linear, model in models.items():
            cache = model.new_cache(batch, context + gamma + 1)
            model(prompt, cache=cache)
            calls[linear] = (cache, {kind: timed_call(model, cache, kind, batch, gamma) for kind in KINDS})
        for round_ in range(rounds + 1):  # round 0 warms up: the compiled forwards are made there
            for linear, (cache, named) in calls.items():
                for kind, call in named.items():
                    elapsed = warm_ms(call, cache, context, repeats)
                    if round_:
                        times[linear, kind].append(elapsed)
    report = {"batch_size": batch, "context": context, "gamma": gamma, "rounds": rounds, "repeats": repeats,
              "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch.")}
    for kind in KINDS:
        ratios = [packed / library for packed, library in zip(times["packed", kind], times["library", kind])]
        report[kind] = {"packed_ms": statistics.median(times["packed", kind]),
                        "library_ms": statistics.median(times["library", kind]),
                        "packed_over_library": statistics.median(ratios)}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--dtype", type=arguments.dtype, default="float32",
                        help="the model's weights and caches")
    args = parser.parse_args()
    for batch in args.batch_size:
        report = measure(batch, args.context, args.rounds, args.repeats, args.gamma, getattr(torch, args.dtype))
        print(json.dumps(report), flush=True)
        for kind in KINDS:
            part = report[kind]
            print(f"batch {batch} {kind}: packed {part['packed_ms']:.2f} ms, library {part['library_ms']:.2f} ms, "
                  f"packed / library {part['packed_over_library']:.3f}", flush=True)


if __name__ == "__main__":
    main()
