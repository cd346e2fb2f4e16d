"""`attnlab speculative`: speculative decoding against the target's own cached decoding, and
training a draft with its target.

    attnlab speculative --target RUN (--draft RUN | --early-exit K) [--gamma 5]
        (--prompt TEXT | --prime-from-val) [--batch-size B] [--max-new-tokens N] [--repeats R]
        [--temperature T --top-k K --top-p P --min-p M] [--draft-quantize int8] [--json]
    attnlab speculative train (--target-preset P | --target RUN [--draft-steps N]) --draft-preset Q [--distill W]
        [key.path=value (both) | target.key.path=value | draft.key.path=value ...] [--resume]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from attnlab.config import known_presets, load_config
from attnlab.errors import AttnlabError
from attnlab.generate.sampling import SamplingConfig, generate
from attnlab.generate.speculative import EarlyExitDraft, speculative_generate
from attnlab.model.linear import decoding_products
from attnlab.model.quantize import QUANTIZATIONS, quantize_weights
from attnlab.train.checkpoint import load_model
from attnlab.train.draft import existing_target_settings, split_overrides, train_pair

log = logging.getLogger(__name__)


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
        "--early-exit", type=int, metavar="K", help="self-speculative: the target's first K layers are the draft"
    )
    parser.add_argument("--gamma", type=int, default=5, help="draft tokens per step")
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", default=None, help="text to continue (the same for every row)")
    prompts.add_argument(
        "--prime-from-val", action="store_true", help="continue windows of the target's validation data"
    )
    parser.add_argument("--prime-length", type=int, default=128, help="tokens of each validation prime")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--batch-scheme", choices=["auto", "per-row", "shared"], default="auto",
        help="how rows of a batch roll back: per-row (each to its own length; every built-in cache), shared "
        "(all to the shortest committed prefix; any cache), auto (per-row where both models can)",
    )
    parser.add_argument(
        "--draft-quantize", choices=list(QUANTIZATIONS), default="none",
        help="int8: the draft's linear layers keep int8 weights (a quarter of the bytes to read per token); the "
        "output distribution is the target's either way (model/quantize.py)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each decoder; medians reported")
    parser.add_argument("--weights", choices=["auto", "model", "ema"], default="auto")
    parser.add_argument("--device", default="cpu")
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
        "--distill", type=float, default=None, metavar="W",
        help="train the draft toward the target's distribution too: its loss is (1 - W) cross-entropy + W "
        "KL(target || draft), from the target's final checkpoint (train.distill_from / distill_weight)",
    )
    trainer.add_argument(
        "--draft-steps", type=int, default=None, metavar="N",
        help="with --target RUN: train the draft for N steps (default: the target's), on the target's batches "
        "and then the ones that follow them",
    )
    trainer.add_argument("overrides", nargs="*", metavar="key.path=value")
    trainer.set_defaults(func=run_train)


# --------------------------------------------------------------------------------------------
# Decoding


def timed(function: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """(result, wall-clock seconds), synchronising CUDA before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = function()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - started


def build_prompt(args: argparse.Namespace, target, tokenizer) -> torch.Tensor:
    """[batch, T] prompt tokens: the text repeated per row, or one validation prime per row (a window
    of byte data; the beginning of a document of tokenized data, all cut to the shortest)."""
    if args.prime_from_val:
        from attnlab.data.corpus import load_corpus
        from attnlab.data.sampler import eval_windows, prime_tokens

        corpus = load_corpus(target.run_config.data)
        if hasattr(corpus.val, "prime"):  # tokenized documents
            primes = [prime_tokens(corpus.val, args.prime_length, seed=args.seed + row)
                      for row in range(args.batch_size)]
            length = min(len(prime) for prime in primes)
            return torch.stack([prime[:length] for prime in primes]).long().to(args.device)
        windows = eval_windows(corpus.val, args.prime_length, args.batch_size, seed=args.seed)
        return windows[:, : args.prime_length].long().to(args.device)
    from attnlab.data.corpus import encode_prompt

    tokens = encode_prompt(tokenizer, args.prompt if args.prompt is not None else "")
    return torch.tensor([tokens] * args.batch_size, device=args.device)


def warn_beyond_training(model, name: str, length: int) -> bool:
    """Warn (and return True) when decoding reaches past the windows `model` was trained on: its
    predictions there are extrapolated, and they degrade fast (a byte model trained on 128 tokens
    gives about twice the bits per byte at positions 256-383), and so does the draft's agreement
    with the target (docs/speculative.md)."""
    config = getattr(model, "run_config", None)
    if config is None or length <= config.train.seq_len:
        return False
    log.warning("warning: the %s was trained on windows of %d tokens, and this decoding reaches %d; past %d its "
                "predictions are extrapolated and degrade", name, config.train.seq_len, length, config.train.seq_len)
    return True


def run(args: argparse.Namespace) -> int:
    if args.target is None or (args.draft is None and args.early_exit is None):
        raise AttnlabError("give --target RUN and --draft RUN (or --early-exit K); or use `speculative train`")
    if args.gamma < 1 or args.batch_size < 1 or args.max_new_tokens < 1 or args.repeats < 1:
        raise AttnlabError("--gamma, --batch-size, --max-new-tokens and --repeats must be >= 1")
    if args.early_exit is not None and args.draft_quantize != "none":
        raise AttnlabError("--draft-quantize needs a draft of its own (--draft RUN): an early-exit draft's layers are "
                           "the target's")
    from attnlab.data.byte_corpus import decode_bytes

    device = torch.device(args.device)
    target = load_model(args.target, device=device, weights=args.weights)
    if args.early_exit is not None:
        draft = EarlyExitDraft(target, args.early_exit)
        draft_name = f"early exit after layer {args.early_exit} of the target"
    else:
        draft = load_model(args.draft, device=device, weights=args.weights)
        draft_name = str(args.draft)
        if draft.config.num_tokens != target.config.num_tokens:
            raise AttnlabError("draft and target must share a vocabulary (model.num_tokens)")
        if quantize_weights(draft, args.draft_quantize):
            draft_name += f" ({args.draft_quantize} weights)"
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    from attnlab.data.corpus import tokenizer_for

    tokenizer = tokenizer_for(target.run_config.data)  # None: a byte-level run
    decode = decode_bytes if tokenizer is None else tokenizer.decode
    prompt = build_prompt(args, target, tokenizer)  # [B, T]
    n_new = args.max_new_tokens
    warn_beyond_training(target, "target", prompt.shape[1] + n_new)
    warn_beyond_training(draft, "draft", prompt.shape[1] + n_new)

    per_row = {"auto": None, "per-row": True, "shared": False}[args.batch_scheme]
    if per_row and not all(getattr(model.new_cache(1), "per_row_rollback", False) for model in (target, draft)):
        raise AttnlabError("--batch-scheme per-row needs caches that roll back per row (per_row_rollback) in "
                           "both models; use auto or shared")

    def base(seed: int) -> torch.Tensor:
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.inference_mode():  # the same mode speculative_generate runs in
            return generate(target, prompt, n_new, sampling, generator=generator)

    def speculative(seed: int):
        generator = torch.Generator(device=device).manual_seed(seed)
        return speculative_generate(
            target, draft, prompt, n_new, args.gamma, sampling, generator=generator, per_row=per_row
        )

    # warm-up of both paths (allocator, first-call costs), then alternating timed runs
    base(args.seed)
    speculative(args.seed)
    base_times, speculative_times, results = [], [], []
    for repeat in range(args.repeats):
        base_tokens, seconds = timed(lambda: base(args.seed + repeat), device)  # noqa: B023
        base_times.append(seconds)
        result, seconds = timed(lambda: speculative(args.seed + repeat), device)  # noqa: B023
        speculative_times.append(seconds)
        results.append(result)
        if repeat == 0:
            first_base, first_result = base_tokens, result
    base_seconds, speculative_seconds = statistics.median(base_times), statistics.median(speculative_times)
    n_tokens = args.batch_size * n_new
    prompt_length = prompt.shape[1]
    report = {
        "target": str(args.target),
        "draft": draft_name,
        "draft_quantize": args.draft_quantize,
        "device": str(device),
        "gamma": args.gamma,
        "batch_size": args.batch_size,
        "max_new_tokens": n_new,
        "prompt_tokens": prompt_length,
        "sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p},
        "repeats": args.repeats,
        "prompt": decode(prompt[0].tolist()),
        "base": {
            "text": decode(first_base[0, prompt_length:].tolist()),
            "ms": 1000 * base_seconds,
            "ms_all": [1000 * seconds for seconds in base_times],
            "tokens_per_s": n_tokens / base_seconds,
        },
        "speculative": {
            "text": decode(first_result.tokens[0, prompt_length:].tolist()),
            "ms": 1000 * speculative_seconds,
            "ms_all": [1000 * seconds for seconds in speculative_times],
            "tokens_per_s": n_tokens / speculative_seconds,
            "steps": statistics.mean(result.n_steps for result in results),
            "mean_accepted": statistics.mean(result.mean_accepted for result in results),
            "acceptance_rate": statistics.mean(result.acceptance_rate for result in results),
            # one row has nothing to roll back per row: it runs the single-sequence algorithm
            "batch_scheme": "per-row" if results[0].per_row else "shared" if args.batch_size > 1 else "single row",
        },
        # which products the models' linear layers multiply with when decoding (model/linear.py)
        "products": {"target": decoding_products(target, device), "draft": decoding_products(draft, device)},
        "speedup": base_seconds / speculative_seconds,
        # each speculative run against the base run of the same seed just before it: on a shared
        # machine whose speed drifts, the median of these pairs is the steadier figure
        "speedup_paired_median": statistics.median(
            base / speculative for base, speculative in zip(base_times, speculative_times, strict=True)
        ),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    spec = report["speculative"]
    print(f"target {report['target']}, draft {draft_name}, gamma {args.gamma}, batch {args.batch_size} "
          f"({spec['batch_scheme']}), {n_new} new tokens, {args.repeats} repeat(s) on {device}")
    print(f"--- prompt (row 0) ---\n{report['prompt']}")
    print(f"--- base decoding (target, cached) ---\n{report['base']['text']}")
    print(f"--- speculative decoding ---\n{spec['text']}")
    print("---")
    print(f"base:        {report['base']['ms']:9.1f} ms  {report['base']['tokens_per_s']:8.1f} tokens/s")
    print(f"speculative: {spec['ms']:9.1f} ms  {spec['tokens_per_s']:8.1f} tokens/s")
    print(f"speedup {report['speedup']:.2f}x (median of paired runs {report['speedup_paired_median']:.2f}x); "
          f"accepted {spec['mean_accepted']:.2f} / {args.gamma} draft tokens per step "
          f"(acceptance rate {spec['acceptance_rate']:.2f})")
    print(f"products: target {report['products']['target']}, draft {report['products']['draft']}")
    return 0


# --------------------------------------------------------------------------------------------
# Training


def run_train(args: argparse.Namespace) -> int:
    target_overrides, draft_overrides = split_overrides(args.overrides)
    draft_config = load_config(args.draft_preset, draft_overrides)
    command_line = ["attnlab", *sys.argv[1:]]
    if args.target_run is not None:
        target_settings = existing_target_settings(Path(args.target_run), args.overrides)
        target_result, draft_result = train_pair(
            None, draft_config, target_settings=target_settings, resume=args.resume, command_line=command_line,
            distill_weight=args.distill, target_dir=Path(args.target_run), draft_steps=args.draft_steps,
        )
    else:
        target_config = load_config(args.target_preset, target_overrides)
        target_result, draft_result = train_pair(
            target_config, draft_config, resume=args.resume, command_line=command_line, distill_weight=args.distill,
            draft_steps=args.draft_steps,
        )
    for role, result in (("target", target_result), ("draft", draft_result)):
        if result is None:
            continue
        bits = f", validation bits per byte {result.last_eval['val_bpb']:.4f}" if result.last_eval else ""
        print(f"{role}: {result.run_dir} (step {result.step}{bits})")
        if result.interrupted:
            return 130
    target_dir = target_result.run_dir if target_result is not None else args.target_run
    print(f"decode with: attnlab speculative --target {target_dir} --draft {draft_result.run_dir} "
          f"--gamma 5 --prime-from-val")
    return 0
