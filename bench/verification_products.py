"""The target's two compiled forwards of speculative decoding, a one-token step and a verification
of gamma + 1 tokens (Transformer.decode_then with the acceptance rule, as the loop calls it), with
compile_decoding's CPU default (linear kernels "cpu": attnlab's operator over weights packed once,
model/linear_cpu.py) and with `--against` (`packed`: inductor's C++ template over the packed
weights; `library`: ATen's calls; `separate-products`: the default, but a layer's queries, keys and
values made by three products instead of one over their weights concatenated;
`parallel-elementwise`: the default step with its elementwise loops on every thread as inductor
decides, compile_decoding(elementwise="parallel")), side by side in one process, at each batch size.

Each forward is timed warm (a cache filled with `--context` tokens once, then `--repeats` calls, the
cache rolled back after each, untimed), the two models in turn, round after round; the figure is the
median over rounds of each round's default / other ratio (below 1: the default is faster). The
shapes are spec-small-target's (dim 256, depth 6; weights as initialised: a forward's cost does not
depend on them).

    OMP_NUM_THREADS=2 python bench/verification_products.py [--batch-size 1 4] [--rounds 11] [--dtype bfloat16] \
        [--against packed]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from compiled_decoding import separate_products  # this folder's
from compiled_speculative_costs import timed_call, warm_ms  # this folder's: the same calls, timed alike

from attnlab.cli import arguments  # the decoding commands' --dtype names (bf16 too)
from attnlab.config import load_config
from attnlab.model import Transformer

AGAINST = ("packed", "library", "separate-products", "parallel-elementwise")
KINDS = ("target token", "verification")  # compiled_speculative_costs.timed_call's: a one-token step, a verification


def build(variant: str, dtype: torch.dtype) -> Transformer:
    """variant: "default" (compile_decoding's CPU default) or one of AGAINST."""
    torch.manual_seed(0)
    model = Transformer(load_config("spec-small-target").model).to(dtype).eval()
    if variant == "separate-products":
        with separate_products():
            model.compile_decoding()
    elif variant == "parallel-elementwise":
        model.compile_decoding(elementwise="parallel")
    elif variant == "default":
        model.compile_decoding()
    else:
        model.compile_decoding(linear=variant)
    return model


def measure(batch: int, context: int, rounds: int, repeats: int, gamma: int, dtype: torch.dtype,
            against: str) -> dict:
    variants = ("default", against)
    models = {variant: build(variant, dtype) for variant in variants}
    prompt = torch.randint(0, 256, (batch, context), generator=torch.Generator().manual_seed(0))
    times = {(variant, kind): [] for variant in variants for kind in KINDS}
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
    other = against.replace("-", "_")
    for kind in KINDS:
        ratios = [default / slower for default, slower in zip(times["default", kind], times[against, kind])]
        report[kind] = {"default_ms": statistics.median(times["default", kind]),
                        f"{other}_ms": statistics.median(times[against, kind]),
                        f"default_over_{other}": statistics.median(ratios)}
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
    parser.add_argument("--against", choices=AGAINST, default="packed")
    args = parser.parse_args()
    other = args.against.replace("-", "_")
    for batch in args.batch_size:
        report = measure(batch, args.context, args.rounds, args.repeats, args.gamma, getattr(torch, args.dtype),
                         args.against)
        print(json.dumps(report), flush=True)
        for kind in KINDS:
            part = report[kind]
            print(f"batch {batch} {kind}: default {part['default_ms']:.2f} ms, {args.against} "
                  f"{part[f'{other}_ms']:.2f} ms, default / {args.against} {part[f'default_over_{other}']:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
