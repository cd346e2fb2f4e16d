"""The kernels of an int8 product (model/quantize.py's PRODUCTS: attnlab's `cpu` operator, torch's
int8 weight-only kernel, the dequantized weight's float product) side by side in one process, and
what each makes of a compiled draft's proposal.

1. Each product of one Int8Linear at the CPU draft's weight shapes (spec-small-draft: dim 256,
   feed-forward 1024; weights random), for a few rows of activations (1: a decoded token, 4: a
   batch of four, 6: a verification window), eager, the kernels taking turns round after round;
   medians in microseconds.
2. The draft's proposal of gamma tokens (Transformer.draw: one token fed, gamma drawn, as
   speculative decoding calls it) with int8 weights, compiled (compile_decoding), once per product
   (`cpu` and `torch`: the ones a decode step takes) and per `--linear` (compile_decoding's:
   packed, the CPU default, the int8 weights frozen into the step, where inductor makes torch's
   kernel in its own template; library, the weights read at each step, the int8 kernels called as
   they are eager), the models taking turns; medians in ms.

    OMP_NUM_THREADS=2 python bench/int8_products.py [--rows 1 4 6] [--rounds 9] [--batch-size 1] \
        [--linear packed library]

One JSON line per shape and row count, one per compiled proposal (LINEAR/PRODUCT), then each
proposal's time over the first one's, per round.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from small_gemm import median_microseconds  # this folder's
from torch import nn

from attnlab.config import load_config
from attnlab.generate.sampling import SamplingConfig
from attnlab.model import Transformer
from attnlab.model.quantize import PRODUCTS, Int8Linear, choose_products, quantize_weights

SHAPES = {"query, key, value, output, head": (256, 256), "feed-forward up": (1024, 256),
          "feed-forward down": (256, 1024)}  # (out features, in features)
COMPILED_PRODUCTS = ("cpu", "torch")


def products(rows_list: list[int], rounds: int, repeats: int) -> None:
    torch.manual_seed(0)
    for name, (out_features, in_features) in SHAPES.items():
        layer = Int8Linear.from_linear(nn.Linear(in_features, out_features))
        for rows in rows_list:
            x = torch.randn(rows, in_features)
            times = {product: [] for product in PRODUCTS}
            for _ in range(rounds):
                for product in PRODUCTS:
                    call = lambda product=product, layer=layer, x=x: layer(x, product=product)  # noqa: E731
                    times[product].append(median_microseconds(call, repeats))
            microseconds = {product: round(statistics.median(values), 1) for product, values in times.items()}
            print(json.dumps({"weight": name, "shape": [out_features, in_features], "rows": rows,
                              "threads": torch.get_num_threads(), "microseconds": microseconds}), flush=True)


def proposals(batch: int, gamma: int, context: int, rounds: int, repeats: int, linears: list[str],
              backend: str = "inductor") -> None:
    calls = {}
    for linear in linears:
        for product in COMPILED_PRODUCTS:
            torch.manual_seed(0)
            # made and compiled outside inference mode: a packed step packs its weights as a
            # decoding's does (Transformer.compile_decoding's packed kernels, the CPU default)
            draft = Transformer(load_config("spec-small-draft").model).eval()
            quantize_weights(draft, "int8")
            choose_products(draft, product)
            draft.compile_decoding(backend=backend, linear=linear)
            calls[f"{linear}/{product}"] = proposal_call(draft, batch, gamma, context)
    times = {name: [] for name in calls}
    with torch.inference_mode():
        for round_ in range(rounds + 1):  # round 0 warms up: the graphs are made there
            for name, call in calls.items():
                elapsed = median_microseconds(call, repeats)
                if round_:
                    times[name].append(elapsed / 1e3)  # ms
    for name, values in times.items():
        linear, product = name.split("/")
        print(json.dumps({"proposal": product, "linear": linear, "batch_size": batch, "gamma": gamma,
                          "context": context, "threads": torch.get_num_threads(),
                          "median_ms": round(statistics.median(values), 4)}), flush=True)
    first = next(iter(times))
    for name, values in list(times.items())[1:]:  # each against the first, round by round
        ratios = [round(other / reference, 3) for reference, other in zip(times[first], values)]
        print(json.dumps({"proposal_ratio": f"{name} / {first}", "median": statistics.median(ratios),
                          "rounds": ratios}), flush=True)


def proposal_call(draft: Transformer, batch: int, gamma: int, context: int):
    """A call of the draft's proposal after `context` tokens, then its rollback (timed with it: a few
    host operations)."""
    with torch.inference_mode():
        cache = draft.new_cache(batch, context + 2 * (gamma + 1))
        draft(torch.randint(0, 256, (batch, context)), cache=cache)
    tokens, uniforms = torch.randint(0, 256, (batch, 1)), torch.rand(batch, gamma)
    no_tokens = torch.zeros(batch, gamma, dtype=torch.long)
    no_known = torch.zeros(batch, gamma, dtype=torch.bool)

    def call():
        draft.draw(tokens, cache, uniforms, SamplingConfig(), no_tokens, no_known)
        cache.truncate(context)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 4, 6], help="rows of the eager products (none: "
                        "only the compiled proposals)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--linear", choices=("packed", "library"), nargs="+", default=["packed"],
                        help="the compiled step's products (compile_decoding's linear): each, with each int8 product")
    parser.add_argument("--backend", default="inductor", help="torch.compile back-end (aot_eager, with --linear "
                        "library: a quick check of the script)")
    args = parser.parse_args()
    with torch.inference_mode():
        products(args.rows, args.rounds, args.repeats)
    proposals(args.batch_size, args.gamma, args.context, args.rounds, args.repeats, args.linear, args.backend)


if __name__ == "__main__":
    main()
