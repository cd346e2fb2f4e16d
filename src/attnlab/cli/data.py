"""`attnlab data prepare builtin | prepare builtin-jsonl | prepare --input FILES --tokenizer DIR --out DATA
[--skip-bad] | download enwik8 | info`"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnlab.cli import arguments
from attnlab.config import DataConfig, check_preset_name, load_config
from attnlab.errors import DataError

# the corpora's modules import numpy and torch: each command imports what it uses when it runs


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="prepare, download and inspect corpora")
    actions = parser.add_subparsers(dest="data_action", metavar="ACTION", required=True)

    prepare = actions.add_parser(
        "prepare", help="build a built-in corpus into the cache, or tokenize jsonl files into token shards",
        description="`prepare builtin` (byte corpus) or `prepare builtin-jsonl` (the docstring documents as "
                    "jsonl) build into the cache; `prepare --input a.jsonl ... --tokenizer DIR --out DATA` "
                    "tokenizes {\"text\": ...} lines into memory-mapped token shards for data.source=tokens.",
    )
    prepare.add_argument("corpus", nargs="?", choices=["builtin", "builtin-jsonl"], default=None,
                         help="builtin: the standard library's sources as bytes; builtin-jsonl: its docstrings "
                              "as jsonl documents")
    prepare.add_argument("--cache-dir", type=Path, default=None)
    prepare.add_argument("--input", type=Path, nargs="+", default=None, metavar="FILE", help="jsonl files")
    prepare.add_argument("--tokenizer", type=Path, default=None, metavar="DIR", help="from `attnlab tokenizer train`")
    prepare.add_argument("--out", type=Path, default=None, metavar="DATA", help="folder for the shards")
    prepare.add_argument("--skip-bad", action="store_true", help="skip malformed lines (counted) instead of failing")
    prepare.add_argument("--shard-tokens", type=arguments.positive, default=1 << 25,
                         help="tokens per shard (a soft limit)")
    prepare.add_argument("--workers", type=arguments.positive, default=None,
                         help="tokenizing processes (default: CPU count)")
    for role, meaning in (("eos", "end of text, stored after every document"), ("bos", "beginning of text"),
                          ("pad", "padding")):
        prepare.add_argument(f"--{role}-token", default=None, metavar="TOKEN",
                             help=f"the tokenizer's {meaning} token, when its folder does not name one (default: "
                                  "special_tokens_map.json, then MiniMind's, then well-known names)")
    prepare.set_defaults(func=run_prepare)

    download = actions.add_parser("download", help="download a public corpus, verifying its checksum")
    download.add_argument("corpus", choices=["enwik8"])
    download.add_argument("--dest", type=Path, default=None, help="folder (default: the cache)")
    download.add_argument("--url", default=None, help="(default: the official archive, mattmahoney.net)")
    download.add_argument("--sha256", default=None, help="expected checksum (default: the official archive's)")
    download.set_defaults(func=run_download)

    info = actions.add_parser("info", help="describe the corpus a preset or config would train on")
    source = info.add_mutually_exclusive_group()
    source.add_argument("-p", "--preset", default=None, help="named preset (default: demo)")
    source.add_argument("-c", "--config", type=Path, default=None, help="YAML config file")
    info.add_argument("overrides", nargs="*", metavar="key.path=value")
    info.set_defaults(func=run_info)


def run_prepare(args: argparse.Namespace) -> int:
    from attnlab.data.byte_corpus import builtin_meta, prepare_builtin
    from attnlab.data.pretrain import write_builtin_jsonl
    from attnlab.data.shards import prepare_token_shards

    if args.input is not None:
        if args.corpus is not None or args.tokenizer is None or args.out is None:
            raise DataError("use either `prepare builtin` or `prepare --input FILES --tokenizer DIR --out DATA`")
        special_tokens = {"pad": args.pad_token, "bos": args.bos_token, "eos": args.eos_token}
        result = prepare_token_shards(args.input, args.tokenizer, args.out, skip_bad=args.skip_bad,
                                      shard_tokens=args.shard_tokens, workers=args.workers,
                                      special_tokens={role: token for role, token in special_tokens.items() if token},
                                      progress=sys.stderr.isatty())
        meta = result.meta
        print(f"{result.out_dir}\n  {meta['n_documents']:,} documents, {meta['n_tokens']:,} tokens ({meta['dtype']}) "
              f"in {len(meta['shards'])} shards, {meta['skipped_lines']} lines skipped\n  "
              f"{meta['input_bytes'] / 1e6 / max(meta['seconds'], 1e-9):.2f} MB/s of jsonl")
        return 0
    if args.corpus is None:
        raise DataError("name a corpus (builtin, builtin-jsonl) or give --input FILES --tokenizer DIR --out DATA")
    if args.corpus == "builtin-jsonl":
        print(write_builtin_jsonl(DataConfig(cache_dir=str(args.cache_dir) if args.cache_dir else None)))
        return 0
    folder = prepare_builtin(args.cache_dir)
    meta = builtin_meta(folder)
    print(f"{folder}\n  {meta['n_files']} files, {meta['train_bytes']:,} train + {meta['val_bytes']:,} validation "
          f"bytes\n  sha256 {meta['sha256']}")
    return 0


def run_download(args: argparse.Namespace) -> int:
    from attnlab.data.byte_corpus import download_enwik8

    kwargs = {} if args.sha256 is None else {"sha256": args.sha256}
    if args.url is not None:
        kwargs["url"] = args.url
    print(download_enwik8(args.dest, **kwargs))
    return 0


def run_info(args: argparse.Namespace) -> int:
    from attnlab.data.corpus import load_corpus

    source = args.config if args.config is not None else check_preset_name(args.preset or "demo")
    corpus = load_corpus(load_config(source, args.overrides).data)
    if hasattr(corpus, "tokenizer"):  # tokenized documents: the description has the counts
        print(corpus.description)
        return 0
    print(f"{corpus.description}\n  train {len(corpus.train):,} bytes, validation {len(corpus.val):,} bytes")
    return 0
