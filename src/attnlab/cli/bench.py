"""`attnlab bench train|decode`: throughput, memory and decode latency, one fresh process per configuration."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnlab.cli import arguments


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="training throughput/memory and decode latency benchmarks")
    kinds = parser.add_subparsers(dest="bench_kind", metavar="KIND", required=True)
    for name, helptext in [("train", "training tokens/s and peak memory per attention and length"),
                           ("decode", "per-token decode latency with and without the cache, per context")]:
        sub = kinds.add_parser(name, help=helptext)
        sub.add_argument("--attention", nargs="+", default=["full", "local"], help="registered attention kinds")
        sub.add_argument("--dim", type=arguments.positive, default=256)
        sub.add_argument("--depth", type=arguments.positive, default=4)
        sub.add_argument("--heads", type=arguments.positive, default=4)
        sub.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="key=value",
                         help="model config overrides, e.g. attention.local.window_size=64")
        sub.add_argument("--threads", type=arguments.positive, default=2, help="OMP_NUM_THREADS of each worker")
        sub.add_argument("--device", type=arguments.device, default="cpu")
        sub.add_argument("--dtype", type=short_dtype, default="fp32", help="fp32, bf16 or fp16 (or torch's names)")
        sub.add_argument("--out", type=Path, default=None, help="append JSON lines here (its folder made)")
        sub.add_argument("--markdown", type=Path, default=None, help="write the markdown table here (its folder made)")
        if name == "train":
            sub.add_argument("--seq-len", type=arguments.positive, nargs="+", default=[512, 1024, 2048])
            sub.add_argument("--batch-size", type=arguments.positive, default=1)
            sub.add_argument("--steps", type=arguments.positive, default=5, help="measured steps (median reported)")
            sub.add_argument("--warmup", type=arguments.count, default=2)
        else:
            sub.add_argument("--context", type=arguments.positive, nargs="+", default=[64, 256, 1024])
            sub.add_argument("--new-tokens", type=arguments.positive, default=16,
                             help="tokens timed per context (median)")
            sub.add_argument("--no-uncached", action="store_true", help="skip the no-cache baseline")
            sub.add_argument("--compile", action="store_true", help="cached decoding with the compiled step")
            sub.add_argument("--cache-dtype", type=short_dtype, default=None,
                             help="the cache's keys and values in this dtype (default: --dtype's), e.g. bf16")
        sub.set_defaults(func=run)

    suite = kinds.add_parser("suite", help="every registered attention over a range of lengths: report and plots")
    suite.add_argument("--device", type=arguments.device, default="cpu", help="cpu or cuda")
    suite.add_argument("--quick", action="store_true", help="a few small sizes (CI-sized)")
    suite.add_argument("--attention", nargs="+", default=None, help="variants (default: every registered one)")
    suite.add_argument("--threads", type=arguments.positive, default=2)
    suite.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for jsonl, report, plots")
    suite.add_argument("--doc", type=Path, default=None,
                       help="also put the report into this markdown file's bench-suite block (docs/benchmarks.md)")
    suite.set_defaults(func=run)


def short_dtype(text: str) -> str:
    """A dtype as arguments.dtype takes it -> the short name the benchmark records (bf16)."""
    name = arguments.dtype(text)
    return next(short for short, full in arguments.DTYPE_SHORT_NAMES.items() if full == name)


def run(args: argparse.Namespace) -> int:
    from attnlab.bench.runner import decode_jobs, decode_table, model_values, run_jobs, train_jobs, train_table

    if args.bench_kind == "suite":
        check_before_measuring(args)
        return run_suite_command(args)
    results = []
    variants = [model_values(args.dim, args.depth, args.heads, attention, args.overrides)
                for attention in args.attention]  # every one checked before the first is measured
    check_before_measuring(args)  # after the settings: a refused one leaves no output folder made
    for values in variants:
        if args.bench_kind == "train":
            jobs = train_jobs(values, args.seq_len, args.batch_size, args.steps, args.warmup, args.device, args.dtype)
        else:
            jobs = decode_jobs(values, args.context, args.new_tokens, not args.no_uncached, args.device, args.dtype,
                               args.compile, args.cache_dtype)
        for result in run_jobs(jobs, args.threads):
            results.append(result)
            print(json.dumps(result), flush=True)
            if args.out:
                with open(args.out, "a") as handle:
                    handle.write(json.dumps(result) + "\n")
    table = train_table(results) if args.bench_kind == "train" else decode_table(results)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


def check_before_measuring(args: argparse.Namespace) -> None:
    """What would otherwise fail only after the measurements (minutes to hours of them), refused
    first in one line: a device this machine lacks, an output file that cannot be written, a --doc
    with no block to take the report."""
    arguments.usable_device(args.device)
    if args.bench_kind == "suite":
        if args.doc is not None:
            from attnlab.bench.suite import checked_doc

            checked_doc(args.doc)
        return
    for option, path in (("--out", args.out), ("--markdown", args.markdown)):
        if path is not None:
            arguments.check_output_file(option, path)


def run_suite_command(args: argparse.Namespace) -> int:
    import sys

    from attnlab.bench.suite import default_plan, run_suite

    plan = default_plan(args.device, args.quick, args.attention)
    plan.threads = args.threads
    command = "attnlab " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("attnlab") else "attnlab bench suite"
    results = run_suite(plan, args.out, command, progress=sys.stderr.isatty())
    if args.doc is not None:
        from attnlab.bench.suite import update_doc

        update_doc(args.doc, args.out)
    failed = sum("error" in r for r in results)
    print(f"{len(results) - failed} measurements, {failed} failed -> {args.out / 'suite.md'}")
    return 0 if failed == 0 else 1
