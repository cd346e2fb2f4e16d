"""Argument types the commands share, so argparse refuses a bad number or device in one line
(`attnlab sample: error: argument --top-k: must be >= 1, got 0`) before any model is loaded.

A type function raises argparse.ArgumentTypeError; argparse names the option. Nothing here
imports torch at import time (`attnlab --help` stays fast): `usable_device` imports it when a
command runs.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from attnlab.config import ATTENTION_BACKENDS, DEVICE_NAME, MAX_INT
from attnlab.errors import AttnlabError

MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes 64 bits; numpy's default_rng any non-negative int


def integer_at_least(low: int, high: int = MAX_INT):
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {text}" if high != MAX_INT
                                             else f"must be >= {low}, got {text}")
        return value

    parse.__name__ = "integer"  # argparse says "invalid integer value" should the function itself fail
    return parse


def number_in(low: float, high: float, open_low: bool = False, open_high: bool = False):
    """An argparse type: a finite number in [low, high] (an end excluded when marked open)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        too_low = value <= low if open_low else value < low
        too_high = value >= high if open_high else value > high
        if not math.isfinite(value) or too_low or too_high:
            interval = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
            wanted = f"a finite number {'>' if open_low else '>='} {low:g}" if math.isinf(high) else f"in {interval}"
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


positive = integer_at_least(1)
count = integer_at_least(0)
seed = integer_at_least(0, MAX_SEED)
temperature = number_in(0, math.inf)  # 0: greedy
top_p = number_in(0, 1, open_low=True)
min_p = number_in(0, 1)


def device(text: str) -> str:
    """cpu, cuda, cuda:N, mps or xpu (auto is a training setting: pick one here)."""
    if text == "auto" or not DEVICE_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:N, mps, xpu)")
    return text


def usable_device(name: str) -> str:
    """`name` if this machine has that device, else AttnlabError (torch's own error is an assertion)."""
    import torch

    kind, _, index = name.partition(":")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise AttnlabError(f"--device {name}: CUDA is not available on this machine")
        if index and int(index) >= torch.cuda.device_count():
            raise AttnlabError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif kind == "mps" and not torch.backends.mps.is_available():
        raise AttnlabError(f"--device {name}: MPS is not available on this machine")
    elif kind == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise AttnlabError(f"--device {name}: XPU is not available on this machine")
    return name


def check_output_file(option: str, path: Path) -> None:
    """Refuse, before any long work, an output file that could only fail once that work is done: a
    folder, a path under a file, a place this process may not write. Its missing folders are made
    (as `bench suite --out` and `plot --out` make theirs)."""
    if path.is_dir():
        raise AttnlabError(f"{option} {path} is a folder, not a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise AttnlabError(f"{option} {path}: cannot make its folder {path.parent} ({error.strerror})") from None
    writable = path if path.exists() else path.parent
    if not os.access(writable, os.W_OK):  # also False on a read-only file system, for root too
        raise AttnlabError(f"{option} {path}: {writable} is not writable")


DTYPES = ("float32", "bfloat16", "float16")  # torch's names (hf.DTYPES'), here without importing torch
DTYPE_SHORT_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # `attnlab bench`'s names


def dtype(text: str) -> str:
    """A torch dtype name of DTYPES, or its short name (bf16) -> the torch name."""
    name = DTYPE_SHORT_NAMES.get(text, text)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not one of {', '.join(DTYPES)} (or {', '.join(DTYPE_SHORT_NAMES)})")
    return name


def add_decoding_dtype(parser) -> None:
    """--dtype of the decoding commands: the dtype the models' weights and caches decode in."""
    parser.add_argument("--dtype", type=dtype, default="float32",
                        help="decode in this dtype, weights and caches (float32, bfloat16 or float16; bf16 and fp16 "
                        "too): bfloat16 reads half the bytes of float32 and uses a CPU's bfloat16 matrix units where "
                        "it has them")


def add_cache_dtype(parser) -> None:
    """--cache-dtype of the decoding commands: the dtype caches store keys and values in."""
    parser.add_argument("--cache-dtype", type=dtype, default=None,
                        help="the caches' keys and values in this dtype (default: --dtype's): bfloat16 beside float32 "
                        "weights halves the bytes a long context's step reads")


def add_attention_backend(parser) -> None:
    """--attention-backend of the decoding commands: every layer's attention back-end."""
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None,
                        help="the attention's back-end (model.attention.<kind>.backend; default: the run's): "
                        "triton takes full and local attention's cached calls on CUDA, torch the reference "
                        "(docs/attention.md, Back-ends)")


def add_sampling(parser) -> None:
    """The sampling options of every decoding command (generate/sampling.py's SamplingConfig)."""
    parser.add_argument("--temperature", type=temperature, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=positive, default=None)
    parser.add_argument("--top-p", type=top_p, default=None)
    parser.add_argument("--min-p", type=min_p, default=None)
