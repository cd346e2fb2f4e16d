"""The cpu back-end's decode operator (kernels/decode_cpu.cpp) of this checkout beside the same
operator at another git revision, side by side in one process: each call of the few-query shapes a
decode step and a speculative verification make (batch 1 and 4, 1 and 7 queries (`--queries`), 4 heads of width
64 and 128, float32 and bfloat16, 200 keys seen (`--seen`) in a storage 196 longer), the two operators in turn,
round after round; medians of each round's median call, and of the rounds' time ratios (this
checkout over the other). The other revision's source is built under the namespace
attnlab_against (its registration renamed), so both load at once; the outputs are checked to agree.
Keys and values stay in cache between calls here unless `--copies` gives the calls that many
storages to take in turn (enough to outgrow the last-level cache: a compiled step reads them cold,
among the weights; bench/step_kernel_profile.py times the operator inside the step).

--step CONTEXT ... times what a user sees instead: two full-attention models of bench/compiled_decoding.py's
shape (dim 256, depth 4, 4 heads of 64), each compiled with compile_decoding's defaults, one whose
cached calls go through this checkout's operator and one through the other revision's, decoding
--calls tokens after a random prompt of each CONTEXT tokens, in turn, round after round (the order
swapped every round); medians of each round's median token and of the rounds' time ratios.

    OMP_NUM_THREADS=2 python bench/decode_operator_ab.py --against REVISION [--rounds 9] [--calls 200] \
        [--seen 200] [--copies 1] [--queries 1 7] [--step 256 4096]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from compiled_decoding import build, ms_per_token  # bench/, on sys.path when run as a script

from attnlab.attention.kernels import decode_cpu
from attnlab.attention.kernels.cpu import HEADERS, OperatorLibrary

KERNELS = Path(decode_cpu.__file__).parent
BATCHES = (1, 4)


def load_revision(revision: str) -> object:
    """The decode operator as it was at `revision`, registered as torch.ops.attnlab_against."""
    relative = KERNELS.relative_to(Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"],
                                                                text=True).strip()))
    folder = Path(tempfile.mkdtemp(prefix="decode-against-"))
    for name in ("decode_cpu.cpp", *(header.name for header in HEADERS)):
        shown = subprocess.run(["git", "show", f"{revision}:{relative / name}"], capture_output=True, text=True)
        if shown.returncode != 0 and name != "decode_cpu.cpp":
            continue  # a header the revision did not have yet
        shown.check_returncode()
        text = shown.stdout
        if name == "decode_cpu.cpp":
            text = text.replace("TORCH_LIBRARY_FRAGMENT(attnlab,", "TORCH_LIBRARY_FRAGMENT(attnlab_against,")
            text = text.replace("TORCH_LIBRARY_IMPL(attnlab,", "TORCH_LIBRARY_IMPL(attnlab_against,")
        (folder / name).write_text(text)
    if not OperatorLibrary("attnlab_decode_against", folder / "decode_cpu.cpp", register_fake, "").loaded():
        raise SystemExit(f"the decode operator of {revision} does not build here (the warning above says why)")
    return torch.ops.attnlab_against.cached_attention_cpu


def register_fake() -> None:
    """The other revision's operator's shape for torch.compile: the same as this checkout's."""
    torch.library.register_fake("attnlab_against::cached_attention_cpu")(
        lambda q, keys, values, positions, window, lanes=0: decode_cpu.out_layout(q))


@contextlib.contextmanager
def cached_calls_through(operator):
    """decode_cpu.cached_attention calling `operator` for the time of the context: a step compiled in it
    calls that operator, and its later calls run in it too (so its guards, if it checks them, pass)."""
    original = decode_cpu.cached_attention
    decode_cpu.cached_attention = lambda q, keys, values, positions, window=0, lanes=0: operator(
        q, keys, values, positions, window, lanes)
    try:
        yield
    finally:
        decode_cpu.cached_attention = original


def compare_steps(against, revision: str, contexts: list[int], tokens: int, rounds: int) -> None:
    """A compiled full-attention step through each operator at each context, in turn (--step)."""
    print(f"threads {torch.get_num_threads()}, against {revision}: ms a token of a compiled full-attention step")
    operators = {"this": contextlib.nullcontext, "against": lambda: cached_calls_through(against)}
    for context in contexts:
        models = {name: build("full", context + tokens, "compiled") for name in operators}
        prompt = torch.randint(0, 256, (1, context), generator=torch.Generator().manual_seed(context))
        times = {name: [] for name in operators}
        for round_ in range(rounds + 1):  # round 0 warms up (and compiles)
            for name in list(operators)[::-1] if round_ % 2 else operators:
                with operators[name]():
                    elapsed = ms_per_token(models[name], prompt, tokens, seed=round_)
                if round_:
                    times[name].append(elapsed)
        ratios = sorted(this / against for this, against in zip(times["this"], times["against"]))
        print(f"context {context}: {revision} {statistics.median(times['against']):.3f}, "
              f"this {statistics.median(times['this']):.3f}, "
              f"this / {revision} {statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})", flush=True)


def case(batch: int, queries: int, width: int, dtype: torch.dtype, seen: int, copies: int = 1):
    """`copies` calls' arguments: q [B, 4, T, D], keys and values [B, 4, L, D] (each call its own),
    positions [B, T]: each row's T queries after `seen` keys."""
    generator = torch.Generator().manual_seed(0)
    storage = seen + 196
    q = torch.randn(batch, 4, queries, width, generator=generator).to(dtype)
    positions = (torch.arange(queries) + seen).expand(batch, queries).contiguous()
    calls = []
    for _ in range(copies):
        keys, values = (torch.randn(batch, 4, storage, width, generator=generator).to(dtype) for _ in range(2))
        calls.append((q, keys, values, positions))
    return calls


def median_call(operator, arguments: list, calls: int) -> float:
    """The median time of `calls` calls, taking the arguments' copies in turn."""
    times = []
    for index in range(calls):
        started = time.perf_counter()
        operator(*arguments[index % len(arguments)], 0)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the git revision to compare with")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=200, help="calls timed per operator and round")
    parser.add_argument("--seen", type=int, default=200, help="keys each row's first query sees")
    parser.add_argument("--copies", type=int, default=1, help="storages the calls take in turn")
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 7], help="queries a call makes")
    parser.add_argument("--step", type=int, nargs="+", metavar="CONTEXT",
                        help="time compiled full-attention steps at these contexts instead (--calls tokens each)")
    args = parser.parse_args()
    if not decode_cpu.available():
        raise SystemExit("the decode operator cannot be built here (no C++ compiler)")
    operators = {"this": torch.ops.attnlab.cached_attention_cpu, "against": load_revision(args.against)}
    if args.step:
        return compare_steps(operators["against"], args.against, args.step, args.calls, args.rounds)
    print(f"threads {torch.get_num_threads()}, against {args.against}, {args.seen} keys seen, "
          f"{args.copies} storage(s) in turn; microseconds a call")
    for width in (64, 128):
        for dtype in (torch.float32, torch.bfloat16):
            for batch, queries in ((batch, queries) for batch in BATCHES for queries in args.queries):
                arguments = case(batch, queries, width, dtype, args.seen, args.copies)
                # the same up to rounding (a bfloat16 output: its last bit)
                tolerance = 1e-5 if dtype == torch.float32 else 1e-2
                this, against = (operators[name](*arguments[0], 0).float() for name in ("this", "against"))
                torch.testing.assert_close(this, against, atol=tolerance, rtol=tolerance)
                times = {name: [] for name in operators}
                for _ in range(args.rounds):
                    for name, operator in operators.items():
                        times[name].append(median_call(operator, arguments, args.calls))
                ratios = sorted(this / against for this, against in zip(times["this"], times["against"]))
                print(f"D {width:3d} {str(dtype).removeprefix('torch.'):8s} B {batch} T {queries}: "
                      f"{args.against} {statistics.median(times['against']) * 1e6:6.1f}, "
                      f"this {statistics.median(times['this']) * 1e6:6.1f}, "
                      f"this / {args.against} {statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})",
                      flush=True)


if __name__ == "__main__":
    main()
