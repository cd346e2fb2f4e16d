"""`attnlab plot RUN [RUN ...] --out runs.png`: loss and bits-per-byte curves of runs side by side."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser("plot", help="plot loss and bits per byte of runs against steps, tokens, time")
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--out", type=picture_path, default=Path("runs.png"),
                        help=f"the picture; its suffix names the format ({', '.join(PICTURE_FORMATS)})")
    parser.set_defaults(func=run)


PICTURE_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "eps", "ps")  # what matplotlib always writes


def picture_path(text: str) -> Path:
    """An argparse type: a path whose suffix is a format in PICTURE_FORMATS (matplotlib raises a
    ValueError for any other, after reading every run)."""
    path = Path(text)
    if path.suffix.lower().lstrip(".") not in PICTURE_FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r} does not end in a picture format's suffix "
                                         f"(.{', .'.join(PICTURE_FORMATS)})")
    return path


def run(args: argparse.Namespace) -> int:
    from attnlab.bench.plots import plot_run_dirs

    print(plot_run_dirs(args.runs, args.out))
    return 0
