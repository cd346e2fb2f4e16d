"""`attnlab eval RUN [--json] [--data FILE] [--windows N]`: loss, bits per byte, perplexity."""

from __future__ import annotations

import argparse
import json
import sys

from attnlab.cli import arguments


def register(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="validation loss, bits per byte and perplexity of a run")
    parser.add_argument("run", help="run directory or checkpoint file")
    parser.add_argument("--data", default=None, help="evaluate on this file's validation split instead")
    parser.add_argument("--windows", type=arguments.positive, default=64, help="number of validation windows")
    parser.add_argument("--seq-len", type=arguments.positive, default=None, help="window length (default: the run's)")
    parser.add_argument("--batch-size", type=arguments.positive, default=8)
    parser.add_argument("--seed", type=arguments.seed, default=1234,
                        help="which windows (fixed: results are deterministic)")
    parser.add_argument("--weights", choices=["auto", "model", "ema"], default="auto")
    parser.add_argument("--device", type=arguments.device, default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.evaluate import evaluate_run

    report = evaluate_run(args.run, args.windows, args.seq_len, args.batch_size, args.seed, data_path=args.data,
                          weights=args.weights, device=arguments.usable_device(args.device),
                          progress=sys.stderr.isatty())
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['run']} (step {report['step']}) on {report['data']}, {args.windows} windows of "
              f"{report['seq_len']}:")
        print(f"  loss {report['loss']:.4f} nats/token, {report['bits_per_token']:.4f} bits per token, "
              f"{report['bits_per_byte']:.4f} bits per byte, "
              f"perplexity {report['perplexity']:.3f}")
        routing = report.get("routing")
        if routing:
            print(f"  routing: {routing['no_routed_key_fraction']:.3f} of tokens without a routed key, "
                  f"{routing['only_itself_fraction']:.3f} seeing only themselves, largest cluster "
                  f"{routing['largest_cluster_share']:.3f} of tokens")
    return 0
