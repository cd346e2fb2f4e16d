"""Cached decoding of every attention type, eager and with the compiled decode step
(Transformer.compile_decoding), side by side in one process: tokens/s at two prompt lengths, the
compiled step's speed-up, and how much a token's cost grows from the short prompt to the long one.

Each model decodes --new-tokens tokens with top-k sampling after a random prompt, eager and compiled
in turn, round by round, each round's order of the steps one place further along (the compiled
step's compilation happens in an untimed warm-up round);
medians of the per-round medians. A token is what generate() spends on it: a uniform drawn, then
one decode_then call, the forward and the draw (in the compiled step's graph when compiled; until
revision 4b717ae the script timed the forward and a sample_from after it, outside the graph).
--also adds other compiled steps, side by side: `library` (the
products with the weights through ATen's library calls instead of the packed kernels,
compile_decoding(linear="library")), `python-wrapper` (the step called from inductor's Python
wrapper instead of its C++ one, compile_decoding(cpp_wrapper=False)), `torch-attention` (every
kind's cached calls by torch's attention, or its gathered keys, NSA's compressed branch over every
slot of its storage, instead of the cpu back-end's operators, attention.<kind>.backend=torch),
`bfloat16-cache` (the default step over a cache that stores its keys and values in bfloat16,
new_cache(dtype=torch.bfloat16), beside the weights' dtype), `bfloat16` (the default step of the
model cast to bfloat16, weights and cache: `attnlab sample --dtype bfloat16`), `dynamo-calls` (every
step through dynamo's frame evaluation, most guards skipped, instead of the code dynamo made for it
called directly, compile_decoding(direct_calls=False)), `separate-products` (the default step with
a layer's queries, keys and values made by three products, as before revision 0e8353d, instead of
one over their weights concatenated: CONCATENATED_PRODUCTS off), `parallel-elementwise` (the default
step with its elementwise loops on every thread as inductor decides, compile_decoding(elementwise=
"parallel"), instead of one). --dtype: every
model's weights and caches (float32 unless told). --spare: each cache's storage holds that many
positions beyond the prompt and the new tokens (a cache made for a longer text than the one
decoded: a step whose cost follows the storage, not the position, shows it).

    OMP_NUM_THREADS=2 python bench/compiled_decoding.py --context 256 4096 --new-tokens 128 --rounds 3 --also library \
        [--spare 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from attnlab.bench.measure import model_config_from
from attnlab.cli import arguments  # the decoding commands' --dtype names (bf16 too)
from attnlab.generate.sampling import SamplingConfig, draw_last
from attnlab.model import Transformer, decode_compile

MODEL = dict(dim=256, depth=4, heads=4, dim_head=64)
WINDOW = dict(local={"window_size": 64}, routing={"window_size": 64}, sinkhorn={"bucket_size": 64},
              nsa={"sliding_window_size": 64, "compress_block_size": 16, "compress_stride": 8,
                   "selection_block_size": 16, "num_selected": 4})
KV_HEADS = {"nsa": 2}  # NSA shares its selection over a key/value group
SAMPLING = SamplingConfig(top_k=26)
# compile_decoding's arguments of the other compiled steps --also can add, their attention's settings,
# their cache's dtype or their model's
OTHER_STEPS = {"library": {"linear": "library"}, "python-wrapper": {"cpp_wrapper": False},
               "torch-attention": {"backend": "torch"}, "bfloat16-cache": {"cache_dtype": torch.bfloat16},
               "bfloat16": {"model_dtype": torch.bfloat16}, "dynamo-calls": {"direct_calls": False},
               "separate-products": {"separate_products": True}, "parallel-elementwise": {"elementwise": "parallel"}}
BACKEND_KINDS = ("full", "local", "routing", "sinkhorn", "nsa")  # the kinds whose cached calls have a cpu back-end


def build(kind: str, max_len: int, variant: str, dtype: torch.dtype = torch.float32) -> Transformer:
    """variant: eager, compiled (compile_decoding's defaults) or one of OTHER_STEPS."""
    step = dict(OTHER_STEPS.get(variant, {}))
    attention = {"kind": kind, **WINDOW}
    backend = step.pop("backend", None)
    step.pop("cache_dtype", None)  # ms_per_token's
    dtype = step.pop("model_dtype", dtype)
    if backend is not None and kind in BACKEND_KINDS:
        attention[kind] = {**attention.get(kind, {}), "backend": backend}
    values = {**MODEL, "kv_heads": KV_HEADS.get(kind), "max_seq_len": max_len, "attention": attention}
    torch.manual_seed(0)
    model = Transformer(model_config_from(values)).to(dtype).eval()
    if variant == "eager":
        return model
    with separate_products() if step.pop("separate_products", False) else contextlib.nullcontext():
        model.compile_decoding(**step)
    return model


@contextlib.contextmanager
def separate_products():
    """compile_decoding's packed options without CONCATENATED_PRODUCTS, for the time of the context
    (the options are read when it is called; the step compiles later with them)."""
    original = decode_compile.packed_linear_options
    decode_compile.packed_linear_options = lambda: dict(decode_compile.PACKED_LINEAR_OPTIONS)
    try:
        yield
    finally:
        decode_compile.packed_linear_options = original


@torch.inference_mode()
def ms_per_token(model: Transformer, prompt: torch.Tensor, new_tokens: int, seed: int,
                 cache_dtype: torch.dtype | None = None, spare: int = 0) -> float:
    """Median ms of one sampled token after the prompt: its uniform and one decode_then call, the
    forward of the last token and the draw of the next (generate.sampling.stream's step)."""
    generator = torch.Generator().manual_seed(seed)
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + new_tokens + spare, dtype=cache_dtype)
    uniform = torch.rand(prompt.shape[0], generator=generator)
    token, _ = model.decode_then(draw_last, prompt, cache, SAMPLING, uniform)  # the prefill, eager
    times = []
    for _ in range(new_tokens):
        started = time.perf_counter()
        uniform = torch.rand(prompt.shape[0], generator=generator)  # [B]
        token, _ = model.decode_then(draw_last, token[:, None], cache, SAMPLING, uniform)  # [B]
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def rotated(models: dict, variants: tuple[str, ...], round_: int) -> list[tuple[str, int, str]]:
    """The models' keys in a round's order: each kind and context in turn, its variants starting one
    further along each round, so that no variant always runs right after the same other one (in a
    run with a fixed order, one step timed in two slots differed by up to 11%: docs/benchmarks.md,
    "Compiled decoding")."""
    shift = round_ % len(variants)
    order = variants[shift:] + variants[:shift]
    groups = dict.fromkeys((kind, context) for kind, context, _ in models)
    return [(kind, context, variant) for kind, context in groups for variant in order]


def measure(kinds: list[str], contexts: list[int], new_tokens: int, rounds: int, variants: tuple[str, ...],
            dtype: torch.dtype, spare: int = 0) -> dict:
    models = {(kind, context, variant): build(kind, context + new_tokens + spare, variant, dtype)
              for kind in kinds for context in contexts for variant in variants}
    prompts = {context: torch.randint(0, 256, (1, context), generator=torch.Generator().manual_seed(context))
               for context in contexts}
    times = {key: [] for key in models}
    for round_ in range(rounds + 1):  # round 0 warms up (and compiles)
        for kind, context, variant in rotated(models, variants, round_):
            model = models[kind, context, variant]
            cache_dtype = OTHER_STEPS.get(variant, {}).get("cache_dtype")
            elapsed = ms_per_token(model, prompts[context], new_tokens, seed=round_, cache_dtype=cache_dtype,
                                   spare=spare)
            if round_:
                times[kind, context, variant].append(elapsed)
    return {f"{kind} {context} {variant}": statistics.median(values)
            for (kind, context, variant), values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", nargs="+", default=["full", "local", "routing", "sinkhorn", "nsa"])
    parser.add_argument("--context", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--also", nargs="*", default=[], choices=sorted(OTHER_STEPS),
                        help="other compiled steps, side by side with the default one")
    parser.add_argument("--dtype", type=arguments.dtype, default="float32",
                        help="every model's weights and caches")
    parser.add_argument("--spare", type=int, default=0, help="cache positions beyond the prompt and new tokens")
    args = parser.parse_args()
    variants = ("eager", "compiled", *args.also)
    medians = measure(args.attention, args.context, args.new_tokens, args.rounds, variants, getattr(torch, args.dtype),
                      args.spare)
    print(json.dumps({"threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "rounds": args.rounds,
                      "dtype": args.dtype, "spare": args.spare, "ms_per_token": medians}), flush=True)
    short, long = args.context[0], args.context[-1]
    print(f"\nms/token (tokens/s), top-k {SAMPLING.top_k}, median of {args.rounds} rounds")
    print(f"| attention | eager {short} | compiled {short} | speed-up | eager {long} | compiled {long} | speed-up "
          f"| compiled growth {short} -> {long} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for kind in args.attention:
        cells = []
        for context in (short, long):
            eager, compiled = medians[f"{kind} {context} eager"], medians[f"{kind} {context} compiled"]
            cells += [f"{eager:.2f} ({1e3 / eager:.0f})", f"{compiled:.2f} ({1e3 / compiled:.0f})",
                      f"{eager / compiled:.2f}x"]
        growth = medians[f"{kind} {long} compiled"] / medians[f"{kind} {short} compiled"]
        print(f"| {kind} | " + " | ".join(cells) + f" | {growth:.2f}x |")
    for other in args.also:
        print(f"\nms/token of the compiled step: compile_decoding's defaults against {other} "
              f"({OTHER_STEPS[other]})")
        print(f"| attention | context | defaults | {other} | {other} / defaults |")
        print("|---|---:|---:|---:|---:|")
        for kind in args.attention:
            for context in args.context:
                default, changed = medians[f"{kind} {context} compiled"], medians[f"{kind} {context} {other}"]
                print(f"| {kind} | {context} | {default:.2f} | {changed:.2f} | {changed / default:.2f}x |")


if __name__ == "__main__":
    main()
