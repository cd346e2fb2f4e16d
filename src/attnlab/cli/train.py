"""`attnlab train [-p PRESET | -c FILE] [--resume [CHECKPOINT]] [key.path=value ...]`"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys
from pathlib import Path

from attnlab.cli import arguments
from attnlab.config import check_preset_name, known_presets, load_config
from attnlab.errors import AttnlabError


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
        "--resume", nargs="?", const="auto", default=None, metavar="CHECKPOINT", action=ResumeAction,
        help="continue the run: from its newest intact checkpoint, or from CHECKPOINT",
    )
    parser.add_argument(
        "--until-step", type=arguments.positive, default=None, metavar="N",
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
    if getattr(args, "resume_override", None) is not None:
        overrides.insert(*args.resume_override)
    if args.preset is None and args.config is None and not any(o.startswith("name=") for o in overrides):
        overrides.insert(0, "name=demo")
    if args.deepspeed_config is not None:
        overrides += ["dist.strategy=deepspeed", f"dist.deepspeed_config={args.deepspeed_config}"]
    config = load_config(source, overrides)
    from attnlab.train.loop import train  # here, not at the top: `attnlab --help` imports no torch
    from attnlab.train.signals import Stopped, exit_status

    try:
        result = train(config, resume=args.resume, command_line=["attnlab", *sys.argv[1:]], until_step=args.until_step)
    except Stopped as stopped:
        print(f"attnlab train: stopped by {stopped} during start-up; nothing to save", file=sys.stderr)
        return exit_status(stopped.signum)
    except KeyboardInterrupt:  # a second Ctrl-C: abort without saving
        print("attnlab train: aborted; the last checkpoint is kept", file=sys.stderr)
        return exit_status(signal.SIGINT)
    except OSError as error:
        if error.errno not in WRITE_ERRORS:
            raise
        raise AttnlabError(f"cannot write {error.filename or 'to the run directory'}: {error.strerror}") from error
    where = result.run_dir
    status = exit_status(result.stop_signal) if result.interrupted else 0  # a run complete despite a signal: 0
    if os.environ.get("RANK", "0") != "0":
        return status  # rank 0 speaks for a distributed run
    if result.interrupted:
        print(f"stopped at step {result.step} by {signal.Signals(result.stop_signal).name}; continue with: "
              f"attnlab train --resume ... (run {where})")
        return status
    if result.last_eval:
        print(f"done: step {result.step}, validation bits per byte {result.last_eval['val_bpb']:.4f}")
    print(f"run directory: {where}\nsample from it: attnlab sample {where} --prompt 'def '")
    return 0


WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)


class ResumeAction(argparse.Action):
    """`--resume [CHECKPOINT]`. argparse takes an override right after it for CHECKPOINT: a value
    with `=` that names no file is `--resume` followed by that override, kept in its place."""

    def __call__(self, parser, namespace, value, option_string=None) -> None:
        if value != self.const and "=" in value and not Path(value).exists():
            namespace.resume_override = (len(getattr(namespace, "overrides", None) or []), value)
            value = self.const
        namespace.resume = value
