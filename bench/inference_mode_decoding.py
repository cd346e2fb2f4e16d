"""generate() with its steps under torch.inference_mode (as it decodes) beside the same loop under
torch.no_grad (as it decoded before), side by side in one process: the bench decode model
(bench/compiled_decoding.py: dim 256, depth 4, 4 heads of 64), eager and compiled, a random prompt
of `--context` tokens, then `--new-tokens` tokens with top-k sampling. Round after round, each pair
is timed back to back (the order alternating), end to end with the prefill; the figure per model
is the median of the per-round ratios (no_grad time / inference-mode time).

    OMP_NUM_THREADS=2 python bench/inference_mode_decoding.py [--attention full nsa] [--context 256]
        [--new-tokens 128] [--rounds 15] [--variants eager compiled]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import compiled_decoding  # noqa: E402 - the bench decode model and its sampling settings

from attnlab.generate.sampling import generate, probabilities, sample_from  # noqa: E402
from attnlab.model import Transformer  # noqa: E402


@torch.no_grad()
def no_grad_generate(model: Transformer, prompt: torch.Tensor, new_tokens: int, generator) -> torch.Tensor:
    """generate()'s cached loop with every step under torch.no_grad (its cache made there too)."""
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + new_tokens)
    tokens, next_input = [], prompt
    for _ in range(new_tokens):
        logits = model(next_input, cache=cache).logits[:, -1]
        token = sample_from(probabilities(logits, compiled_decoding.SAMPLING), generator)
        tokens.append(token)
        next_input = token[:, None]
    return torch.cat((prompt, torch.stack(tokens, dim=1)), dim=1)


def timed(model: Transformer, side: str, prompt: torch.Tensor, new_tokens: int, seed: int
          ) -> tuple[float, torch.Tensor]:
    """(seconds, tokens) of one decoding by generate() ("inference") or no_grad_generate ("no_grad")."""
    generator = torch.Generator().manual_seed(seed)
    started = time.perf_counter()
    if side == "inference":
        output = generate(model, prompt, new_tokens, compiled_decoding.SAMPLING, generator=generator)
    else:
        output = no_grad_generate(model, prompt, new_tokens, generator)
    return time.perf_counter() - started, output


def measure(kinds: list[str], context: int, new_tokens: int, rounds: int, variants: list[str]) -> dict:
    models = {(kind, variant): compiled_decoding.build(kind, context + new_tokens, variant)
              for kind in kinds for variant in variants}
    prompt = torch.randint(0, 256, (1, context), generator=torch.Generator().manual_seed(0))
    results = {}
    for (kind, variant), model in models.items():
        ratios, inference_ms, no_grad_ms = [], [], []
        for round_ in range(rounds + 1):  # round 0 warms up (and compiles both call kinds)
            order = ("inference", "no_grad") if round_ % 2 else ("no_grad", "inference")
            seconds, outputs = {}, {}
            for side in order:
                seconds[side], outputs[side] = timed(model, side, prompt, new_tokens, round_)
            if not torch.equal(outputs["inference"], outputs["no_grad"]):
                raise SystemExit(f"{kind} {variant}: the two loops drew different tokens")
            if round_:
                ratios.append(seconds["no_grad"] / seconds["inference"])
                inference_ms.append(seconds["inference"] * 1e3 / new_tokens)
                no_grad_ms.append(seconds["no_grad"] * 1e3 / new_tokens)
        results[f"{kind} {variant}"] = {"no_grad_over_inference": statistics.median(ratios),
                                        "inference_ms_per_token": statistics.median(inference_ms),
                                        "no_grad_ms_per_token": statistics.median(no_grad_ms),
                                        "ratios": [round(ratio, 3) for ratio in ratios]}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", nargs="+", default=["full", "nsa"])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--variants", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    args = parser.parse_args()
    results = measure(args.attention, args.context, args.new_tokens, args.rounds, args.variants)
    print(json.dumps({"threads": torch.get_num_threads(), "context": args.context, "new_tokens": args.new_tokens,
                      "rounds": args.rounds, **results}), flush=True)
    for name, figures in results.items():
        print(f"{name}: no_grad / inference mode {figures['no_grad_over_inference']:.3f}x "
              f"({figures['no_grad_ms_per_token']:.2f} / {figures['inference_ms_per_token']:.2f} ms a token, "
              "prefill included)")


if __name__ == "__main__":
    main()
