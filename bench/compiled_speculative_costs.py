"""The forwards speculative decoding is made of, eager and compiled, side by side in one process:
one cached target token, one verification of gamma + 1 tokens, one cached draft token, at each
batch size, for the CPU pair's shapes (presets spec-small-target, dim 256 depth 6, and
spec-small-draft, depth 1; weights as initialised: the cost of a forward does not depend on them).

Each forward is timed in turn, round after round, after a warm-up that compiles the steps; medians.
From the costs in units of one target token (d: a draft token, v: a verification) and a per-token
acceptance alpha, the speedup at batch 1 that Leviathan et al. (section 3.1, eq. 1) give, loop
overhead ignored: tokens per step (1 - alpha^(gamma + 1)) / (1 - alpha), divided by gamma d + v.
This is a projection from measured costs, not a decoding measured end to end.

    OMP_NUM_THREADS=2 python bench/compiled_speculative_costs.py [--batch-size 1 4] [--context 200] [--rounds 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from attnlab.config import load_config
from attnlab.model import Transformer

ALPHAS = (0.80, 0.85, 0.87, 0.90)  # per-token acceptance; the distilled CPU pair measured 0.85-0.87


def build(preset: str, compiled: bool) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(load_config(preset).model).eval()
    if compiled:
        model.compile_decoding()
    return model


def tokens_per_step(alpha: float, gamma: int) -> float:
    """Expected tokens a speculative step yields at per-token acceptance alpha (Leviathan et al., eq. 1)."""
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def timed_forward(model: Transformer, batch: int, context: int, n_tokens: int) -> float:
    """Seconds of one cached forward of n_tokens after `context` tokens (the cache rolled back after
    it, so every round sees the same length)."""
    cache = model.new_cache(batch, context + 16)
    model(torch.randint(0, 256, (batch, context)), cache=cache)
    tokens = torch.randint(0, 256, (batch, n_tokens))
    started = time.perf_counter()
    model(tokens, cache=cache)
    return time.perf_counter() - started


def measure(batch: int, context: int, rounds: int, gamma: int) -> dict:
    models = {(role, compiled): build(preset, compiled) for role, preset in
              (("target", "spec-small-target"), ("draft", "spec-small-draft")) for compiled in (False, True)}
    forwards = {f"{mode} {name}": (models[role, mode == "compiled"], n_tokens)
                for mode in ("eager", "compiled")
                for name, role, n_tokens in (("target token", "target", 1), ("verification", "target", gamma + 1),
                                             ("draft token", "draft", 1))}
    times = {name: [] for name in forwards}
    with torch.inference_mode():
        for round_ in range(rounds + 3):  # three warm-up rounds: the compiled steps are made there
            for name, (model, n_tokens) in forwards.items():
                elapsed = timed_forward(model, batch, context, n_tokens)
                if round_ >= 3:
                    times[name].append(elapsed)
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    report = {"batch_size": batch, "context": context, "gamma": gamma, "rounds": rounds, "ms": medians}
    for mode in ("eager", "compiled"):
        token = medians[f"{mode} target token"]
        draft, verify = medians[f"{mode} draft token"] / token, medians[f"{mode} verification"] / token
        projected = {str(alpha): tokens_per_step(alpha, gamma) / (gamma * draft + verify) for alpha in ALPHAS}
        report[mode] = {"draft_in_target_tokens": draft, "verification_in_target_tokens": verify,
                        "projected_speedup": projected}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--gamma", type=int, default=5)
    args = parser.parse_args()
    for batch in args.batch_size:
        report = measure(batch, args.context, args.rounds, args.gamma)
        print(json.dumps({"threads": torch.get_num_threads(), **report}), flush=True)
        ms = report["ms"]
        print(f"batch {batch}: ms per forward, eager / compiled: target token {ms['eager target token']:.2f} / "
              f"{ms['compiled target token']:.2f}, verification {ms['eager verification']:.2f} / "
              f"{ms['compiled verification']:.2f}, draft token {ms['eager draft token']:.2f} / "
              f"{ms['compiled draft token']:.2f}")
        for mode in ("eager", "compiled"):
            part = report[mode]
            projected = ", ".join(f"alpha {alpha}: {value:.2f}x" for alpha, value in part["projected_speedup"].items())
            print(f"  {mode}: draft {part['draft_in_target_tokens']:.2f}, verification "
                  f"{part['verification_in_target_tokens']:.2f} target tokens; projected {projected}")


if __name__ == "__main__":
    main()
