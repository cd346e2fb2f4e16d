"""Memory stays flat over a long run: resident memory (RSS) of a CPU training run, sampled while it
trains, at step 100 and at step 1000 (current and peak so far, from /proc/self/status).

    OMP_NUM_THREADS=2 python bench/memory_flat.py [--out DIR] [--feed-forward swiglu|moe] [overrides...]

Trains minimind-demo at a small size (tokenized padded data, loss mask, evaluation every 100 steps,
samples, checkpoints) for 1000 steps, logging RSS every 10 steps to DIR/rss.jsonl, and prints one
JSON line: the RSS at step 100 and step 1000 and their difference.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from attnlab.config import load_config
from attnlab.train.loop import train


def memory_kib() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process in KiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def last_step(metrics: Path) -> int:
    if not metrics.is_file():
        return -1
    lines = metrics.read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if '"loss"' in line]
    return steps[-1] if steps else -1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("/tmp/attnlab-memory-flat"))
    parser.add_argument("--feed-forward", default="swiglu", choices=["swiglu", "moe"])
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    config = load_config("minimind-demo", [
        f"out_dir={args.out}", f"name=memory-{args.feed_forward}-{int(time.time())}",
        f"model.feed_forward={args.feed_forward}", "model.dim=64", "model.depth=2", "model.dim_head=16",
        "model.ff_hidden=192", "train.seq_len=64", "train.batch_size=8", "train.max_steps=1000",
        "train.eval_every=100", "train.sample_every=500", "train.save_every=500", "train.log_every=10",
        "log.progress=false", *args.overrides,
    ])
    metrics = config.run_dir / "metrics.jsonl"
    samples: list[dict] = []
    done = threading.Event()

    def watch() -> None:
        seen = -1
        while not done.is_set():
            step = last_step(metrics)
            if step != seen:
                seen = step
                rss, peak = memory_kib()
                samples.append({"step": step, "rss_mib": rss / 1024, "peak_rss_mib": peak / 1024})
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.perf_counter()
    train(config)
    done.set()
    watcher.join()
    (config.run_dir / "rss.jsonl").write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    first = min((sample for sample in samples if sample["step"] >= 100), key=lambda sample: sample["step"])
    last = max(samples, key=lambda sample: sample["step"])
    print(json.dumps({
        "feed_forward": args.feed_forward, "seconds": round(time.perf_counter() - started, 1),
        "steps": [first["step"], last["step"]],
        "rss_mib": [round(first["rss_mib"], 1), round(last["rss_mib"], 1)],
        "peak_rss_mib": [round(first["peak_rss_mib"], 1), round(last["peak_rss_mib"], 1)],
        "peak_growth_mib": round(last["peak_rss_mib"] - first["peak_rss_mib"], 1),
    }))


if __name__ == "__main__":
    main()
