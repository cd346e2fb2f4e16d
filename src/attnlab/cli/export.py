"""`attnlab export RUN --out DIR [--model-type auto|native|attnlab] [--weights auto|model|ema] [--dtype float32]
[--tokenizer DIR] [--force]`"""

from __future__ import annotations

import argparse

from attnlab.cli.arguments import DTYPES

MODEL_TYPES = ("auto", "native", "attnlab")  # hf.MODEL_TYPES


def register(subparsers) -> None:
    parser = subparsers.add_parser("export", help="write a run as a Hugging Face folder that transformers loads")
    parser.add_argument("run", help="run directory (its latest checkpoint) or checkpoint file")
    parser.add_argument("--format", choices=["hf"], default="hf", help="hf: a transformers folder, safetensors")
    parser.add_argument("--model-type", choices=list(MODEL_TYPES), default="auto",
                        help="auto: Llama, Qwen2-MoE (MoE) or Mistral (local attention) where transformers has the "
                        "architecture, else attnlab's own model type; native: refuse rather than use attnlab's; "
                        "attnlab: always attnlab's (loads where attnlab is installed)")
    parser.add_argument("--out", required=True, help="folder to write (must be empty unless --force)")
    parser.add_argument("--weights", choices=["auto", "model", "ema"], default="auto", help="auto: ema when kept")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the saved tensors")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the run's, if any)")
    parser.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.hf import export_run

    out_dir = export_run(args.run, args.out, weights=args.weights, dtype=args.dtype,
                         tokenizer_dir=args.tokenizer, overwrite=args.force, model_type=args.model_type)
    print(out_dir)
    return 0
