"""`attnlab export RUN --format hf --out DIR [--weights auto|model|ema] [--dtype float32] [--tokenizer DIR]`"""

from __future__ import annotations

import argparse

DTYPES = ("float32", "bfloat16", "float16")  # hf.DTYPES' names, here without importing torch


def register(subparsers) -> None:
    parser = subparsers.add_parser("export", help="write a run as a Hugging Face Llama (or Qwen2-MoE) checkpoint")
    parser.add_argument("run", help="run directory (its latest checkpoint) or checkpoint file")
    parser.add_argument("--format", choices=["hf"], default="hf",
                        help="hf: LlamaForCausalLM (Qwen2MoeForCausalLM for MoE) in safetensors")
    parser.add_argument("--out", required=True, help="folder to write (must be empty unless --force)")
    parser.add_argument("--weights", choices=["auto", "model", "ema"], default="auto", help="auto: ema when kept")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the saved tensors")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the run's, if any)")
    parser.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from attnlab.hf import export_run

    out_dir = export_run(args.run, args.out, weights=args.weights, dtype=args.dtype,
                         tokenizer_dir=args.tokenizer, overwrite=args.force)
    print(out_dir)
    return 0
