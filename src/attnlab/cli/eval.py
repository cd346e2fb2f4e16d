"""`attnlab eval RUN [--json] [--data FILE] [--windows N | --full]`: loss, bits per byte, perplexity.
`attnlab eval RUN --tasks A,B [--include-path DIR] [--limit N] [--num-fewshot K]`: lm-eval benchmarks."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from attnlab.cli import arguments
from attnlab.errors import ConfigError


def register(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="validation loss, bits per byte and perplexity of a run, or "
                                   "lm-eval benchmarks (--tasks)")
    parser.add_argument("run", help="run directory or checkpoint file")
    parser.add_argument("--data", default=None, help="evaluate on this file's validation split instead")
    parser.add_argument("--windows", type=arguments.positive, default=64, help="number of validation windows")
    parser.add_argument("--full", action="store_true", help="the whole validation split, every target once "
                        "(consecutive windows, or every document), instead of --windows sampled windows")
    parser.add_argument("--seq-len", type=arguments.positive, default=None, help="window length (default: the run's)")
    parser.add_argument("--batch-size", type=arguments.positive, default=8)
    parser.add_argument("--seed", type=arguments.seed, default=1234,
                        help="which windows (fixed: results are deterministic)")
    parser.add_argument("--weights", choices=["auto", "model", "ema"], default="auto")
    parser.add_argument("--device", type=arguments.device, default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    benchmarks = parser.add_argument_group("lm-eval benchmarks (pip install 'attnlab[eval]')")
    benchmarks.add_argument("--tasks", default=None, metavar="A,B",
                            help="lm-eval task, group or tag names (or YAML files), comma-separated: runs lm-eval's "
                            "Hugging Face model on the exported run; results JSON in RUN/lm-eval/")
    benchmarks.add_argument("--include-path", default=None, metavar="DIR", help="a folder of YAML tasks of your own")
    benchmarks.add_argument("--limit", type=arguments.positive, default=None,
                            help="at most this many examples per task")
    benchmarks.add_argument("--num-fewshot", type=arguments.count, default=None,
                            help="few-shot examples (default: the task's)")
    parser.set_defaults(func=run)


# options only one kind of evaluation reads (those with a default of None or False, so that giving
# them is seen): the other refuses them rather than run without them
LOSS_OPTIONS = ("data", "full", "seq_len")
BENCHMARK_OPTIONS = ("include_path", "limit", "num_fewshot")


def check_options(args: argparse.Namespace) -> None:
    """ConfigError naming an option the chosen evaluation (loss, or --tasks benchmarks) would ignore."""
    unread = LOSS_OPTIONS if args.tasks else BENCHMARK_OPTIONS
    given = ["--" + name.replace("_", "-") for name in unread if getattr(args, name) not in (None, False)]
    if given:
        why = "not read with --tasks (lm-eval's tasks bring their own data)" if args.tasks else "read with --tasks only"
        raise ConfigError(f"{', '.join(given)}: {why}")


def run(args: argparse.Namespace) -> int:
    check_options(args)
    if args.tasks:
        return run_benchmarks(args)
    from attnlab.evaluate import evaluate_run

    report = evaluate_run(args.run, args.windows, args.seq_len, args.batch_size, args.seed, data_path=args.data,
                          weights=args.weights, device=arguments.usable_device(args.device), full=args.full,
                          progress=sys.stderr.isatty())
    if args.json:
        print(json.dumps(report))
    else:
        what = "the whole validation split" if args.full else f"{args.windows} windows"
        print(f"{report['run']} (step {report['step']}) on {report['data']}, {what} of {report['seq_len']}:")
        print(f"  loss {report['loss']:.4f} nats/token, {report['bits_per_token']:.4f} bits per token, "
              f"{report['bits_per_byte']:.4f} bits per byte, "
              f"perplexity {report['perplexity']:.3f} ({report['n_tokens']} targets)")
        routing = report.get("routing")
        if routing:
            print(f"  routing: {routing['no_routed_key_fraction']:.3f} of tokens without a routed key, "
                  f"{routing['only_itself_fraction']:.3f} seeing only themselves, largest cluster "
                  f"{routing['largest_cluster_share']:.3f} of tokens")
    return 0


def run_benchmarks(args: argparse.Namespace) -> int:
    """lm-eval on the run; one line per task with its metrics (a metric's standard error after ±)."""
    from attnlab.evaluate import lm_eval_run

    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-request chatter
    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    report = lm_eval_run(args.run, tasks, include_path=args.include_path, limit=args.limit,
                         num_fewshot=args.num_fewshot, batch_size=args.batch_size, weights=args.weights,
                         device=arguments.usable_device(args.device))
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.run} (step {report['step']}), lm-eval:")
    for task, metrics in report["results"].items():
        print(f"  {task}: {format_metrics(metrics)}")
    print(f"results: {report['path']}")
    return 0


def format_metrics(metrics: dict[str, object]) -> str:
    """"acc 0.7500 ± 0.2500, ...": each metric with its standard error where lm-eval gives a number
    (it writes "N/A" where it has none, e.g. for bits per byte)."""
    shown = []
    for name, value in metrics.items():
        if name.endswith("_stderr"):
            continue
        error = metrics.get(f"{name}_stderr")
        text = f"{name} {value:.4f}" if isinstance(value, (int, float)) else f"{name} {value}"
        shown.append(text + (f" ± {error:.4f}" if isinstance(error, (int, float)) else ""))
    return ", ".join(shown)
