"""What a compiled model's generations of several lengths cost in one process: the seconds of each
generate() (compiling included) and the decode graphs it compiled, with the caches decoding makes
(Transformer.decoding_capacity: the prompt and new tokens rounded up to a power of two, so that
lengths rounding alike share a compiled step) beside caches of exactly the prompt and new tokens
(what generate() made before), each on its own copy of the run's model, the two taking turns at
each length.

    OMP_NUM_THREADS=2 python bench/generation_lengths.py RUN [--lengths 20:30 25:30 20:40 100:200]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch._dynamo.utils import counters

from attnlab.generate.sampling import generate
from attnlab.train.checkpoint import load_model

ARMS = ("rounded", "exact")


def timed_generation(model, prompt_length: int, new_tokens: int) -> tuple[float, int]:
    """(seconds, decode graphs compiled) of one seeded generate() after a random prompt."""
    prompt = torch.randint(0, model.config.num_tokens, (1, prompt_length), generator=torch.Generator().manual_seed(0))
    graphs = counters["stats"]["unique_graphs"]
    started = time.perf_counter()
    generate(model, prompt, new_tokens, compile=True, generator=torch.Generator().manual_seed(0))
    return time.perf_counter() - started, counters["stats"]["unique_graphs"] - graphs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run directory or checkpoint")
    parser.add_argument("--lengths", nargs="+", default=["20:30", "25:30", "20:40", "100:200"],
                        help="generations in order, each PROMPT:NEW tokens")
    args = parser.parse_args()
    models = {arm: load_model(args.run).eval() for arm in ARMS}
    models["exact"].decoding_capacity = lambda length: length  # the cache generate() made before
    for model in models.values():
        model.compile_decoding()
    totals = dict.fromkeys(ARMS, 0.0)
    print(f"threads {torch.get_num_threads()}, {args.run}")
    for spec in args.lengths:
        prompt_length, new_tokens = map(int, spec.split(":"))
        row = {"prompt": prompt_length, "new_tokens": new_tokens}
        for arm, model in models.items():
            seconds, graphs = timed_generation(model, prompt_length, new_tokens)
            totals[arm] += seconds
            row[arm] = {"capacity": model.decoding_capacity(prompt_length + new_tokens), "seconds": round(seconds, 2),
                        "graphs_compiled": graphs}
        print(json.dumps(row), flush=True)
    print(json.dumps({"total_seconds": {arm: round(total, 1) for arm, total in totals.items()}}))


if __name__ == "__main__":
    main()
