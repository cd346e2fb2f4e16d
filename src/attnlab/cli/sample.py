"""`attnlab sample RUN --prompt TEXT --max-new-tokens N [--temperature T --top-k K --top-p P --min-p M]
[--dtype bfloat16] [--cache-dtype bfloat16] [--attention-backend NAME] [--compile]`"""

from __future__ import annotations

import argparse
import itertools
import sys

from attnlab.cli import arguments
from attnlab.errors import ConfigError


def register(subparsers) -> None:
    parser = subparsers.add_parser("sample", help="generate text from a trained run, streamed (a tokenized "
                                   "run stops at its end token)")
    parser.add_argument("run", help="run directory or checkpoint file")
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--max-new-tokens", type=arguments.count, default=256)
    arguments.add_sampling(parser)
    parser.add_argument("--seed", type=arguments.seed, default=0)
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole prefix each token (slow path)")
    parser.add_argument("--weights", choices=["auto", "model", "ema"], default="auto")
    parser.add_argument("--device", type=arguments.device, default="cpu")
    arguments.add_decoding_dtype(parser)
    arguments.add_cache_dtype(parser)
    arguments.add_attention_backend(parser)
    parser.add_argument("--compile", action="store_true",
                        help="decode with a compiled step (torch.compile; CUDA graphs on a GPU; on a CPU the step "
                        "inductor stores in its cache, so later runs compile in seconds)")
    parser.set_defaults(func=run)


def check_options(args: argparse.Namespace) -> None:
    """ConfigError naming an option --no-cache would ignore: --compile and --cache-dtype are the cache's
    (the uncached path re-runs the whole sequence eagerly and stores no keys or values)."""
    given = [option for option, value in (("--compile", args.compile), ("--cache-dtype", args.cache_dtype)) if value]
    if args.no_cache and given:
        raise ConfigError(f"{', '.join(given)}: not read with --no-cache (decoding without the cache)")


def run(args: argparse.Namespace) -> int:
    check_options(args)
    import torch

    from attnlab.data.corpus import encode_prompt, tokenizer_for
    from attnlab.generate.sampling import SamplingConfig, stream_text
    from attnlab.train.checkpoint import load_model
    from attnlab.train.portable import run_directory

    device = arguments.usable_device(args.device)
    model = load_model(args.run, device=device, weights=args.weights, dtype=getattr(torch, args.dtype),
                       attention_backend=args.attention_backend)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    tokenizer = tokenizer_for(model.run_config.data, run_directory(args.run))  # None: a byte-level run
    prompt = torch.tensor([encode_prompt(tokenizer, args.prompt)], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    if args.compile:
        # A one-off sample pays its compilation in full: on a CPU, the step with ATen's products, which
        # inductor's cache keeps for the next process (a packed step, faster by a tenth a token,
        # compiles again in every process: docs/benchmarks.md "Compile time"); the GPU's own default.
        model.compile_decoding(linear="library" if torch.device(device).type == "cpu" else None)
    pieces = stream_text(model, prompt, args.max_new_tokens, sampling, not args.no_cache, generator, tokenizer,
                         args.compile, args.cache_dtype and getattr(torch, args.cache_dtype))
    # the first piece before any output: a refused prompt (too long, past the vocabulary) or a cache
    # that does not fit is one line on stderr, not an error after the echoed prompt on stdout
    first = next(pieces)
    # a prompt from the command line may hold bytes that are not UTF-8 (as surrogates): shown replaced
    sys.stdout.write(args.prompt.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
    for piece in itertools.chain([first], pieces):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
