"""`attnlab plot RUN [RUN ...] --out runs.png`: loss and bits-per-byte curves of runs side by side."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser("plot", help="plot loss and bits per byte of runs against steps, tokens, time")
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--out", type=Path, default=Path("runs.png"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.bench.plots import plot_run_dirs

    print(plot_run_dirs(args.runs, args.out))
    return 0
