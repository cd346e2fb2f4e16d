"""NSA's training step with its current defaults against the earlier ones, side by side in one
process (the two take turns, so both see the same machine load): one NSA layer's forward and
backward at 4096 tokens (dim 256, 4 heads of 64, 2 key/value heads, window 64, compressed blocks
of 16 with stride 8, selection blocks of 16, 4 selected, batch 1, fp32, CPU), and with `--model`
a whole depth-4 model's training step. Prints each one's median seconds and new / old.

    OMP_NUM_THREADS=1 python bench/nsa_default_speed.py --seq-len 4096 --rounds 5

The earlier defaults are set explicitly: an MLP compressor as wide as its input (compress_mlp_mult
1.0), all gates starting at 0.5 (gate_init_bias 0) and one key/value projection for every branch
(separate_branch_kv false); "shared" is today's defaults with that one projection, to show what
the branches' own keys and values cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from attnlab.attention.base import AttentionSpec, RotaryEmbedding
from attnlab.attention.nsa import NativeSparseAttention
from attnlab.config import ModelConfig, NSAAttentionConfig, config_from_dict
from attnlab.model import Transformer

SHAPE = dict(sliding_window_size=64, compress_block_size=16, compress_stride=8, selection_block_size=16, num_selected=4)
EARLIER = dict(compress_mlp_mult=1.0, gate_init_bias=0.0, separate_branch_kv=False)
SHARED = dict(separate_branch_kv=False)


def layer(options: dict, seq_len: int) -> tuple[torch.nn.Module, callable]:
    spec = AttentionSpec(dim=256, n_heads=4, dim_head=64, n_kv_heads=2, dropout=0.0, max_seq_len=seq_len,
                         layer_index=0, n_layers=1, rotary=RotaryEmbedding(64, 10000.0, seq_len))
    module = NativeSparseAttention(spec, NSAAttentionConfig(**SHAPE, **options)).train()
    x = torch.randn(1, seq_len, 256)
    return module, lambda: module(x).square().mean().backward()


def model(options: dict, seq_len: int) -> tuple[torch.nn.Module, callable]:
    values = dict(dim=256, depth=4, heads=4, dim_head=64, kv_heads=2, max_seq_len=seq_len,
                  attention=dict(kind="nsa", nsa={**SHAPE, **options}))
    module = Transformer(config_from_dict(values, ModelConfig)).train()
    tokens = torch.randint(0, 256, (1, seq_len + 1))
    return module, lambda: module(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()


def time_in_turns(steps: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each step function, the functions taking turns; the first round warms up."""
    seconds: dict[str, list[float]] = {name: [] for name in steps}
    for round_index in range(rounds + 1):
        for name, (module, step) in steps.items():
            started = time.perf_counter()
            step()
            elapsed = time.perf_counter() - started
            module.zero_grad(set_to_none=True)
            if round_index:
                seconds[name].append(elapsed)
    return {name: statistics.median(values) for name, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (after one warm-up)")
    parser.add_argument("--model", action="store_true", help="also time a whole depth-4 model's training step")
    args = parser.parse_args()
    builders = {"layer": layer, **({"model": model} if args.model else {})}
    for what, build in builders.items():
        torch.manual_seed(0)
        medians = time_in_turns({"earlier": build(EARLIER, args.seq_len), "shared": build(SHARED, args.seq_len),
                                 "current": build({}, args.seq_len)}, args.rounds)
        print(json.dumps({"what": what, "seq_len": args.seq_len, "threads": torch.get_num_threads(),
                          "median_seconds": {name: round(value, 4) for name, value in medians.items()},
                          "current_over_earlier": round(medians["current"] / medians["earlier"], 3),
                          "current_over_shared": round(medians["current"] / medians["shared"], 3)}), flush=True)


if __name__ == "__main__":
    main()
