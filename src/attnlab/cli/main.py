"""`attnlab <command>`: each command module parses its arguments and calls library functions.

A command module exposes `register(subparsers)`, which adds its parser and sets `func` to a
function taking the parsed namespace and returning an exit code. Errors of the user's making
(`AttnlabError`) are printed as one line; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from attnlab.errors import AttnlabError

COMMAND_MODULES = [
    "train", "sample", "eval", "data", "tokenizer", "bench", "plot", "speculative", "export", "import_hf",
]


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="attnlab", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"attnlab.cli.{name}")
        module.register(subparsers)
    return parser


def take_local_rank(argv: list[str]) -> list[str]:
    """The `deepspeed` launcher passes `--local_rank=N` before the command; keep it as LOCAL_RANK
    (which the launcher also exports) and drop it from the arguments."""
    import os

    kept, index = [], 0
    while index < len(argv):
        argument = argv[index]
        name, has_value, value = argument.partition("=")
        if name in ("--local_rank", "--local-rank"):
            if not has_value:
                index += 1
                value = argv[index] if index < len(argv) else "0"
            os.environ.setdefault("LOCAL_RANK", value)
        else:
            kept.append(argument)
        index += 1
    return kept


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    argv = take_local_rank(argv)
    if not argv:
        argv = ["train"]  # `attnlab` alone runs the demo, like `attnlab train`
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
    )
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except AttnlabError as error:
        print(f"attnlab {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
