"""Cached decoding, one token at a time, with plain nn.Linear products (F.linear) and with the opt-in
column products W x^T (attnlab.model.column_products, `--column-products` of the decoding
commands), for every attention type, in one process: the layouts alternate round after round, so a
slow spell of a shared machine slows both. Models as `attnlab bench decode` builds them (untrained,
batch 1); each round prefills the context afresh and times --new-tokens single-token forwards.
Medians of the per-round medians, in ms per token, one JSON line per attention type and context.

    python bench/decode_products_ab.py [--attention full local routing sinkhorn nsa] [--context 512]
        [--new-tokens 32] [--rounds 7] [--dim 256] [--depth 4] [--heads 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from attnlab.bench.measure import model_config
from attnlab.bench.runner import model_values
from attnlab.model import Transformer
from attnlab.model.column_products import use_column_products


@torch.inference_mode()
def round_ms(model: Transformer, sequence: torch.Tensor, context: int) -> float:
    cache = model.new_cache(1, sequence.shape[1])
    model(sequence[:, :context], cache=cache)
    times = []
    for position in range(context, sequence.shape[1]):
        started = time.perf_counter()
        model(sequence[:, position : position + 1], cache=cache)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", nargs="+", default=["full", "local", "routing", "sinkhorn", "nsa"])
    parser.add_argument("--context", type=int, nargs="+", default=[512])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    for attention in args.attention:
        for context in args.context:
            length = context + args.new_tokens
            values = model_values(args.dim, args.depth, args.heads, attention, [])
            config = model_config({**values, "max_seq_len": max(length, values.get("max_seq_len", 0))})
            torch.manual_seed(0)
            model = Transformer(config).eval()
            weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
            sequence = torch.randint(0, config.num_tokens, (1, length))
            times = {False: [], True: []}
            for repeat in range(args.rounds + 1):  # the first round warms up
                for enabled in (False, True):
                    use_column_products(model, enabled)
                    elapsed = round_ms(model, sequence, context)
                    if repeat:
                        times[enabled].append(elapsed)
            linear, columns = statistics.median(times[False]), statistics.median(times[True])
            print(json.dumps({"attention": attention, "context": context, "threads": torch.get_num_threads(),
                              "linear_weight_mb": round(sum(4 * w.numel() for w in weights.values()) / 2**20, 1),
                              "rounds": args.rounds, "linear_ms_per_token": round(linear, 3),
                              "columns_ms_per_token": round(columns, 3),
                              "linear_over_columns": round(linear / columns, 3)}), flush=True)


if __name__ == "__main__":
    main()
