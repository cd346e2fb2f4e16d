"""How fast a CPU decodes depends on how its BLAS multiplies a few rows of activations by a
weight matrix that is not in the caches. Layouts of the same product y = x W^T, for a few rows
x [N, K] and a weight W [O, K]:

- "linear": torch.nn.functional.linear(x, W), what attnlab's layers call (a matrix-vector
  product for one row);
- "columns": torch.mm(W, x^T)^T, the rows as columns of a matrix product (one row is padded to
  two: a one-column product takes the matrix-vector path again);
- "columns-multirow": the columns layout for 2 or more rows only; one row as "linear". One-row
  products are all that base decoding at batch 1 multiplies, so this layout leaves it as it is
  and speeds up what has several rows (speculative decoding's verification of gamma + 1 tokens).

This times the target's own cached decoding and speculative decoding (batch 1, temperature 1,
256 new tokens, a validation prime) with every nn.Linear of both models computed each way in
inference mode, the runs alternating; medians in ms, and the speedup of each layout. Only the
first is what attnlab's decoding uses: this measures what the others would change.

    python bench/decode_linear_layouts.py TARGET_RUN DRAFT_RUN [--repeats 7] [--gamma 5]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.data.bytes import load_corpus
from attnlab.data.sampler import eval_windows
from attnlab.generate.sampling import SamplingConfig, generate
from attnlab.generate.speculative import speculative_generate
from attnlab.train.checkpoint import load_model


def columns_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] W^T as W x^T, rows as columns (one row padded to two)."""
    flat = x.reshape(-1, x.shape[-1])
    columns = flat if flat.shape[0] > 1 else torch.cat((flat, flat))
    y = torch.mm(weight, columns.T).T[: flat.shape[0]]
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def columns_layout(max_rows: int = 8, min_rows: int = 1):
    """Every nn.Linear computes products of min_rows to max_rows rows without autograd as columns."""
    original = nn.Linear.forward

    def forward(self, x):
        if torch.is_grad_enabled() or not min_rows <= x.numel() // x.shape[-1] <= max_rows:
            return original(self, x)
        return columns_product(x, self.weight, self.bias)

    nn.Linear.forward = forward
    try:
        yield
    finally:
        nn.Linear.forward = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--repeats", type=int, default=7, help="timed decodings of each kind and layout")
    parser.add_argument("--gamma", type=int, default=5)
    args = parser.parse_args()
    target, draft = load_model(args.target).eval(), load_model(args.draft).eval()
    with torch.inference_mode():  # the layouts agree
        x, weight = torch.randn(3, 256), torch.randn(64, 256)
        torch.testing.assert_close(columns_product(x, weight, None), F.linear(x, weight), rtol=1e-4, atol=1e-4)

    corpus = load_corpus(target.run_config.data)
    prompt = eval_windows(corpus.val, 128, 1, seed=0)[:, :128].long()
    sampling = SamplingConfig(temperature=1.0)

    def base(seed: int):
        with torch.inference_mode():
            return generate(target, prompt, 256, sampling, generator=torch.Generator().manual_seed(seed))

    def speculative(seed: int):
        return speculative_generate(target, draft, prompt, 256, args.gamma, sampling,
                                    generator=torch.Generator().manual_seed(seed))

    layouts = {"linear": contextlib.nullcontext, "columns": columns_layout,
               "columns-multirow": lambda: columns_layout(min_rows=2)}
    times = {(layout, kind): [] for layout in layouts for kind in ("base", "speculative")}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for layout, context in layouts.items():
            with context():
                for kind, decode in (("base", base), ("speculative", speculative)):
                    started = time.perf_counter()
                    decode(repeat)
                    if repeat:
                        times[(layout, kind)].append(time.perf_counter() - started)
    for layout in layouts:
        base_ms = 1000 * statistics.median(times[(layout, "base")])
        speculative_ms = 1000 * statistics.median(times[(layout, "speculative")])
        print(json.dumps({"layout": layout, "batch_size": 1, "repeats": args.repeats, "base_ms": round(base_ms, 1),
                          "speculative_ms": round(speculative_ms, 1), "speedup": round(base_ms / speculative_ms, 3)}))


if __name__ == "__main__":
    main()
