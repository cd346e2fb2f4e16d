"""How fast a CPU decodes depends on how its BLAS multiplies a few rows of activations by a
weight matrix that is not in the caches. Two layouts of the same product y = x W^T, for a few
rows x [N, K] and a weight W [O, K]:

- "linear": torch.nn.functional.linear(x, W) everywhere (attnlab's layers before
  attnlab.model.linear; a matrix-vector product for one row);
- "columns": what attnlab's Linear does now: torch.mm(W, x^T)^T for up to 32 rows of float32
  activations on a CPU with MKL, without autograd (one row padded to two columns), in models
  whose linear weights come to 8 MB or more (a smaller draft keeps F.linear); F.linear otherwise.
  Up to CONTIGUOUS_ROWS_MAX (10) rows of x are copied contiguous when they come strided;
- "strided": with --strided, the columns layout without that copy (CONTIGUOUS_ROWS_MAX 0), as the
  column products ran before it was added.

This times the target's own cached decoding and speculative decoding (batch 1 or more,
temperature 1, 256 new tokens, validation primes) in each layout, the runs alternating, each
speculative run right after a base run of the same seed; medians in ms, the paired speedup, and
how much faster each kind decodes with columns than with linear.

    python bench/decode_linear_layouts.py TARGET_RUN DRAFT_RUN [--repeats 7] [--gamma 5] [--batch-size 1]
        [--draft-quantize int8] [--strided]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import attnlab.model.linear as linear_module
import torch
from attnlab.model.linear import column_product, column_products

from attnlab.data.corpus import load_corpus
from attnlab.data.sampler import eval_windows
from attnlab.generate.sampling import SamplingConfig, generate
from attnlab.generate.speculative import speculative_generate
from attnlab.model.quantize import QUANTIZATIONS, quantize_weights
from attnlab.train.checkpoint import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--repeats", type=int, default=7, help="timed decodings of each kind and layout")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--draft-quantize", choices=list(QUANTIZATIONS), default="none")
    parser.add_argument("--strided", action="store_true",
                        help="also time the columns layout without its contiguous copy of up to 10 rows")
    args = parser.parse_args()
    target, draft = load_model(args.target).eval(), load_model(args.draft).eval()
    quantize_weights(draft, args.draft_quantize)
    with torch.inference_mode():  # the layouts agree
        x, weight = torch.randn(3, 256), torch.randn(64, 256)
        torch.testing.assert_close(column_product(x, weight), x @ weight.T, rtol=1e-4, atol=1e-4)

    corpus = load_corpus(target.run_config.data)
    prompt = eval_windows(corpus.val, 128, args.batch_size, seed=0)[:, :128].long()
    sampling = SamplingConfig(temperature=1.0)

    def base(seed: int):
        with torch.inference_mode():
            return generate(target, prompt, 256, sampling, generator=torch.Generator().manual_seed(seed))

    def speculative(seed: int):
        return speculative_generate(target, draft, prompt, 256, args.gamma, sampling,
                                    generator=torch.Generator().manual_seed(seed))

    contiguous_rows = linear_module.CONTIGUOUS_ROWS_MAX
    layouts = {"linear": (False, contiguous_rows), "columns": (True, contiguous_rows)}
    if args.strided:
        layouts["strided"] = (True, 0)
    times = {(layout, kind): [] for layout in layouts for kind in ("base", "speculative")}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for layout, (enabled, rows) in layouts.items():
            linear_module.CONTIGUOUS_ROWS_MAX = rows  # read by column_product at each call
            with column_products(enabled):
                for kind, decode in (("base", base), ("speculative", speculative)):
                    started = time.perf_counter()
                    decode(repeat)
                    if repeat:
                        times[(layout, kind)].append(time.perf_counter() - started)
    linear_module.CONTIGUOUS_ROWS_MAX = contiguous_rows
    medians = {key: 1000 * statistics.median(values) for key, values in times.items()}
    for layout in layouts:
        paired = [b / s for b, s in zip(times[(layout, "base")], times[(layout, "speculative")], strict=True)]
        print(json.dumps({
            "layout": layout, "batch_size": args.batch_size, "draft_quantize": args.draft_quantize,
            "repeats": args.repeats, "threads": torch.get_num_threads(),
            "base_ms": round(medians[(layout, "base")], 1),
            "speculative_ms": round(medians[(layout, "speculative")], 1),
            "speedup_paired_median": round(statistics.median(paired), 3),
        }))
    print(json.dumps({
        "columns_over_linear": {kind: round(medians[("linear", kind)] / medians[("columns", kind)], 3)
                                for kind in ("base", "speculative")},
        **({"columns_over_strided": {kind: round(medians[("strided", kind)] / medians[("columns", kind)], 3)
                                     for kind in ("base", "speculative")}} if args.strided else {}),
    }))


if __name__ == "__main__":
    main()
