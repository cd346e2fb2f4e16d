"""A compiled step's draw through token_at's CPU operator (generate/sampling_cpu.cpp) beside the same
step drawing with torch's cumsum and searchsorted, side by side in one process: the CPU pair's draft
proposing gamma tokens (Transformer.draw, a draw per token) and its target's one-token step with
its draw (Transformer.decode_then with draw_last, as generate() calls it), each model compiled
twice, once traced with the operator and once without; weights as initialised (a draw's cost does
not depend on them). Each call is timed warm after `--context` tokens (the cache rolled back after
it, untimed); the two builds in turn, round after round; medians of each round's median call, and
of the rounds' time ratios (operator over torch's). The two builds draw the same tokens.

    OMP_NUM_THREADS=2 python bench/token_at_ab.py [--batch-size 1 4] [--gamma 6] [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnlab.config import load_config
from attnlab.generate import sampling_cpu
from attnlab.generate.distribution import draw_last
from attnlab.generate.sampling import SamplingConfig
from attnlab.model import Transformer
from attnlab.model.quantize import quantize_weights


def build(preset: str, quantization: str) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(load_config(preset).model).eval()
    quantize_weights(model, quantization)
    model.compile_decoding()
    return model


def calls(model: Transformer, role: str, batch: int, gamma: int):
    """The call one timing repeats: the draft's proposal of gamma tokens, or the target's step and draw."""
    sampling, generator = SamplingConfig(), torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (batch, 1), generator=generator)
    if role == "draft":
        uniforms = torch.rand(batch, gamma, generator=generator)
        no_tokens, no_known = torch.zeros(batch, gamma, dtype=torch.long), torch.zeros(batch, gamma, dtype=torch.bool)
        return lambda cache: model.draw(tokens, cache, uniforms, sampling, no_tokens, no_known)[1]
    uniform = torch.rand(batch, generator=generator)
    return lambda cache: model.decode_then(draw_last, tokens, cache, sampling, uniform)[0]


def median_call(call, cache, context: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call(cache)
        times.append(time.perf_counter() - started)
        cache.truncate(context)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not sampling_cpu.available():
        raise SystemExit("the CPU sampling operator cannot be built here (no C++ compiler)")
    roles = {"draft": ("spec-small-draft", "int8"), "target": ("spec-small-target", "none")}
    print(f"threads {torch.get_num_threads()}, gamma {args.gamma}; ms a call")
    for batch in args.batch_size:
        prompt = torch.randint(0, 256, (batch, args.context), generator=torch.Generator().manual_seed(0))
        for role, (preset, quantization) in roles.items():
            builds, caches, outputs = {}, {}, {}
            for name in ("operator", "torch"):
                model = builds[name] = build(preset, quantization)
                with torch.inference_mode():
                    caches[name] = model.new_cache(batch, args.context + args.gamma + 1)
                    model(prompt, cache=caches[name])
                    original = sampling_cpu.available
                    if name == "torch":  # traced without the operator: its graphs keep torch's calls
                        sampling_cpu.available = lambda: False
                    try:
                        outputs[name] = calls(model, role, batch, args.gamma)(caches[name])  # compiles
                        for _ in range(3):  # a call served twice skips guards: warm both alike
                            caches[name].truncate(args.context)
                            calls(model, role, batch, args.gamma)(caches[name])
                    finally:
                        sampling_cpu.available = original
                    caches[name].truncate(args.context)
            assert torch.equal(outputs["operator"], outputs["torch"]), "the two builds drew different tokens"
            times = {name: [] for name in builds}
            with torch.inference_mode():
                for _ in range(args.rounds):
                    for name, model in builds.items():
                        call = calls(model, role, batch, args.gamma)
                        times[name].append(median_call(call, caches[name], args.context, args.repeats))
            ratios = sorted(a / b for a, b in zip(times["operator"], times["torch"]))
            what = f"{role} proposal of {args.gamma}" if role == "draft" else "target token with its draw"
            print(f"batch {batch}, {what}: torch {statistics.median(times['torch']) * 1e3:.3f}, "
                  f"operator {statistics.median(times['operator']) * 1e3:.3f}, operator / torch "
                  f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})", flush=True)


if __name__ == "__main__":
    main()
