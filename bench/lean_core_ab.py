"""This checkout's attnlab against an earlier one, side by side in one process on the CPU: training
steps at 4096 tokens of full, routing, sinkhorn and NSA attention (each sparse type's step time
relative to full's, per version), and cached decoding in ms/token of every attention type.

Both versions are imported in this one process (the earlier one from --old-src, loaded first and
kept under its module objects), build their models from the same seed, and are timed in turn,
round by round, so that both see the same machine load; medians are reported. (At b9d0d73 the
earlier version decoded models of 8 MB of linear weights or more with its column products W x^T;
this one uses nn.Linear throughout.)

    git worktree add --detach /tmp/previous b9d0d73
    OMP_NUM_THREADS=2 python bench/lean_core_ab.py --old-src /tmp/previous/src --rounds 7
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

MODEL = dict(dim=256, depth=4, heads=4, dim_head=64)
WINDOW = dict(local={"window_size": 64}, routing={"window_size": 64}, sinkhorn={"bucket_size": 64},
              nsa={"sliding_window_size": 64, "compress_block_size": 16, "compress_stride": 8,
                   "selection_block_size": 16, "num_selected": 4})
# the models timed: name -> (attention kind, key/value heads); NSA and its full baseline use GQA
TRAINED = {"full": ("full", 4), "routing": ("routing", 4), "sinkhorn": ("sinkhorn", 4),
           "full-gqa": ("full", 2), "nsa": ("nsa", 2)}
BASELINE = {"routing": "full", "sinkhorn": "full", "nsa": "full-gqa"}
DECODED = {"full": ("full", 4), "local": ("local", 4), "routing": ("routing", 4), "sinkhorn": ("sinkhorn", 4),
           "nsa": ("nsa", 2)}


def import_version(source: Path | None) -> dict[str, object]:
    """attnlab's modules from `source`, then forgotten by sys.modules so that another version can be
    imported beside them; None: this checkout's, kept."""
    if source is None:
        return {name: importlib.import_module(f"attnlab.{name}") for name in ("config", "model")}
    sys.path.insert(0, str(source))
    modules = {name: importlib.import_module(f"attnlab.{name}") for name in ("config", "model")}
    for name in [name for name in sys.modules if name == "attnlab" or name.startswith("attnlab.")]:
        del sys.modules[name]
    sys.path.remove(str(source))
    return modules


def build(version: dict, kind: str, kv_heads: int, max_seq_len: int):
    values = {**MODEL, "kv_heads": kv_heads, "max_seq_len": max_seq_len, "attention": {"kind": kind, **WINDOW}}
    config = version["config"].config_from_dict(values, version["config"].ModelConfig)
    torch.manual_seed(0)
    return version["model"].Transformer(config)


def train_step_seconds(model, optimizer, tokens: torch.Tensor) -> float:
    started = time.perf_counter()
    model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


@torch.no_grad()
def decode_ms_per_token(model, tokens: torch.Tensor, context: int) -> float:
    cache = model.new_cache(1, tokens.shape[1])
    model(tokens[:, :context], cache=cache)
    times = []
    for position in range(context, tokens.shape[1]):
        started = time.perf_counter()
        model(tokens[:, position : position + 1], cache=cache)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def measure_training(versions: dict, seq_len: int, rounds: int) -> dict:
    models = {}
    for version_name, version in versions.items():
        for name, (kind, kv_heads) in TRAINED.items():
            model = build(version, kind, kv_heads, seq_len).train()
            models[version_name, name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    tokens = torch.randint(0, 256, (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    seconds = {key: [] for key in models}
    for round_ in range(rounds + 1):  # round 0 warms up
        for key, (model, optimizer) in models.items():
            elapsed = train_step_seconds(model, optimizer, tokens)
            if round_:
                seconds[key].append(elapsed)
    medians = {f"{version} {name}": statistics.median(values) * 1e3 for (version, name), values in seconds.items()}
    # per round, the new version's speed vs full over the old one's (a paired figure: a slow spell
    # of the machine within a round touches both versions alike); its median
    def speed(version: str, name: str, baseline: str, round_: int) -> float:
        return seconds[version, baseline][round_] / seconds[version, name][round_]

    paired = {name: statistics.median(speed("new", name, baseline, r) / speed("old", name, baseline, r)
                                      for r in range(rounds)) for name, baseline in BASELINE.items()}
    return medians, paired


def measure_decoding(versions: dict, context: int, new_tokens: int, rounds: int) -> dict:
    length = context + new_tokens
    models = {}
    for version_name, version in versions.items():
        for name, (kind, kv_heads) in DECODED.items():
            models[version_name, name] = build(version, kind, kv_heads, length).eval()
    tokens = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(2))
    times = {key: [] for key in models}
    for round_ in range(rounds + 1):
        for key, model in models.items():
            elapsed = decode_ms_per_token(model, tokens, context)
            if round_:
                times[key].append(elapsed)
    return {f"{version} {name}": statistics.median(values) for (version, name), values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-src", type=Path, required=True, help="the earlier checkout's src/ folder")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-decoding", action="store_true")
    args = parser.parse_args()
    versions = {"old": import_version(args.old_src), "new": import_version(None)}
    report = {"threads": torch.get_num_threads(), "seq_len": args.seq_len, "rounds": args.rounds}
    if not args.skip_training:
        train, paired = measure_training(versions, args.seq_len, args.rounds)
        report["train_step_ms"] = train
        report["paired_new_over_old"] = paired
        report["speed_over_baseline"] = {
            f"{version} {name}": train[f"{version} {baseline}"] / train[f"{version} {name}"]
            for version in versions for name, baseline in BASELINE.items()}
        print(json.dumps(report), flush=True)
    if not args.skip_decoding:
        report["decode_ms_per_token"] = measure_decoding(versions, args.context, args.new_tokens, args.rounds)
        print(json.dumps(report), flush=True)
    print_tables(report)


def print_tables(report: dict) -> None:
    if "train_step_ms" in report:
        print(f"\nTraining step at {report['seq_len']} tokens, median of {report['rounds']} rounds (ms; speed vs full)")
        print("| attention | old | new | old speed vs full | new speed vs full | new / old | paired median |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        train, speed = report["train_step_ms"], report["speed_over_baseline"]
        for name in TRAINED:
            row = f"| {name} | {train['old ' + name]:.0f} | {train['new ' + name]:.0f} |"
            if name in BASELINE:
                old, new = speed["old " + name], speed["new " + name]
                row += f" {old:.2f}x | {new:.2f}x | {new / old:.3f} | {report['paired_new_over_old'][name]:.3f} |"
            else:
                row += " | | | |"
            print(row)
    if "decode_ms_per_token" not in report:
        return
    decode = report["decode_ms_per_token"]
    print(f"\nCached decoding, median ms/token of {report['rounds']} rounds")
    print("| attention | old | new | new / old |")
    print("|---|---:|---:|---:|")
    for name in DECODED:
        old, new = decode["old " + name], decode["new " + name]
        print(f"| {name} | {old:.2f} | {new:.2f} | {new / old:.3f} |")


if __name__ == "__main__":
    main()
