"""`attnlab data prepare builtin | download enwik8 | info`"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnlab.config import load_config
from attnlab.data.bytes import ENWIK8_URL, download_enwik8, load_corpus, prepare_builtin


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="prepare, download and inspect corpora")
    actions = parser.add_subparsers(dest="data_action", metavar="ACTION", required=True)

    prepare = actions.add_parser("prepare", help="build a corpus into the cache")
    prepare.add_argument("corpus", choices=["builtin"], help="builtin: the Python standard library's sources")
    prepare.add_argument("--cache-dir", type=Path, default=None)
    prepare.set_defaults(func=run_prepare)

    download = actions.add_parser("download", help="download a public corpus, verifying its checksum")
    download.add_argument("corpus", choices=["enwik8"])
    download.add_argument("--dest", type=Path, default=None, help="folder (default: the cache)")
    download.add_argument("--url", default=ENWIK8_URL)
    download.add_argument("--sha256", default=None, help="expected checksum (default: the official archive's)")
    download.set_defaults(func=run_download)

    info = actions.add_parser("info", help="describe the corpus a preset or config would train on")
    info.add_argument("-p", "--preset", default="demo")
    info.add_argument("overrides", nargs="*", metavar="key.path=value")
    info.set_defaults(func=run_info)


def run_prepare(args: argparse.Namespace) -> int:
    folder = prepare_builtin(args.cache_dir)
    meta = json.loads((folder / "meta.json").read_text())
    print(f"{folder}\n  {meta['n_files']} files, {meta['train_bytes']:,} train + {meta['val_bytes']:,} validation "
          f"bytes\n  sha256 {meta['sha256']}")
    return 0


def run_download(args: argparse.Namespace) -> int:
    kwargs = {} if args.sha256 is None else {"sha256": args.sha256}
    print(download_enwik8(args.dest, url=args.url, **kwargs))
    return 0


def run_info(args: argparse.Namespace) -> int:
    corpus = load_corpus(load_config(args.preset, args.overrides).data)
    print(f"{corpus.description}\n  train {len(corpus.train):,} bytes, validation {len(corpus.val):,} bytes")
    return 0
