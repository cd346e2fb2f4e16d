"""Time and memory to build a FlexAttention BlockMask on the CPU: torch's `create_block_mask`
(the mask evaluated at every batch, head, query and key) against attnlab's tile maps
(kernels/flex.py), for NSA's selected branch and the sliding window. Each case runs in a fresh
process; peak memory is the growth of its resident-set high-water mark while building.

    OMP_NUM_THREADS=2 python bench/flex_masks.py              # markdown table
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

CASES = [("nsa", 4096), ("nsa", 8192), ("sliding", 16384), ("sliding", 65536)]
HEADS, GROUPS, BLOCK, SELECTED, WINDOW = 8, 2, 64, 16, 512


def build(case: str, length: int, method: str) -> None:
    import torch

    from attnlab.attention.kernels.flex_local import sliding_window_block_mask
    from attnlab.attention.kernels.nsa_flex import selection_block_mask
    from attnlab.attention.nsa import choose_blocks
    from attnlab.config import NSAAttentionConfig

    torch.manual_seed(0)
    if case == "nsa":
        config = NSAAttentionConfig(selection_block_size=BLOCK, num_selected=SELECTED, compress_block_size=BLOCK,
                                    compress_stride=BLOCK)
        positions = torch.arange(length)
        indices, valid = choose_blocks(torch.rand(1, GROUPS, length, length // BLOCK), positions, config)
        ours = lambda: selection_block_mask(indices, valid, 0, BLOCK, HEADS // GROUPS, length)  # noqa: E731
        batch, heads = 1, HEADS
    else:
        ours = lambda: sliding_window_block_mask(WINDOW, length, length, torch.device("cpu"), 0)  # noqa: E731
        batch, heads = None, None
    if method == "tiles":
        function = ours
    else:
        from torch.nn.attention.flex_attention import create_block_mask

        mask_mod = ours().mask_mod  # the same mask function, evaluated everywhere
        function = lambda: create_block_mask(mask_mod, batch, heads, length, length, device="cpu")  # noqa: E731
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    block_mask = function()
    seconds = time.perf_counter() - started
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(json.dumps({"case": case, "length": length, "method": method, "seconds": seconds, "peak_mib": peak,
                      "tiles": tiles_visited(block_mask)}))


def tiles_visited(block_mask) -> int:
    """Tiles the kernel visits (partial and full), per batch row and head summed."""
    full = block_mask.full_kv_num_blocks
    return int(block_mask.kv_num_blocks.sum()) + (0 if full is None else int(full.sum()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", nargs=3, metavar=("CASE", "LENGTH", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per case")
    args = parser.parse_args()
    if args.one:
        build(args.one[0], int(args.one[1]), args.one[2])
        return
    print(f"NSA: {HEADS} heads, {GROUPS} key/value groups, blocks of {BLOCK}, {SELECTED} selected; "
          f"sliding window {WINDOW}. Tiles of 128.\n")
    print("| mask | length | create_block_mask (s) | peak (MiB) | tile map (s) | peak (MiB) "
          "| tiles visited: torch / ours |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for case, length in CASES:
        row = {}
        for method in ("create_block_mask", "tiles"):
            command = [sys.executable, __file__, "--one", case, str(length), method]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
                row[method] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
            except subprocess.TimeoutExpired:
                row[method] = None
        old, new = row["create_block_mask"], row["tiles"]
        cell = lambda r, key, f: "failed or timed out" if r is None else f.format(r[key])  # noqa: E731
        same = f"{'-' if old is None else old['tiles']} / {'-' if new is None else new['tiles']}"
        print(f"| {case} | {length} | {cell(old, 'seconds', '{:.2f}')} | {cell(old, 'peak_mib', '{:.0f}')} | "
              f"{cell(new, 'seconds', '{:.3f}')} | {cell(new, 'peak_mib', '{:.0f}')} | {same} |", flush=True)


if __name__ == "__main__":
    main()
