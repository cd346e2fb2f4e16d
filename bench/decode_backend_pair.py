"""The CPU pair's decoding with the cpu back-end's decode operator and with torch's attention, side by
side in one process: the target's own compiled decoding (the base) and compiled speculative
decoding, each pair of models once with attention.full.backend=auto (the operator,
kernels/decode_cpu.py) and once with backend=torch (torch's fused attention over the cache's
storage). Round after round, each configuration times the base and then speculative decoding from
the same validation prime with the same seed; medians of the times and of the paired speedups,
and of the operator's time over torch's, round by round.

    OMP_NUM_THREADS=2 python bench/decode_backend_pair.py TARGET_RUN DRAFT_RUN [--draft-quantize int8]
        [--batch-size 1] [--gamma 6] [--dtype float32] [--rounds 7] [--eager]

--eager: decode without compiling (a quick check of the script; the figures are the compiled ones).

Prints one JSON line per round and configuration, then one summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from attnlab.cli import arguments  # the decoding commands' --dtype names (bf16 too)
from attnlab.config import FullAttentionConfig
from attnlab.data.corpus import load_corpus
from attnlab.data.sampler import eval_windows
from attnlab.generate.sampling import SamplingConfig, generate
from attnlab.generate.speculative import speculative_generate
from attnlab.model import Transformer
from attnlab.model.quantize import quantize_weights
from attnlab.train.checkpoint import load_model

BACKENDS = ("auto", "torch")


def load_pair(args: argparse.Namespace, backend: str) -> tuple[Transformer, Transformer]:
    """The target and the draft with every layer's full attention on `backend`, compiled unless --eager."""
    dtype = getattr(torch, args.dtype)
    target, draft = load_model(args.target, dtype=dtype).eval(), load_model(args.draft, dtype=dtype).eval()
    quantize_weights(draft, args.draft_quantize)
    for model in (target, draft):
        for block in model.blocks:
            if model.config.attention.kind != "full":
                raise SystemExit("both models must have full attention")
            block.attention.config = FullAttentionConfig(backend=backend)
        if not args.eager and not model.compile_decoding():
            raise SystemExit("compiled decoding is unavailable here (the warning above says why)")
    return target, draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("draft")
    parser.add_argument("--draft-quantize", choices=["none", "int8"], default="int8")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument("--dtype", type=arguments.dtype, default="float32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--eager", action="store_true", help="decode without compiling (a check of the script)")
    args = parser.parse_args()

    pairs = {backend: load_pair(args, backend) for backend in BACKENDS}
    corpus = load_corpus(pairs["auto"][0].run_config.data)
    prompt = eval_windows(corpus.val, 128, args.batch_size, seed=0)[:, :128].long()
    sampling = SamplingConfig()

    def base(target: Transformer, seed: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            generate(target, prompt, args.max_new_tokens, sampling, generator=torch.Generator().manual_seed(seed))
        return time.perf_counter() - started

    def speculative(target: Transformer, draft: Transformer, seed: int) -> float:
        started = time.perf_counter()
        speculative_generate(target, draft, prompt, args.max_new_tokens, args.gamma, sampling,
                             generator=torch.Generator().manual_seed(seed))
        return time.perf_counter() - started

    for target, draft in pairs.values():  # warm-up: the graphs of every window
        base(target, 0)
        for seed in range(2):
            speculative(target, draft, seed)
    rows = {backend: [] for backend in BACKENDS}
    for round_index in range(args.rounds):
        for backend, (target, draft) in pairs.items():
            base_s, speculative_s = base(target, round_index), speculative(target, draft, round_index)
            row = {"round": round_index, "backend": backend, "base_ms": round(1e3 * base_s, 1),
                   "speculative_ms": round(1e3 * speculative_s, 1), "speedup": round(base_s / speculative_s, 3)}
            rows[backend].append(row)
            print(json.dumps(row), flush=True)
    summary = {"batch_size": args.batch_size, "gamma": args.gamma, "dtype": args.dtype, "rounds": args.rounds,
               "threads": torch.get_num_threads(), "compiled": not args.eager}
    for backend, collected in rows.items():
        summary[backend] = {key: statistics.median(row[key] for row in collected)
                            for key in ("base_ms", "speculative_ms", "speedup")}
    paired = list(zip(rows["auto"], rows["torch"], strict=True))
    for key in ("base_ms", "speculative_ms"):
        summary[f"operator / torch, {key[:-3]}"] = round(statistics.median(a[key] / b[key] for a, b in paired), 3)
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
