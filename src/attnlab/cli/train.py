"""`attnlab train [-p PRESET | -c FILE] [--resume [CHECKPOINT]] [key.path=value ...]`"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from attnlab.config import check_preset_name, known_presets, load_config


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a model (no arguments: the demo preset on the built-in corpus)",
        description="Train a model. Overrides are key.path=value, e.g. train.max_steps=2000 model.depth=6.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("-p", "--preset", default=None, help=f"named preset: {', '.join(known_presets())}")
    source.add_argument("-c", "--config", default=None, help="YAML config file (may name `preset:` to start from)")
    parser.add_argument(
        "--resume", nargs="?", const="auto", default=None, metavar="CHECKPOINT",
        help="continue the run: from its latest checkpoint, or from CHECKPOINT",
    )
    parser.add_argument(
        "--until-step", type=int, default=None, metavar="N",
        help="stop with a checkpoint after step N, keeping the schedule of train.max_steps",
    )
    parser.add_argument(
        "--deepspeed_config", "--deepspeed-config", default=None, metavar="DS_JSON",
        help="DeepSpeed JSON config, as the seeds pass it: the same as dist.strategy=deepspeed "
             "dist.deepspeed_config=DS_JSON",
    )
    parser.add_argument("--deepspeed", action="store_true", help="accepted for DeepSpeed's own scripts; "
                        "the config file above (or dist.* overrides) decides")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # -p takes a preset's name only, -c a config file's path only (config.py, `looks_like_path`)
    source = Path(args.config) if args.config else check_preset_name(args.preset or "demo")
    overrides = list(args.overrides)
    if args.preset is None and args.config is None and not any(o.startswith("name=") for o in overrides):
        overrides.insert(0, "name=demo")
    if args.deepspeed_config is not None:
        overrides += ["dist.strategy=deepspeed", f"dist.deepspeed_config={args.deepspeed_config}"]
    config = load_config(source, overrides)
    from attnlab.train.loop import train  # here, not at the top: `attnlab --help` imports no torch

    result = train(config, resume=args.resume, command_line=["attnlab", *sys.argv[1:]], until_step=args.until_step)
    where = result.run_dir
    if os.environ.get("RANK", "0") != "0":
        return 130 if result.interrupted else 0  # rank 0 speaks for a distributed run
    if result.interrupted:
        print(f"stopped at step {result.step}; continue with: attnlab train --resume ... (run {where})")
        return 130
    if result.last_eval:
        print(f"done: step {result.step}, validation bits per byte {result.last_eval['val_bpb']:.4f}")
    print(f"run directory: {where}\nsample from it: attnlab sample {where} --prompt 'def '")
    return 0
