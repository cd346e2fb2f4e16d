"""`attnlab import-hf DIR --out RUN [--force]`: a Hugging Face Llama checkpoint as an attnlab run."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "import-hf", help="make a run directory from a Hugging Face Llama (or Qwen2-MoE) checkpoint"
    )
    parser.add_argument("hf_dir", metavar="DIR", help="folder with config.json and model.safetensors")
    parser.add_argument("--out", required=True, help="run directory to create (must be empty unless --force)")
    parser.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.hf import import_hf

    print(import_hf(args.hf_dir, args.out, overwrite=args.force))
    return 0
