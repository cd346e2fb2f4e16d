"""Where one step of compiled speculative decoding goes on this CPU, by torch's profiler: the step's
forwards (the draft's proposals, their sampling inside, then the verification with the acceptance
rule: Transformer.draw_then_decode, one compiled call), and the work around them (the draws of
the uniforms, the commits, the rollback), with dynamo's own cost per compiled call (the guard
lookup where a call goes through dynamo's frame evaluation, the bytecode before and around the
graph, the runtime wrapper) beside what the graphs run. The CPU
pair's shapes (presets spec-small-target and spec-small-draft, weights as initialised), temperature
1, gamma 5, a prompt of `--context` tokens.

    OMP_NUM_THREADS=2 python bench/speculative_profile.py [--batch-size 1] [--new-tokens 64]

Prints one JSON line: ms per step in each part, and dynamo's microseconds per compiled call. The
profiler adds its own cost to every operation: compare the parts with each other, not with the
timings of bench/compiled_speculative_costs.py.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile, record_function

from attnlab.config import load_config
from attnlab.generate.sampling import SamplingConfig
from attnlab.generate.speculative import speculative_generate
from attnlab.model import Transformer

DYNAMO_EVENTS = ("TorchDynamo Cache Lookup", "Pregraph bytecode", "AOTDispatcher Runtime Wrapper Prologue")


def labelled(model: Transformer, label: str) -> Transformer:
    """The model with every call of a decoding step (a forward, a draft's proposal, a verification,
    both in one call) recorded under `label`, a prefill under "prefill"."""
    forward, draw, decode_then, draw_then_decode = model.forward, model.draw, model.decode_then, model.draw_then_decode

    def recorded(tokens, targets=None, cache=None, loss_mask=None):
        with record_function("prefill" if cache is None or cache.length == 0 else label):
            return forward(tokens, targets, cache, loss_mask)

    def recorded_draw(*arguments):
        with record_function(label):
            return draw(*arguments)

    def recorded_decode_then(*arguments):
        with record_function(label):
            return decode_then(*arguments)

    def recorded_draw_then_decode(*arguments):
        with record_function(label + "s (with the draft's)"):
            return draw_then_decode(*arguments)

    model.forward, model.draw, model.decode_then = recorded, recorded_draw, recorded_decode_then
    model.draw_then_decode = recorded_draw_then_decode
    return model


def build(preset: str, label: str, backend: str) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(load_config(preset).model).eval()
    model.compile_decoding(backend=backend)
    return labelled(model, label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--warm-runs", type=int, default=3, help="runs before the profiled one (they compile)")
    parser.add_argument("--backend", default="inductor", help="torch.compile back-end of both models' steps")
    args = parser.parse_args()
    target = build("spec-small-target", "target forward", args.backend)
    draft = build("spec-small-draft", "draft forward", args.backend)
    prompt = torch.randint(0, 256, (args.batch_size, args.context), generator=torch.Generator().manual_seed(0))

    def run(seed: int):
        return speculative_generate(target, draft, prompt, args.new_tokens, args.gamma, SamplingConfig(),
                                    generator=torch.Generator().manual_seed(seed))

    for seed in range(args.warm_runs):
        run(seed)
    graphs = counters["stats"]["unique_graphs"]
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        with record_function("decoding"):
            result = run(args.warm_runs)
    if counters["stats"]["unique_graphs"] != graphs:
        raise SystemExit("a decode step compiled during the profiled run: give more --warm-runs or --new-tokens")
    events = {event.key: event for event in profiler.key_averages()}
    steps = result.n_steps

    def total_ms(name: str) -> float:
        return events[name].cpu_time_total / 1e3 / steps if name in events else 0.0

    # the code dynamo made runs at every compiled call, called by dynamo or directly (compile_decoding's
    # direct_calls): its bytecode before the graph counts the calls
    compiled_calls = events["Pregraph bytecode"].count if "Pregraph bytecode" in events else 0
    dynamo_us = sum(events[name].self_cpu_time_total for name in DYNAMO_EVENTS if name in events)
    dynamo_us += sum(event.self_cpu_time_total for key, event in events.items()
                     if key.startswith("Torch-Compiled Region"))
    decoding = total_ms("decoding") - total_ms("prefill")
    target_ms, draft_ms = total_ms("target forward"), total_ms("draft forward")
    both_ms = total_ms("target forwards (with the draft's)")  # holds the two above where they are separate calls
    print(json.dumps({
        "batch_size": args.batch_size, "gamma": args.gamma, "threads": torch.get_num_threads(), "steps": steps,
        "acceptance": round(result.acceptance_rate, 3), "ms_per_step": {
            "whole": round(decoding, 3), "forwards": round(both_ms, 3),
            "of them separate calls": {"target": round(target_ms, 3), "draft": round(draft_ms, 3)},
            "around forwards": round(decoding - both_ms, 3)},
        "compiled_calls_per_step": round(compiled_calls / steps, 2),
        "dynamo_us_per_compiled_call": round(dynamo_us / max(compiled_calls, 1), 1),
    }), flush=True)


if __name__ == "__main__":
    main()
