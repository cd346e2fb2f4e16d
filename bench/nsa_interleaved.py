"""Training steps of full attention and NSA taken in turn in one process, so that both see the same
machine load (for the step-time ratio on a shared machine; `attnlab bench train` runs them one
after the other). Prints each step's seconds and the per-step ratios, and their median.

    OMP_NUM_THREADS=2 python bench/nsa_interleaved.py --seq-len 4096 --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from attnlab.bench.measure import model_config_from
from attnlab.model import Transformer

NSA = dict(sliding_window_size=64, compress_block_size=16, compress_stride=8, selection_block_size=16, num_selected=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per model (after one warm-up)")
    parser.add_argument("--diff-topk", action="store_true", help="NSA with straight-through top-k (use_diff_topk)")
    args = parser.parse_args()
    models = {}
    for kind in ("full", "nsa"):
        values = dict(dim=256, depth=4, heads=4, dim_head=64, kv_heads=2, max_seq_len=args.seq_len,
                      attention=dict(kind=kind, nsa={**NSA, "use_diff_topk": args.diff_topk}))
        torch.manual_seed(0)
        model = Transformer(model_config_from(values)).train()
        models[kind] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    tokens = torch.randint(0, 256, (1, args.seq_len + 1))
    seconds: dict[str, list[float]] = {kind: [] for kind in models}
    for step in range(args.steps + 1):
        for kind, (model, optimizer) in models.items():
            started = time.perf_counter()
            model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step:  # the first round is warm-up
                seconds[kind].append(time.perf_counter() - started)
    ratios = [full / nsa for full, nsa in zip(seconds["full"], seconds["nsa"], strict=True)]
    print(json.dumps({"seq_len": args.seq_len, "diff_topk": args.diff_topk, "threads": torch.get_num_threads(),
                      "seconds": seconds,
                      "full_over_nsa": ratios, "median_full_over_nsa": statistics.median(ratios)}))


if __name__ == "__main__":
    main()
