"""Per-row rollback against the shared window for a pair with local attention, at batch 4.

The pair is a trained target and draft run with local (sliding-window) attention of `--window`
tokens in place of the attention they were trained with: the same weights (every attention
variant shares its projections), so the pair still agrees often, and both models' caches are
local ones. Times the target's own cached decoding, then speculative decoding (gamma 5,
temperature 1, 256 new tokens, validation primes) with each row's caches rolled back to its own
length (per-row) and with all rows rolled back to the shortest (shared), the three alternating;
medians in ms, speedups and steps. One JSON line.

    python bench/speculative_local_rows.py TARGET_RUN DRAFT_RUN [--window 128] [--repeats 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from attnlab.data.corpus import load_corpus
from attnlab.data.sampler import eval_windows
from attnlab.generate.sampling import SamplingConfig, generate
from attnlab.generate.speculative import speculative_generate
from attnlab.model import Transformer
from attnlab.train.checkpoint import load_model


def with_local_attention(run: str, window: int) -> Transformer:
    trained = load_model(run)
    config = trained.config
    attention = dataclasses.replace(
        config.attention, kind="local", local=dataclasses.replace(config.attention.local, window_size=window)
    )
    model = Transformer(dataclasses.replace(config, attention=attention)).eval()
    model.load_state_dict(trained.state_dict())
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    target, draft = with_local_attention(args.target, args.window), with_local_attention(args.draft, args.window)
    corpus = load_corpus(load_model(args.target).run_config.data)
    prompt = eval_windows(corpus.val, 128, args.batch_size, seed=0)[:, :128].long()
    sampling = SamplingConfig(temperature=1.0)

    def base(seed: int) -> None:
        with torch.inference_mode():
            generate(target, prompt, 256, sampling, generator=torch.Generator().manual_seed(seed))

    def speculative(seed: int, per_row: bool) -> int:
        result = speculative_generate(target, draft, prompt, 256, 5, sampling,
                                      generator=torch.Generator().manual_seed(seed), per_row=per_row)
        return result.n_steps

    times = {"base": [], "per-row": [], "shared": []}
    steps = {"per-row": [], "shared": []}
    for repeat in range(args.repeats + 1):  # the first round warms up
        started = time.perf_counter()
        base(repeat)
        seconds = {"base": time.perf_counter() - started}
        for scheme, per_row in (("per-row", True), ("shared", False)):
            started = time.perf_counter()
            n_steps = speculative(repeat, per_row)
            seconds[scheme] = time.perf_counter() - started
            if repeat:
                steps[scheme].append(n_steps)
        if repeat:
            for name, value in seconds.items():
                times[name].append(value)
    base_ms = 1000 * statistics.median(times["base"])
    report = {"window": args.window, "batch_size": args.batch_size, "repeats": args.repeats, "base_ms": round(base_ms)}
    for scheme in ("per-row", "shared"):
        ms = 1000 * statistics.median(times[scheme])
        report[scheme] = {"ms": round(ms), "speedup": round(base_ms / ms, 3), "steps": statistics.mean(steps[scheme])}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
