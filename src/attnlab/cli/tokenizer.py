"""`attnlab tokenizer train --input FILES --vocab-size N --out DIR | encode | decode`"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnlab.cli import arguments
from attnlab.data.tokenizer import MAX_VOCAB, MIN_VOCAB, Tokenizer, train_tokenizer


def register(subparsers) -> None:
    parser = subparsers.add_parser("tokenizer", help="train a byte-level BPE tokenizer, encode and decode")
    actions = parser.add_subparsers(dest="tokenizer_action", metavar="ACTION", required=True)

    train = actions.add_parser("train", help="train byte-level BPE on jsonl ({'text': ...} lines) or text files")
    train.add_argument("--input", type=Path, nargs="+", required=True, metavar="FILE")
    train.add_argument("--vocab-size", type=arguments.integer_at_least(MIN_VOCAB, MAX_VOCAB), default=6400,
                       help="MiniMind: 6400")
    train.add_argument("--out", type=Path, required=True, metavar="DIR")
    train.add_argument("--skip-bad", action="store_true", help="skip malformed jsonl lines (counted), not fail")
    train.set_defaults(func=run_train)

    encode = actions.add_parser("encode", help="print the token ids of TEXT (or of standard input)")
    encode.add_argument("--tokenizer", type=Path, required=True, metavar="DIR")
    encode.add_argument("text", nargs="?", default=None)
    encode.set_defaults(func=run_encode)

    decode = actions.add_parser("decode", help="print the text of token IDS")
    decode.add_argument("--tokenizer", type=Path, required=True, metavar="DIR")
    decode.add_argument("ids", nargs="+", type=arguments.count)
    decode.set_defaults(func=run_decode)


def run_train(args: argparse.Namespace) -> int:
    folder = train_tokenizer(args.input, args.vocab_size, args.out, progress=sys.stderr.isatty(),
                             skip_bad=args.skip_bad)
    print(f"{folder} ({Tokenizer(folder).vocab_size} tokens)")
    return 0


def run_encode(args: argparse.Namespace) -> int:
    """Encodes bytes, not text: standard input or an argument that is not UTF-8 (surrogate-escaped,
    as Python gives a command line) is encoded byte for byte, as training prompts are."""
    data = sys.stdin.buffer.read() if args.text is None else args.text.encode("utf-8", "surrogateescape")
    print(" ".join(str(i) for i in Tokenizer(args.tokenizer).encode_bytes(data)))
    return 0


def run_decode(args: argparse.Namespace) -> int:
    sys.stdout.write(Tokenizer(args.tokenizer).decode(args.ids) + "\n")
    return 0
