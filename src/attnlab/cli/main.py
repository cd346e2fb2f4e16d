"""`attnlab <command>`: each command module parses its arguments and calls library functions.

A command module exposes `register(subparsers)`, which adds its parser and sets `func` to a
function taking the parsed namespace and returning an exit code. Errors of the user's making
(`AttnlabError`, and arguments argparse refuses) are printed as one line; anything else is a bug
and keeps its traceback.

`attnlab --help` must be quick: command modules import torch (and everything that imports it)
inside their functions, never at the top, and so does the `attnlab` package itself
(tests/test_cli_inputs.py checks that building the parser imports no torch).
"""

from __future__ import annotations

import argparse
import logging
import sys

from attnlab.errors import AttnlabError

COMMAND_MODULES = [
    "train", "sample", "eval", "data", "tokenizer", "bench", "plot", "speculative", "export", "import_hf",
]


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a refused argument reported as one line (argparse prints the usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = OneLineParser(prog="attnlab", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"attnlab.cli.{name}")
        module.register(subparsers)
    return parser


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The namespace of argv, a command's `key.path=value` overrides taken wherever they stand:
    argparse fills a list of positionals once, so in `train a=1 --resume b=2` it refused b=2. Any
    other argument it does not know is its own one-line error."""
    args, extras = parser.parse_known_args(argv)
    overrides = getattr(args, "overrides", None)
    if extras and isinstance(overrides, list) and all(is_override(extra) for extra in extras):
        args.overrides = [*overrides, *extras]  # in argv's order: the extras all stand after the list
    elif extras:
        parser.parse_args(argv)  # argparse's error for them (it exits)
    return args


def is_override(argument: str) -> bool:
    return "=" in argument and not argument.startswith("-")


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
    replace_unencodable_output()
    argv = take_local_rank(argv)
    if not argv:
        argv = ["train"]  # `attnlab` alone runs the demo, like `attnlab train`
    parser = build_parser()
    args = parse_arguments(parser, argv)
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
    except Exception as error:
        line = system_error(error)
        if line is None or args.verbose:
            raise
        print(f"attnlab {args.command}: error: {line} (-v shows where)", file=sys.stderr)
        return 1


def replace_unencodable_output() -> None:
    """Text from data (samples, decoded tokens, descriptions, paths) may hold characters the terminal's
    encoding cannot (an ASCII locale, PYTHONIOENCODING=ascii): stdout shows them as backslash escapes,
    as Python's stderr already does, rather than failing mid-output with UnicodeEncodeError. Raw
    undecodable bytes from a command line or file name (surrogate-escaped) show as escapes too."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # a TextIOWrapper; a replaced stream (StringIO) holds any text
            stream.reconfigure(errors="backslashreplace")


def system_error(error: Exception) -> str | None:
    """One line for what the machine refused (a path, a permission, a full disk, not enough memory),
    which no fix to attnlab would change; None for anything else, which is a bug to show in full."""
    if isinstance(error, OSError):
        return str(error)  # "[Errno 28] No space left on device: 'runs/x/...'" names the file
    if isinstance(error, MemoryError):
        return f"out of memory ({error})" if str(error) else "out of memory"
    message = str(error).strip()
    # torch's allocators: CUDA raises torch.OutOfMemoryError, the CPU one a RuntimeError saying so
    if type(error).__name__ == "OutOfMemoryError" or "can't allocate memory" in message:
        return "out of memory: " + message.splitlines()[0][:300]
    return None


if __name__ == "__main__":
    sys.exit(main())
