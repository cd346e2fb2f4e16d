"""Text written by a byte-level target, for distilling a speculative-decoding draft on the
contexts decoding verifies (docs/benchmarks.md, "Speculative decoding").

A draft distilled on corpus text agrees with its target less on the target's own continuations
than on the corpus (0.848 against 0.875 per token for the CPU pair): decoding feeds the target's
samples, not the corpus. This script writes, for `--batches` batches of `--rows` primes of
`--prime` bytes drawn from the training split, each prime followed by the target's own
temperature-1 continuation of `--new-tokens` bytes, one after the other, into OUT (a byte file
that `data.source=file data.path=OUT` trains on; its last `data.val_fraction` is that run's
validation split). The primes come from the training split only, so measurements on validation
primes stay apart.

    python bench/target_samples.py TARGET_RUN OUT [--rows 64] [--prime 128] [--new-tokens 384]
        [--batches 40] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from attnlab.data.corpus import load_corpus
from attnlab.data.sampler import eval_windows
from attnlab.generate.sampling import generate
from attnlab.train.checkpoint import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prime", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=384)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    target = load_model(args.target).eval()
    if target.config.num_tokens != 256:
        raise SystemExit(f"{args.target} is not byte-level (num_tokens={target.config.num_tokens})")
    corpus = load_corpus(target.run_config.data)
    started = time.perf_counter()
    with args.out.open("wb") as out, torch.inference_mode():
        for batch in range(args.batches):
            primes = eval_windows(corpus.train, args.prime, args.rows, seed=args.seed * 100_003 + batch)
            primes = primes[:, : args.prime].long()  # [rows, prime]
            generator = torch.Generator().manual_seed(args.seed * 100_003 + batch)
            tokens = generate(target, primes, args.new_tokens, generator=generator)  # [rows, prime + new]
            out.write(bytes(tokens.to(torch.uint8).flatten().tolist()))
    seconds = time.perf_counter() - started
    n_bytes = args.batches * args.rows * (args.prime + args.new_tokens)
    print(json.dumps({"out": str(args.out), "bytes": n_bytes, "generated": args.batches * args.rows * args.new_tokens,
                      "seconds": round(seconds, 1), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
