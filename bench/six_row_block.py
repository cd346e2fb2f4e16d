"""The packed decode step with and without the six-row AVX2 register block (decode_compile.SIX_ROW_BLOCK),
side by side in one process: for each attention type, the bench decode model (bench/compiled_decoding.py:
dim 256, depth 4, 4 heads of 64) compiled twice with compile_decoding's CPU defaults, once offering
the template the block and once not; then, round after round and model after model, ms per sampled
token after a prompt of `--context` tokens, and ms of a verification-sized forward of `--rows`
tokens after it (the cache rolled back after each, untimed). Medians, and the medians of the paired
per-round ratios (with the block / without). On a CPU without AVX2 both models are the same.

    OMP_NUM_THREADS=2 TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 python bench/six_row_block.py [--attention full nsa]

(inductor's cache of compiled graphs does not tell the two apart: disable it, or the second model
may reuse the first's code.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import compiled_decoding  # noqa: E402 - the bench decode model and its token timing

import attnlab.model.decode_compile as decode_compile  # noqa: E402

VARIANTS = ("with", "without")


def build(kind: str, max_len: int, variant: str, prompt: torch.Tensor, new_tokens: int, rows: int):
    """A compiled model whose steps (one token, `rows` tokens) were compiled with (or without) the
    six-row block offered."""
    offered = decode_compile.six_row_micro_kernels
    if variant == "without":
        decode_compile.six_row_micro_kernels = contextlib.nullcontext
    try:
        model = compiled_decoding.build(kind, max_len, "compiled")
        compiled_decoding.ms_per_token(model, prompt, new_tokens, seed=0)  # compiles the one-token step
        verification_ms(model, prompt, rows, repeats=2)  # and the verification's
    finally:
        decode_compile.six_row_micro_kernels = offered
    return model


@torch.inference_mode()
def verification_ms(model, prompt: torch.Tensor, rows: int, repeats: int) -> float:
    """Median ms of a forward of `rows` tokens after the prompt, the cache rolled back after each."""
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + rows)
    model(prompt, cache=cache)
    tokens = torch.randint(0, 256, (prompt.shape[0], rows), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        model(tokens, cache=cache)
        times.append(time.perf_counter() - started)
        cache.truncate(prompt.shape[1])
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", nargs="+", default=["full", "nsa"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rows", type=int, default=6, help="tokens of the verification-sized forward")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    prompt = torch.randint(0, 256, (1, args.context), generator=torch.Generator().manual_seed(args.context))
    max_len = args.context + max(args.new_tokens, args.rows)
    models = {(kind, variant): build(kind, max_len, variant, prompt, args.new_tokens, args.rows)
              for kind in args.attention for variant in VARIANTS}
    times = {(key, part): [] for key in models for part in ("token", "verification")}
    for round_ in range(1, args.rounds + 1):
        for key, model in models.items():
            times[key, "token"].append(compiled_decoding.ms_per_token(model, prompt, args.new_tokens, seed=round_))
            times[key, "verification"].append(verification_ms(model, prompt, args.rows, repeats=20))
    for kind in args.attention:
        report = {"attention": kind, "context": args.context, "rows": args.rows, "threads": torch.get_num_threads()}
        for part in ("token", "verification"):
            with_block, without = times[(kind, "with"), part], times[(kind, "without"), part]
            report[part] = {"with_ms": statistics.median(with_block), "without_ms": statistics.median(without),
                            "paired_ratio": statistics.median(a / b for a, b in zip(with_block, without))}
        print(json.dumps(report), flush=True)
        print(f"{kind}: token {report['token']['with_ms']:.3f} / {report['token']['without_ms']:.3f} ms "
              f"(paired {report['token']['paired_ratio']:.3f}), {args.rows}-token verification "
              f"{report['verification']['with_ms']:.3f} / {report['verification']['without_ms']:.3f} ms "
              f"(paired {report['verification']['paired_ratio']:.3f}); with / without the six-row block")


if __name__ == "__main__":
    main()
