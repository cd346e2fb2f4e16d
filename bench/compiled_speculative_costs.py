"""The forwards speculative decoding is made of, eager and compiled, side by side in one process,
and the decoding loops they make: one cached target token, one verification of gamma + 1 tokens,
the draft's proposal of gamma tokens (Transformer.draw: one call, the sampling included), at each
batch size, for the CPU pair's shapes (presets spec-small-target, dim 256 depth 6, and
spec-small-draft, depth 1; weights as initialised: the cost of a forward does not depend on them).

Forwards: each timed warm, as in a decoding loop (a cache filled with `context` tokens once, then
`--repeats` calls, the cache rolled back after each, untimed), the models in turn, round after
round; medians. The verification is timed as the loop makes it: the forward with the target's
distribution and the acceptance rule inside (Transformer.decode_then). From the costs in units of
one target token (d: a draft token, the proposal / gamma; v: a verification) and a per-token
acceptance alpha, the speedup at batch 1 that Leviathan et al. (section 3.1, eq. 1) give, loop
overhead ignored: tokens per step (1 - alpha^(gamma + 1)) / (1 - alpha), divided by gamma d + v.

Loops: the target's own decoding (`generate`, ms per token) and speculative decoding
(`speculative_generate`, temperature 1, ms per step: gamma draft tokens, one verification, the
sampling, acceptance and rollback between them), both timed end to end less the prompt's prefill
(timed alone beside them); the projection
tokens_per_step(alpha) x token / step then counts the loop's own work too. Inside the speculative
loop, the time in its forwards is summed too (Transformer.draw_then_decode: the draft's proposal
and the verification, one compiled call when both models are compiled; each step: in them, and
between them). The acceptance comes
from a trained pair (these weights are untrained): both are projections, not speedups measured on
a trained pair (bench/speculative_ab.py --compile times one).

--draft-quantize: the draft's weights, each a draft of its own timed beside the others (none: float32;
int8: model/quantize.py, a quarter of the bytes a draft token reads).

    OMP_NUM_THREADS=2 python bench/compiled_speculative_costs.py [--batch-size 1 4] [--context 200] [--rounds 15]
        [--draft-quantize none int8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from attnlab.config import load_config
from attnlab.generate.sampling import SamplingConfig, generate
from attnlab.generate.speculative import VERIFICATIONS, speculative_generate
from attnlab.model import Transformer
from attnlab.model.quantize import quantize_weights

ALPHAS = (0.80, 0.85, 0.87, 0.90)  # per-token acceptance; the distilled CPU pair measured 0.85-0.87


def build(preset: str, compiled: bool, quantization: str = "none") -> Transformer:
    torch.manual_seed(0)
    model = Transformer(load_config(preset).model).eval()
    quantize_weights(model, quantization)
    if compiled:
        model.compile_decoding()
    return model


def tokens_per_step(alpha: float, gamma: int) -> float:
    """Expected tokens a speculative step yields at per-token acceptance alpha (Leviathan et al., eq. 1)."""
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def warm_ms(call, cache, context: int, repeats: int) -> float:
    """Median ms of `repeats` calls (each a cached forward or draft proposal after `context` tokens),
    each followed by an untimed rollback to `context` (weights and cache stay warm, as in a decoding
    loop)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
        cache.truncate(context)
    return statistics.median(times) * 1e3


def timed_call(model: Transformer, cache, kind: str, batch: int, gamma: int):
    """What one timing repeats: a forward of one random token; a verification of gamma + 1 tokens
    as speculative decoding makes it (Transformer.decode_then: the forward, the target's
    distribution and the acceptance rule in one call, against random draft proposals); or the
    draft's proposal of gamma tokens (Transformer.draw: one token fed, gamma drawn, as speculative
    decoding calls it)."""
    no_tokens, no_known = torch.zeros(batch, gamma, dtype=torch.long), torch.zeros(batch, gamma, dtype=torch.bool)
    if kind == "draw":
        uniforms = torch.rand(batch, gamma)
        tokens = torch.randint(0, 256, (batch, 1))
        return lambda: model.draw(tokens, cache, uniforms, SamplingConfig(), no_tokens, no_known)
    if kind == "verification":
        tokens, drafted = torch.randint(0, 256, (batch, gamma + 1)), torch.randint(0, 256, (batch, gamma))
        draft_probs, uniforms = torch.softmax(torch.randn(batch, gamma, 256), dim=-1), torch.rand(batch, gamma + 1)
        return lambda: model.decode_then(VERIFICATIONS["block"], tokens, cache, draft_probs, drafted, SamplingConfig(),
                                         no_known, uniforms)
    tokens = torch.randint(0, 256, (batch, 1))
    return lambda: model(tokens, cache=cache)


def prefill_ms(models: list[Transformer], prompt: torch.Tensor, new_tokens: int) -> float:
    """ms of feeding prompt [B, T] to each model through a fresh cache of the room a generation of
    new_tokens more makes (decoding_capacity: rounded up when compiled, so that a compiled prefill
    runs the graphs the generations made), what a loop spends before its first token."""
    started = time.perf_counter()
    for model in models:
        room = model.decoding_capacity(prompt.shape[1] + new_tokens + 16)
        model(prompt, cache=model.new_cache(prompt.shape[0], room))
    return (time.perf_counter() - started) * 1e3


@contextlib.contextmanager
def time_inside(model: Transformer, method: str, totals: dict[str, float]):
    """Within the context, the seconds spent in model.`method` (wrapped on the instance) add up in
    totals[method]."""
    original = getattr(model, method)

    def timed(*arguments, **keywords):
        started = time.perf_counter()
        try:
            return original(*arguments, **keywords)
        finally:
            totals[method] += time.perf_counter() - started

    setattr(model, method, timed)
    try:
        yield
    finally:
        delattr(model, method)  # the class's method again


def loop_ms(target: Transformer, draft: Transformer, prompt: torch.Tensor, new_tokens: int, gamma: int,
            seed: int) -> tuple[float, float, float]:
    """(ms per token of the target's own decoding, ms per step of speculative decoding, and of that
    step the ms inside its forwards: the draft's proposal and the verification), end to end but for
    the prompt's prefill (timed alone and taken off: it is not what the loops compare)."""
    started = time.perf_counter()
    generate(target, prompt, new_tokens, SamplingConfig(), generator=torch.Generator().manual_seed(seed))
    token_ms = ((time.perf_counter() - started) * 1e3 - prefill_ms([target], prompt, new_tokens)) / new_tokens
    inside = {"draw_then_decode": 0.0}
    with time_inside(target, "draw_then_decode", inside):
        started = time.perf_counter()
        result = speculative_generate(target, draft, prompt, new_tokens, gamma, SamplingConfig(),
                                      generator=torch.Generator().manual_seed(seed))
        elapsed = (time.perf_counter() - started) * 1e3
    elapsed -= prefill_ms([target, draft], prompt[:, :-1], new_tokens)
    steps = result.n_steps
    return token_ms, elapsed / steps, inside["draw_then_decode"] * 1e3 / steps


def projections(token: float, proposal: float, verify: float, gamma: int) -> dict:
    return {str(alpha): tokens_per_step(alpha, gamma) / (proposal / token + verify / token) for alpha in ALPHAS}


def draft_name(quantization: str) -> str:
    return "draft" if quantization == "none" else f"draft {quantization}"


def measure(batch: int, context: int, rounds: int, repeats: int, gamma: int, new_tokens: int,
            quantizations: list[str]) -> dict:
    presets = {"target": ("spec-small-target", "none"),
               **{draft_name(quantization): ("spec-small-draft", quantization) for quantization in quantizations}}
    models = {(role, mode): build(preset, mode == "compiled", quantization)
              for role, (preset, quantization) in presets.items() for mode in ("eager", "compiled")}
    drafts = [role for role in presets if role != "target"]
    prompt = torch.randint(0, 256, (batch, context), generator=torch.Generator().manual_seed(0))
    caches = {}
    with torch.inference_mode():
        for (role, mode), model in models.items():
            caches[role, mode] = model.new_cache(batch, context + gamma + 1)
            model(prompt, cache=caches[role, mode])
    forwards = {f"{mode} {kind}": (role, mode, "draw" if role in drafts else kind)
                for mode in ("eager", "compiled")
                for kind, role in (("target token", "target"), ("verification", "target"),
                                   *((f"{draft} draw", draft) for draft in drafts))}
    times = {name: [] for name in forwards}
    loops = {f"{mode} {what}": [] for mode in ("eager", "compiled")
             for what in ("token", *drafts, *(f"{draft} {part}" for draft in drafts
                                              for part in ("forwards",)))}
    with torch.inference_mode():
        for round_ in range(rounds + 1):  # round 0 warms up: the compiled steps are made there
            for name, (role, mode, kind) in forwards.items():
                call = timed_call(models[role, mode], caches[role, mode], kind, batch, gamma)
                elapsed = warm_ms(call, caches[role, mode], context, repeats)
                if round_:
                    times[name].append(elapsed)
            for mode in ("eager", "compiled"):
                for draft in drafts:
                    token_ms, step_ms, forwards_ms = loop_ms(
                        models["target", mode], models[draft, mode], prompt, new_tokens, gamma, round_)
                    if round_:
                        loops[f"{mode} token"].append(token_ms)
                        loops[f"{mode} {draft}"].append(step_ms)
                        loops[f"{mode} {draft} forwards"].append(forwards_ms)
    medians = {name: statistics.median(values) for name, values in times.items()}
    loop_medians = {name: statistics.median(values) for name, values in loops.items()}
    report = {"batch_size": batch, "context": context, "gamma": gamma, "rounds": rounds, "repeats": repeats,
              "new_tokens": new_tokens, "ms": medians, "loop_ms": loop_medians}
    for mode in ("eager", "compiled"):
        for draft in drafts:
            token, verify = medians[f"{mode} target token"], medians[f"{mode} verification"]
            proposal, step = medians[f"{mode} {draft} draw"], loop_medians[f"{mode} {draft}"]
            loop_token = loop_medians[f"{mode} token"]
            report[f"{mode}, {draft}"] = {
                "draft_token_in_target_tokens": proposal / gamma / token,
                "verification_in_target_tokens": verify / token,
                "projected_speedup": projections(token, proposal, verify, gamma),
                "step_in_loop_tokens": step / loop_token,
                # a step's ms inside its forwards (the proposal and the verification), and between them
                "in_loop_ms": {"forwards": loop_medians[f"{mode} {draft} forwards"],
                               "between": step - loop_medians[f"{mode} {draft} forwards"]},
                "projected_speedup_with_loop": {str(alpha): tokens_per_step(alpha, gamma) * loop_token / step
                                                for alpha in ALPHAS}}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=20, help="forwards timed in a row, per model and round")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens each decoding loop draws, per round")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--draft-quantize", nargs="+", default=["none"], choices=["none", "int8"],
                        help="the draft's weights: each a draft timed beside the others")
    args = parser.parse_args()
    for batch in args.batch_size:
        report = measure(batch, args.context, args.rounds, args.repeats, args.gamma, args.new_tokens,
                         args.draft_quantize)
        print(json.dumps({"threads": torch.get_num_threads(), **report}), flush=True)
        ms, loop = report["ms"], report["loop_ms"]
        print(f"batch {batch}: ms per forward, eager / compiled: target token {ms['eager target token']:.2f} / "
              f"{ms['compiled target token']:.2f}, verification {ms['eager verification']:.2f} / "
              f"{ms['compiled verification']:.2f}")
        for quantization in args.draft_quantize:
            draft = draft_name(quantization)
            print(f"  {draft}: proposal of {args.gamma} tokens {ms[f'eager {draft} draw']:.2f} / "
                  f"{ms[f'compiled {draft} draw']:.2f} ms")
            for mode in ("eager", "compiled"):
                part = report[f"{mode}, {draft}"]
                projected = ", ".join(f"alpha {alpha}: {value:.2f}x"
                                      for alpha, value in part["projected_speedup"].items())
                print(f"    {mode}: draft token {part['draft_token_in_target_tokens']:.2f}, verification "
                      f"{part['verification_in_target_tokens']:.2f} target tokens; projected {projected}")
                with_loop = ", ".join(f"alpha {alpha}: {value:.2f}x"
                                      for alpha, value in part["projected_speedup_with_loop"].items())
                print(f"    {mode} loops: target {loop[mode + ' token']:.2f} ms/token, speculative "
                      f"{loop[f'{mode} {draft}']:.2f} ms/step ({part['step_in_loop_tokens']:.2f} tokens); "
                      f"projected {with_loop}")
                inside = part["in_loop_ms"]
                print(f"    {mode} step inside the loop: forwards (proposal and verification) "
                      f"{inside['forwards']:.2f}, between them {inside['between']:.2f} ms")


if __name__ == "__main__":
    main()
