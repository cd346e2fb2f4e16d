"""What other compiled models in the same process cost one model's compiled decode step: the step of
a full-attention model (dim 256, depth 4, 4 heads of 64, 256 tokens of context) timed alone, then
again after --others more models (local attention, each with its own cache length) have compiled
their steps. Dynamo looks through every graph kept under a code object at each call; each model's
step has a code object of its own (model/transformer.own_code), so the two figures should match.
The steps multiply through ATen's library calls (compile_decoding(linear="library")), as when the
figures in docs/benchmarks.md were taken.

    OMP_NUM_THREADS=2 python bench/compiled_neighbours.py --others 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from attnlab.bench.measure import model_config_from
from attnlab.model import Transformer

SHAPE = dict(dim=256, depth=4, heads=4, dim_head=64)


def compiled_model(kind: str, max_len: int) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(model_config_from({**SHAPE, "max_seq_len": max_len, "attention": {"kind": kind}})).eval()
    model.compile_decoding(linear="library")
    return model


def median_step_ms(model: Transformer, cache, context: int, repeats: int) -> float:
    token = torch.zeros(1, 1, dtype=torch.long)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        model(token, cache=cache)
        times.append(time.perf_counter() - started)
        cache.truncate(context)  # the same position every time
    return statistics.median(times) * 1e3


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--others", type=int, default=8, help="further compiled models")
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    context = 256
    model = compiled_model("full", context + 128)
    cache = model.new_cache(1, context + 128)
    model(torch.zeros(1, context, dtype=torch.long), cache=cache)
    median_step_ms(model, cache, context, 5)  # compiles
    alone = median_step_ms(model, cache, context, args.repeats)
    others = []
    for index in range(args.others):
        other = compiled_model("local", 64 + 16 * index)
        other_cache = other.new_cache(1, 64 + 16 * index)
        other(torch.zeros(1, 8, dtype=torch.long), cache=other_cache)
        median_step_ms(other, other_cache, 8, 3)  # compiles its step
        others.append((other, other_cache))
    median_step_ms(model, cache, context, 5)
    beside = median_step_ms(model, cache, context, args.repeats)
    print(json.dumps({"threads": torch.get_num_threads(), "others": args.others, "alone_ms": alone,
                      "beside_others_ms": beside}))
    print(f"compiled step alone {alone:.3f} ms, with {args.others} more compiled models {beside:.3f} ms "
          f"({beside / alone:.2f}x)")


if __name__ == "__main__":
    main()
