"""`attnlab eval RUN [--json] [--data FILE] [--windows N]`: loss, bits per byte, perplexity."""

from __future__ import annotations

import argparse
import dataclasses
import json

from attnlab.attention.routing import routing_stats
from attnlab.data.corpus import load_corpus
from attnlab.data.sampler import eval_batch
from attnlab.evaluate import evaluate
from attnlab.train.checkpoint import load_model


def register(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="validation loss, bits per byte and perplexity of a run")
    parser.add_argument("run", help="run directory or checkpoint file")
    parser.add_argument("--data", default=None, help="evaluate on this file's validation split instead")
    parser.add_argument("--windows", type=int, default=64, help="number of validation windows")
    parser.add_argument("--seq-len", type=int, default=None, help="window length (default: the run's)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234, help="which windows (fixed: results are deterministic)")
    parser.add_argument("--weights", choices=["auto", "model", "ema"], default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model = load_model(args.run, device=args.device, weights=args.weights)
    config = model.run_config
    data_config = config.data
    if args.data is not None:  # a byte file, or a folder of token shards for a tokenized run
        source = "tokens" if data_config.source in ("tokens", "builtin-tokens") else "file"
        data_config = dataclasses.replace(data_config, source=source, path=args.data)
    corpus = load_corpus(data_config)
    seq_len = args.seq_len or config.train.seq_len
    result = evaluate(model, corpus.val, seq_len, args.windows, args.batch_size, seed=args.seed)
    report = {"run": str(args.run), "step": model.checkpoint_step, "data": corpus.description,
              "seq_len": seq_len, **result.as_dict()}
    windows = eval_batch(corpus.val, seq_len, min(args.windows, args.batch_size), args.seed).tokens
    routing = routing_stats(model, windows[:, :-1].to(args.device))  # empty unless the model routes
    if routing:
        report["routing"] = routing
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['run']} (step {report['step']}) on {report['data']}, {args.windows} windows of {seq_len}:")
        print(f"  loss {result.loss:.4f} nats/token, {result.bits_per_token:.4f} bits per token, "
              f"{result.bits_per_byte:.4f} bits per byte, "
              f"perplexity {result.perplexity:.3f}")
        if routing:
            print(f"  routing: {routing['no_routed_key_fraction']:.3f} of tokens without a routed key, "
                  f"{routing['only_itself_fraction']:.3f} seeing only themselves, largest cluster "
                  f"{routing['largest_cluster_share']:.3f} of tokens")
    return 0
