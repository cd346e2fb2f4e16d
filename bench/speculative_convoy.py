"""What batching costs speculative decoding's tokens per step, by simulation (no model).

Rows accept draft tokens independently with per-token probability alpha. `speculative_generate`
cuts both caches to the shortest committed prefix after every step, and a row that is k tokens
ahead of the slowest one has k known slots in the next window and drafts only gamma - k tokens
(src/attnlab/generate/speculative.py). The batch advances at the pace of its slowest row. This
script prints the tokens committed per row and step under that scheme, for batch 1 (where it is
the papers' (1 - alpha^(gamma+1)) / (1 - alpha)) and larger batches, so that a measured figure
can be split into what acceptance gives and what the shared window takes.

    python bench/speculative_convoy.py [--alpha 0.82] [--gamma 5] [--tokens 50000]
"""

from __future__ import annotations

import argparse
import json
import random


def tokens_per_step(alpha: float, gamma: int, batch: int, n_tokens: int, seed: int = 0) -> float:
    """New tokens per row and step until every row has n_tokens, under the shared-window scheme."""
    rng = random.Random(seed)
    lengths = [0] * batch
    steps = 0
    while min(lengths) < n_tokens:
        start = min(lengths)
        for row in range(batch):
            ahead = lengths[row] - start  # known slots at the start of this row's window
            accepted = 0
            while accepted < gamma - ahead and rng.random() < alpha:
                accepted += 1
            lengths[row] = start + ahead + accepted + 1  # accepted drafts, then one corrected/bonus token
        steps += 1
    return n_tokens / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.82])
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=50000)
    args = parser.parse_args()
    for alpha in args.alpha:
        formula = (1 - alpha ** (args.gamma + 1)) / (1 - alpha)
        simulated = {f"batch_{batch}": round(tokens_per_step(alpha, args.gamma, batch, args.tokens), 3)
                     for batch in (1, 2, 4, 8)}
        print(json.dumps({"alpha": alpha, "gamma": args.gamma, "formula_batch_1": round(formula, 3), **simulated}))


if __name__ == "__main__":
    main()
