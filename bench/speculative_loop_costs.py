"""Where a compiled speculative run of a trained pair spends its time outside the compiled calls: per
run, the time before the decoding loop (both prompts' eager prefill, the caches), and per step the
time inside its forwards (the draft's proposal and the verification: one compiled call,
Transformer.draw_then_decode) and around them (the loop's own bookkeeping: uniforms, gathers and
scatters of the sequence, counters, rollbacks); beside it the
target's own prefill of the prompt, which the base decoding pays too. Temperature 1, gamma 6,
int8 draft, 256 new tokens after a 128-byte validation prime, as bench/speculative_ab.py.

    OMP_NUM_THREADS=2 python bench/speculative_loop_costs.py TARGET_RUN DRAFT_RUN [--batch-size 1]
        [--dtype float32] [--rounds 5]

One line per timed round (round 0 compiles and is not printed).
"""

from __future__ import annotations

import argparse
import time

import torch

import attnlab.generate.speculative as speculative
from attnlab.cli import arguments  # the decoding commands' --dtype names (bf16 too)
from attnlab.data.corpus import load_corpus
from attnlab.data.sampler import eval_windows
from attnlab.generate.sampling import SamplingConfig
from attnlab.model.quantize import quantize_weights
from attnlab.train.checkpoint import load_model

TIMED = {"_propose_and_verify": "forwards", "_decode_per_row": "loop", "_decode_shared_window": "loop"}


def time_inside(totals: dict[str, float]) -> None:
    """Wrap speculative.py's forwards and loop functions so that their seconds add up in totals."""
    for function_name, part in TIMED.items():
        original = getattr(speculative, function_name)

        def timed(*arguments, _original=original, _part=part, **keywords):
            started = time.perf_counter()
            try:
                return _original(*arguments, **keywords)
            finally:
                totals[_part] += time.perf_counter() - started

        setattr(speculative, function_name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--dtype", type=arguments.dtype, default="float32")
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    target = load_model(args.target, dtype=dtype).eval()
    draft = load_model(args.draft, dtype=dtype).eval()
    quantize_weights(draft, "int8")
    target.compile_decoding()
    draft.compile_decoding()
    prompt = eval_windows(load_corpus(target.run_config.data).val, 128, args.batch_size, seed=0)[:, :128].long()
    totals = dict.fromkeys(("forwards", "loop"), 0.0)
    time_inside(totals)
    for round_ in range(args.rounds + 1):
        totals.update(dict.fromkeys(totals, 0.0))
        started = time.perf_counter()
        result = speculative.speculative_generate(target, draft, prompt, 256, args.gamma, SamplingConfig(),
                                                  generator=torch.Generator().manual_seed(round_))
        total = time.perf_counter() - started
        with torch.inference_mode():
            started = time.perf_counter()
            target(prompt, cache=target.new_cache(args.batch_size, prompt.shape[1] + 256))
            target_prefill = time.perf_counter() - started
        if round_:
            steps = result.n_steps
            between = totals["loop"] - totals["forwards"]
            print(f"batch {args.batch_size} {args.dtype}: {steps} steps, run {total * 1e3:.0f} ms, before the loop "
                  f"{(total - totals['loop']) * 1e3:.1f} ms (the target's prefill alone {target_prefill * 1e3:.1f}); "
                  f"a step: forwards {totals['forwards'] / steps * 1e3:.2f}, around them "
                  f"{between / steps * 1e3:.2f} ms",
                  flush=True)


if __name__ == "__main__":
    main()
