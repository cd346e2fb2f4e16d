"""`attnlab speculative`: speculative decoding against the target's own cached decoding, and
training a draft with its target.

    attnlab speculative --target RUN (--draft RUN | --early-exit K) [--gamma 5]
        (--prompt TEXT | --prime-from-val) [--batch-size B] [--max-new-tokens N] [--repeats R]
        [--temperature T --top-k K --top-p P --min-p M] [--draft-quantize int8] [--dtype bfloat16]
        [--cache-dtype bfloat16] [--compile [--prefill-chunk C]] [--json]
    attnlab speculative train (--target-preset P | --target RUN [--draft-steps N]) --draft-preset Q [--distill W]
        [key.path=value (both) | target.key.path=value | draft.key.path=value ...] [--resume]

The comparison is bench/speculative.py, the training train/draft.py: this module parses and prints.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from attnlab.cli import arguments
from attnlab.config import known_presets, load_config
from attnlab.errors import ConfigError

QUANTIZATIONS = ("none", "int8")  # model/quantize.py's, here without importing torch
PRIME_LENGTH = 128  # tokens of a validation prime by default
VERIFICATIONS = ("block", "token")  # generate/speculative.py's rules, here without importing torch


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "speculative",
        help="speculative decoding: compare with the target's own decoding; `speculative train` trains a pair",
        description="Decode with a draft and a target and compare with the target's own cached decoding "
        "(time, tokens/s, speedup, accepted tokens). `attnlab speculative train -h` for training.",
    )
    parser.add_argument("--target", help="target run directory or checkpoint")
    drafts = parser.add_mutually_exclusive_group()
    drafts.add_argument("--draft", help="draft run directory or checkpoint")
    drafts.add_argument(
        "--early-exit", type=arguments.positive, metavar="K",
        help="self-speculative: the target's first K layers are the draft",
    )
    parser.add_argument("--gamma", type=arguments.positive, default=5, help="draft tokens per step")
    parser.add_argument(
        "--verification", choices=list(VERIFICATIONS), default="block",
        help="the rule a step's draft tokens are kept by: block (its prefixes tested as wholes, the longest kept) "
        "or token (each token in turn); the same output distribution, block keeps at least as many",
    )
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", default=None, help="text to continue (the same for every row)")
    prompts.add_argument(
        "--prime-from-val", action="store_true", help="continue windows of the target's validation data"
    )
    parser.add_argument("--prime-length", type=arguments.positive, default=None,
                        help=f"with --prime-from-val: tokens of each validation prime (default {PRIME_LENGTH})")
    parser.add_argument("--max-new-tokens", type=arguments.positive, default=256)
    parser.add_argument("--batch-size", type=arguments.positive, default=1)
    arguments.add_sampling(parser)
    parser.add_argument("--seed", type=arguments.seed, default=0)
    parser.add_argument(
        "--batch-scheme", choices=["auto", "per-row", "shared"], default="auto",
        help="how rows of a batch roll back: per-row (each to its own length), shared (all to the shortest "
        "committed prefix), auto (per-row for batches > 1)",
    )
    parser.add_argument(
        "--draft-quantize", choices=list(QUANTIZATIONS), default="none",
        help="int8: the draft's linear layers keep int8 weights (a quarter of the bytes to read per token); the "
        "output distribution is the target's either way (model/quantize.py)",
    )
    parser.add_argument("--compile", action="store_true",
                        help="both models decode with compiled steps (torch.compile; CUDA graphs on a GPU)")
    parser.add_argument("--prefill-chunk", type=arguments.positive, default=None, metavar="C",
                        help="with --compile: both models prefill the prompt by their compiled step, C tokens at a "
                        "time (one graph more each, for prompts of every length); the base too")
    parser.add_argument("--repeats", type=arguments.positive, default=1,
                        help="timed runs of each decoder; medians reported")
    parser.add_argument("--weights", choices=["auto", "model", "ema"], default="auto")
    parser.add_argument("--device", type=arguments.device, default="cpu")
    arguments.add_decoding_dtype(parser)
    arguments.add_cache_dtype(parser)
    arguments.add_attention_backend(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)

    actions = parser.add_subparsers(dest="action", metavar="train")
    trainer = actions.add_parser(
        "train",
        help="train a target and a draft on the same batches",
        description="Train a target and its draft on the same batches (the draft gets the target's data, "
        "seq_len, batch_size, grad_accum, seed and max_steps), or only a draft for an existing target (--target "
        "RUN). Overrides: key.path=value for both, target.key.path=value or draft.key.path=value for one.",
    )
    targets = trainer.add_mutually_exclusive_group(required=True)
    targets.add_argument("--target-preset", help=f"preset or YAML file of the target: {', '.join(known_presets())}")
    targets.add_argument("--target", dest="target_run", help="an existing target run: train only a draft for it")
    trainer.add_argument("--draft-preset", required=True, help="preset or YAML file of the draft")
    trainer.add_argument("--resume", action="store_true", help="continue both runs from their latest checkpoints")
    trainer.add_argument(
        "--distill", type=arguments.number_in(0, 1, open_low=True), default=None, metavar="W",
        help="train the draft toward the target's distribution too: its loss is (1 - W) cross-entropy + W "
        "KL(target || draft), from the target's final checkpoint (train.distill_from / distill_weight)",
    )
    trainer.add_argument(
        "--draft-steps", type=arguments.positive, default=None, metavar="N",
        help="with --target RUN: train the draft for N steps (default: the target's), on the target's batches "
        "and then the ones that follow them",
    )
    trainer.add_argument("overrides", nargs="*", metavar="key.path=value")
    # the decoding options' defaults: one given before `train` is parsed as decoding's, and refused
    decoding_defaults = {action.dest: action.default for action in parser._actions if action.option_strings
                         and action.dest != "help"}
    trainer.set_defaults(func=run_train, decoding_defaults=decoding_defaults)


# --------------------------------------------------------------------------------------------
# Decoding


def run(args: argparse.Namespace) -> int:
    from attnlab.bench.speculative import SpeculativeBench, run_speculative_bench
    from attnlab.generate.sampling import SamplingConfig

    if args.prime_length is not None and not args.prime_from_val:
        raise ConfigError("--prime-length: read with --prime-from-val only (a --prompt is its own length)")

    bench = SpeculativeBench(
        target=args.target, draft=args.draft, early_exit=args.early_exit, draft_quantize=args.draft_quantize,
        gamma=args.gamma, verification=args.verification, prompt=args.prompt, prime_from_val=args.prime_from_val,
        prime_length=args.prime_length or PRIME_LENGTH,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        sampling=SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p),
        seed=args.seed, batch_scheme=args.batch_scheme, repeats=args.repeats, weights=args.weights,
        device=arguments.usable_device(args.device), dtype=args.dtype, cache_dtype=args.cache_dtype,
        compile=args.compile, prefill_chunk=args.prefill_chunk, attention_backend=args.attention_backend,
    )
    report = run_speculative_bench(bench)
    if args.json:
        print(json.dumps(report))
        return 0
    spec = report["speculative"]
    print(f"target {report['target']}, draft {report['draft']}, gamma {report['gamma']} ({report['verification']} "
          f"verification), batch {report['batch_size']} "
          f"({spec['batch_scheme']}), {report['max_new_tokens']} new tokens, {report['repeats']} repeat(s) on "
          f"{report['device']} in {report['dtype']}")
    print(f"--- prompt (row 0) ---\n{report['prompt']}")
    print(f"--- base decoding (target, cached) ---\n{report['base']['text']}")
    print(f"--- speculative decoding ---\n{spec['text']}")
    print("---")
    print(f"base:        {report['base']['ms']:9.1f} ms  {report['base']['tokens_per_s']:8.1f} tokens/s")
    print(f"speculative: {spec['ms']:9.1f} ms  {spec['tokens_per_s']:8.1f} tokens/s")
    print(f"speedup {report['speedup']:.2f}x (median of paired runs {report['speedup_paired_median']:.2f}x); "
          f"accepted {spec['mean_accepted']:.2f} / {report['gamma']} draft tokens per step "
          f"(acceptance rate {spec['acceptance_rate']:.2f})")
    print(f"products: target {report['products']['target']}, draft {report['products']['draft']}")
    return 0


# --------------------------------------------------------------------------------------------
# Training


def run_train(args: argparse.Namespace) -> int:
    from attnlab.train.draft import existing_target_settings, split_overrides, train_pair
    from attnlab.train.signals import Stopped, exit_status

    given = ["--" + dest.replace("_", "-") for dest, default in args.decoding_defaults.items()
             if getattr(args, dest) != default]
    if given:
        raise ConfigError(f"{', '.join(given)}: options of decoding, given before `train`, which does not read "
                          "them (attnlab speculative train -h lists its own, given after it)")

    target_overrides, draft_overrides = split_overrides(args.overrides)
    draft_config = load_config(args.draft_preset, draft_overrides)
    command_line = ["attnlab", *sys.argv[1:]]
    try:
        if args.target_run is not None:
            target_settings = existing_target_settings(Path(args.target_run), args.overrides)
            target_result, draft_result = train_pair(
                None, draft_config, target_settings=target_settings, resume=args.resume, command_line=command_line,
                distill_weight=args.distill, target_dir=Path(args.target_run), draft_steps=args.draft_steps,
            )
        else:
            target_config = load_config(args.target_preset, target_overrides)
            target_result, draft_result = train_pair(
                target_config, draft_config, resume=args.resume, command_line=command_line,
                distill_weight=args.distill, draft_steps=args.draft_steps,
            )
    except Stopped as stopped:
        print(f"attnlab speculative train: stopped by {stopped} during start-up; nothing to save", file=sys.stderr)
        return exit_status(stopped.signum)
    for role, result in (("target", target_result), ("draft", draft_result)):
        if result is None:
            continue
        bits = f", validation bits per byte {result.last_eval['val_bpb']:.4f}" if result.last_eval else ""
        print(f"{role}: {result.run_dir} (step {result.step}{bits})")
        if result.stop_signal:
            print(f"stopped at step {result.step} by {signal.Signals(result.stop_signal).name}; continue the pair "
                  "with: attnlab speculative train ... --resume")
            return exit_status(result.stop_signal)
    target_dir = target_result.run_dir if target_result is not None else args.target_run
    print(f"decode with: attnlab speculative --target {target_dir} --draft {draft_result.run_dir} "
          f"--gamma 5 --prime-from-val")
    return 0
