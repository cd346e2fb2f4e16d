"""`attnlab plot RUN [RUN ...] --out runs.png`: loss and bits-per-byte curves of runs side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnlab.bench.plots import plot_runs
from attnlab.errors import AttnlabError
from attnlab.train.metrics import read_metrics


def register(subparsers) -> None:
    parser = subparsers.add_parser("plot", help="plot loss and bits per byte of runs against steps, tokens, time")
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--out", type=Path, default=Path("runs.png"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    runs = []
    for run_dir in args.runs:
        if not (run_dir / "metrics.jsonl").is_file():
            raise AttnlabError(f"{run_dir} has no metrics.jsonl: is it a run directory?")
        runs.append((run_dir.name, read_metrics(run_dir)))
    print(plot_runs(runs, args.out))
    return 0
