"""Side-by-side speedups of several drafts of one target, in one process: round after round, each
draft in turn times the target's own cached decoding and then speculative decoding from the same
validation prime with the same seed, back to back. Each pair gives one speedup (base ms /
speculative ms), so a slow spell of a shared machine slows both sides of it alike; the figure
per draft is the median over rounds of these paired speedups (with the medians of the times and of
the tokens committed per step). The drafts are interleaved, so they see the same spells.

    python bench/speculative_ab.py TARGET_RUN NAME=DRAFT_RUN[:int8[/PRODUCT]] [NAME=...] [--rounds 9]
        [--batch-size 1] [--batch-scheme auto [shared ...]] [--temperature 1] [--top-k K] [--gamma 5 [6 ...]]
        [--max-new-tokens 256] [--compile [--target-linear default [packed ...]] [--prefill-chunk eager [64 ...]]]
        [--dtype bfloat16] [--verification block [token]]

--gamma with several values: each draft decodes at each of them, every (draft, gamma) pair a
variant of its own in the rounds (named NAME, or NAME@GAMMA with several gammas), so draft lengths
are compared side by side as drafts are. --verification with several rules (speculative.py's
VERIFICATIONS) does the same for the rules (NAME/RULE), --batch-scheme with several for the ways a
batch's caches roll back (NAME+SCHEME; at batch 1 the schemes are one algorithm, drawing the same
tokens: per-row commits a step inside the compiled step, the shared window between steps).
--target-linear with several kernels (compile_decoding's `linear`: LINEAR_KERNELS, or "default")
compiles a target for each, so the target's product kernels are compared side by side
(NAME~KERNEL), each variant's base decoding with its own target. --prefill-chunk with several values
(compile_decoding's prefill_chunk: "eager", or the chunk C of a prefill by the compiled step) sets
every model's prefill so for the variant (NAME^C), its base's too: the models and their other
graphs are shared.

:int8 quantizes a draft's weights (model/quantize.py), /PRODUCT names the kernel its products
take (PRODUCTS: cpu, torch, dequantized; default: each call's, Int8Linear.product_for), so kernels
are compared side by side as drafts are.

--compile: the target and every draft decode with compiled steps (Transformer.compile_decoding),
the base decoding too; the warm-up round makes the graphs, so the timed rounds run them. --dtype:
every model decodes in it (weights and caches), the base too.

Each round also times the two prefills alone (compiled_speculative_costs.prefill_ms: the base's
target over the prime, the speculative run's target and draft over the prime less its last token,
as the runs make them: eagerly, or by the compiled step with --prefill-chunk): `decoding_speedup`
is the paired speedup with them taken off both sides, that of the decoding alone, where `speedup`
counts the prefill both sides pay.

One JSON line per round and draft, then one summary line per draft. `attnlab speculative` times
one draft the same way (alternating base and speculative runs) and reports medians of each side.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
from compiled_speculative_costs import prefill_ms  # this folder's: a prompt's prefill, timed alone

from attnlab.bench.speculative import rollback_scheme  # --batch-scheme -> per_row
from attnlab.cli import arguments  # the decoding commands' --dtype names (bf16 too)
from attnlab.data.corpus import load_corpus
from attnlab.data.sampler import eval_windows
from attnlab.generate.sampling import SamplingConfig, generate
from attnlab.generate.speculative import VERIFICATIONS, speculative_generate
from attnlab.model.decode_compile import LINEAR_KERNELS
from attnlab.model.quantize import PRODUCTS, choose_products, decoding_products, quantize_weights
from attnlab.train.checkpoint import load_model


def parse_draft(text: str) -> tuple[str, str, str, str | None]:
    """NAME=RUN[:int8[/PRODUCT]] -> (name, run, quantization, product or None)."""
    name, _, run = text.partition("=")
    run, _, quantization = run.partition(":")
    quantization, _, product = quantization.partition("/")
    if not name or not run or (product and (quantization != "int8" or product not in PRODUCTS)):
        raise argparse.ArgumentTypeError(f"expected NAME=DRAFT_RUN[:int8[/PRODUCT]] (PRODUCT one of "
                                         f"{', '.join(PRODUCTS)}), got {text!r}")
    return name, run, quantization or "none", product or None


def prefill_chunk(text: str) -> int | None:
    """--prefill-chunk's value: "eager" -> None, or a positive number of tokens."""
    if text == "eager":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a prefill chunk is 'eager' or a positive number of tokens, got {text!r}")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("drafts", nargs="+", type=parse_draft, metavar="NAME=DRAFT_RUN[:int8[/PRODUCT]]")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--batch-scheme", nargs="+", choices=["auto", "per-row", "shared"], default=["auto"],
                        help="how a batch's caches roll back; several: variants")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--gamma", type=int, nargs="+", default=[5], help="draft tokens a step; several: variants")
    parser.add_argument("--verification", nargs="+", choices=list(VERIFICATIONS), default=["block"],
                        help="the rule a step's draft tokens are kept by; several: variants")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--prime-length", type=int, default=128)
    parser.add_argument("--compile", action="store_true", help="compiled decoding for every model, the base's too")
    parser.add_argument("--target-linear", nargs="+", choices=["default", *LINEAR_KERNELS], default=["default"],
                        help="with --compile: the target's product kernels (compile_decoding's linear); several: "
                             "variants, a target compiled for each")
    parser.add_argument("--prefill-chunk", nargs="+", type=prefill_chunk, default=[None], metavar="eager|C",
                        help="with --compile: prefills by the compiled step C tokens at a time (compile_decoding's "
                             "prefill_chunk), or eager; several: variants")
    parser.add_argument("--dtype", type=arguments.dtype, default="float32",
                        help="every model's weights and caches, the base's too")
    parser.add_argument("--dynamo-calls", action="store_true",
                        help="with --compile: every compiled call through dynamo's frame evaluation "
                             "(compile_decoding(direct_calls=False)), as before revision 265678e")
    args = parser.parse_args()

    if args.target_linear != ["default"] and not args.compile:
        parser.error("--target-linear chooses compiled kernels: it needs --compile")
    if args.prefill_chunk != [None] and not args.compile:
        parser.error("--prefill-chunk prefills by the compiled step: it needs --compile")
    dtype = getattr(torch, args.dtype)
    targets = {linear: load_model(args.target, dtype=dtype).eval() for linear in args.target_linear}
    drafts = {}
    for name, run, quantization, product in args.drafts:
        drafts[name] = load_model(run, dtype=dtype).eval()
        quantize_weights(drafts[name], quantization)
        choose_products(drafts[name], product)
    if args.compile:
        kernels = [(model, None) for model in drafts.values()]
        kernels += [(model, None if linear == "default" else linear) for linear, model in targets.items()]
        for model, linear in kernels:
            if not model.compile_decoding(direct_calls=not args.dynamo_calls, linear=linear):
                raise SystemExit("compiled decoding is unavailable here (the warning above says why)")
    corpus = load_corpus(next(iter(targets.values())).run_config.data)
    # the primes `attnlab speculative --prime-from-val` uses
    prompt = eval_windows(corpus.val, args.prime_length, args.batch_size, seed=0)[:, : args.prime_length].long()
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k)

    def base(target, seed: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            generate(target, prompt, args.max_new_tokens, sampling, generator=torch.Generator().manual_seed(seed))
        return time.perf_counter() - started

    def speculative(target, draft, gamma: int, verification: str, scheme: str, seed: int):
        started = time.perf_counter()
        result = speculative_generate(target, draft, prompt, args.max_new_tokens, gamma, sampling,
                                      generator=torch.Generator().manual_seed(seed),
                                      per_row=rollback_scheme(scheme),
                                      verification=verification)
        return time.perf_counter() - started, result

    def prefills(target, draft) -> tuple[float, float]:
        """ms of the base's prefill and of the speculative run's, each through fresh caches."""
        with torch.inference_mode():
            return (prefill_ms([target], prompt, args.max_new_tokens),
                    prefill_ms([target, draft], prompt[:, :-1], args.max_new_tokens))

    # every (draft, gamma, rule, scheme, target's kernels, prefill chunk) is a variant timed in each round
    variants = {}
    for name, gamma, verification, scheme, linear, chunk in itertools.product(
            drafts, args.gamma, args.verification, args.batch_scheme, args.target_linear, args.prefill_chunk):
        variant = name + (f"@{gamma}" if len(args.gamma) > 1 else "")
        variant += f"/{verification}" if len(args.verification) > 1 else ""
        variant += f"+{scheme}" if len(args.batch_scheme) > 1 else ""
        variant += f"~{linear}" if len(args.target_linear) > 1 else ""
        variant += f"^{chunk or 'eager'}" if len(args.prefill_chunk) > 1 else ""
        variants[variant] = (name, gamma, verification, scheme, linear, chunk)

    def prefill_by(chunk: int | None, *models) -> None:
        for model in models:  # None on an eager model: it prefills eagerly anyway
            model.prefill_chunk = chunk

    for name, gamma, verification, scheme, linear, chunk in variants.values():  # warm-up: first calls, the graphs
        prefill_by(chunk, targets[linear], drafts[name])
        base(targets[linear], 0)
        speculative(targets[linear], drafts[name], gamma, verification, scheme, 0)
    rows = {variant: [] for variant in variants}
    for round_index in range(args.rounds):
        for variant, (name, gamma, verification, scheme, linear, chunk) in variants.items():
            prefill_by(chunk, targets[linear], drafts[name])
            base_s = base(targets[linear], round_index)
            speculative_s, result = speculative(targets[linear], drafts[name], gamma, verification, scheme,
                                                round_index)
            base_prefill, speculative_prefill = prefills(targets[linear], drafts[name])  # ms
            row = {"round": round_index, "draft": name, "gamma": gamma, "verification": verification,
                   "batch_scheme": scheme, "target_linear": linear, "prefill_chunk": chunk,
                   "per_row": result.per_row,
                   "base_ms": round(1000 * base_s, 1),
                   "speculative_ms": round(1000 * speculative_s, 1), "speedup": round(base_s / speculative_s, 3),
                   "prefill_ms": [round(base_prefill, 1), round(speculative_prefill, 1)],
                   "decoding_speedup": round((1000 * base_s - base_prefill)
                                             / (1000 * speculative_s - speculative_prefill), 3),
                   "tokens_per_step": round(args.max_new_tokens / result.n_steps, 3)}
            rows[variant].append(row)
            print(json.dumps(row), flush=True)
    settings = {"batch_size": args.batch_size, "temperature": args.temperature,
                "top_k": args.top_k, "max_new_tokens": args.max_new_tokens,
                "rounds": args.rounds, "threads": torch.get_num_threads(), "compiled": args.compile,
                "dtype": args.dtype, "direct_calls": args.compile and not args.dynamo_calls}
    for variant, collected in rows.items():
        name, gamma, verification, scheme, linear, chunk = variants[variant]
        medians = {key: round(statistics.median(row[key] for row in collected), 3)
                   for key in ("speedup", "decoding_speedup", "base_ms", "speculative_ms", "tokens_per_step")}
        products = {"target": decoding_products(targets[linear], args.compile),
                    "draft": decoding_products(drafts[name], args.compile)}
        print(json.dumps({"summary": variant, **settings, "batch_scheme": scheme, "gamma": gamma,
                          "target_linear": linear, "prefill_chunk": chunk,
                          "verification": verification, **medians,
                          "products": products,
                          "speedups": [row["speedup"] for row in collected]}), flush=True)


if __name__ == "__main__":
    main()
