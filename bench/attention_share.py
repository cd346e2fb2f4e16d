"""How much of a full-attention training step is attention, measured: training steps of full,
routing and sinkhorn models, and of the full model with its attention core replaced by a free
stand-in (the output is the values: projections, norms, feed-forward and loss are all still
there), interleaved round by round in one process so that a shared machine's load hits all alike.

The step time of the free-core model bounds what any sparse attention can reach: full / free-core
is the largest possible training speed-up over full attention at this size.

    python bench/attention_share.py --seq-len 4096 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch

import attnlab.attention.full as full_module
from attnlab.config import ModelConfig, config_from_dict
from attnlab.model import Transformer


def build(kind: str, seq_len: int, window: int) -> Transformer:
    values = {
        "dim": 256, "depth": 4, "heads": 4, "dim_head": 64, "max_seq_len": seq_len,
        "attention": {"kind": kind, "routing": {"window_size": window}, "sinkhorn": {"bucket_size": window}},
    }
    torch.manual_seed(0)
    return Transformer(config_from_dict(values, ModelConfig)).train()


@contextmanager
def free_attention_core():
    """Full attention's fused kernel replaced by returning the values (same shape, no cost)."""
    original = full_module.sdpa
    full_module.sdpa = lambda q, k, v, mask, causal, dropout: v
    try:
        yield
    finally:
        full_module.sdpa = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    names = ["full", "routing", "sinkhorn", "full, attention core free"]
    models = {name: build(name.split(",")[0], args.seq_len, args.window) for name in names}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, model in models.items()}
    tokens = torch.randint(0, 256, (1, args.seq_len + 1), generator=torch.Generator().manual_seed(0))

    def step(name: str) -> float:
        started = time.perf_counter()
        if name.endswith("free"):
            with free_attention_core():
                loss = models[name](tokens[:, :-1], targets=tokens[:, 1:]).loss
                loss.backward()
        else:
            loss = models[name](tokens[:, :-1], targets=tokens[:, 1:]).loss
            loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        return time.perf_counter() - started

    for name in names:  # warm-up
        step(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            times[name].append(step(name))
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"seq_len {args.seq_len}, window/bucket {args.window}, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} interleaved rounds")
    print()
    print("| model | step (ms) | tokens/s | speed vs full |")
    print("|---|---:|---:|---:|")
    for name in names:
        print(f"| {name} | {medians[name] * 1e3:.0f} | {args.seq_len / medians[name]:.0f} | "
              f"{medians['full'] / medians[name]:.2f}x |")


if __name__ == "__main__":
    main()
