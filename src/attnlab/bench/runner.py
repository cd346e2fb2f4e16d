"""Run each benchmark configuration in a fresh Python process and collect JSON lines.

A fresh process per configuration keeps one measurement's allocator state, compiled kernels and
memory high-water mark from leaking into the next.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from attnlab.config import ModelConfig, config_from_dict, parse_override
from attnlab.errors import AttnlabError
from attnlab.registry import ATTENTION

log = logging.getLogger(__name__)


def model_values(dim: int, depth: int, heads: int, attention: str, overrides: list[str]) -> dict[str, Any]:
    """Model config values for a benchmark: the given size and attention, then `key=value` overrides
    relative to the model config (e.g. attention.local.window_size=64). Checked here, before any
    measurement starts: an unknown attention or a bad value is a one-line ConfigError, not a
    failure in each benchmark's process."""
    values: dict[str, Any] = {"dim": dim, "depth": depth, "heads": heads, "dim_head": dim // heads,
                              "attention": {"kind": attention}}
    for override in overrides:
        _merge(values, parse_override(override))
    import attnlab.attention  # noqa: F401 - registers the variants ATTENTION names

    ATTENTION.get(config_from_dict(values, ModelConfig).attention.kind)
    return values


def _merge(base: dict[str, Any], update: dict[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _worker(task: str, arguments: dict[str, Any], threads: int, timeout: float, follow_memory: bool) -> dict[str, Any]:
    """Run attnlab.bench.measure.<task>(**arguments) in a new process; return its result."""
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if follow_memory:
        # glibc: serve every allocation over 64 KiB by mmap and return it on free, so the process's
        # resident size follows live tensor memory and its high-water mark is the training peak
        environment["MALLOC_MMAP_THRESHOLD_"] = "65536"
    else:
        environment.pop("MALLOC_MMAP_THRESHOLD_", None)
    command = [sys.executable, "-m", "attnlab.bench.worker", task, json.dumps(arguments)]
    completed = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=timeout)
    if completed.returncode != 0:
        tail = completed.stderr.strip().splitlines()[-1:] or ["no output"]
        raise AttnlabError(f"benchmark {task} {arguments} failed: {tail[0]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def run_isolated(task: str, arguments: dict[str, Any], threads: int, timeout: float = 1800) -> dict[str, Any]:
    """Run attnlab.bench.measure.<task>(**arguments) in a new process; return its result.

    Training on the CPU runs twice: once with the allocator set to follow live memory (every
    allocation over 64 KiB its own mapping, returned on free), for the peak memory, and once with
    the allocator as users run it, for the timing. Under the first setting every mid-sized
    temporary is page-faulted afresh, which slows steps unevenly across attention variants (those
    with many temporaries most), so its timings are not reported.
    """
    if task != "train" or arguments.get("device", "cpu") != "cpu":
        return _worker(task, arguments, threads, timeout, follow_memory=True)
    memory = _worker(task, {**arguments, "steps": 1}, threads, timeout, follow_memory=True)
    result = _worker(task, arguments, threads, timeout, follow_memory=False)
    result["peak_memory_mb"] = memory["peak_memory_mb"]
    return result


Job = tuple[str, dict[str, Any]]  # (task: a function of bench/measure.py, its arguments)


def train_jobs(values: dict[str, Any], seq_lens: list[int], batch_size: int, steps: int, warmup: int, device: str,
               dtype: str) -> list[Job]:
    """`attnlab bench train`: one training measurement of the model `values` per sequence length."""
    return [("train", dict(model_values=values, seq_len=n, batch_size=batch_size, steps=steps, warmup=warmup,
                           device=device, dtype=dtype)) for n in seq_lens]


def decode_jobs(values: dict[str, Any], contexts: list[int], new_tokens: int, uncached: bool, device: str,
                dtype: str, compile: bool = False, cache_dtype: str | None = None) -> list[Job]:
    """`attnlab bench decode`: per context, decoding with the cache and (if `uncached`) without it;
    compile: the cached decoding with the compiled step; cache_dtype: its cache's keys and values."""
    return [("decode", dict(model_values=values, context=c, new_tokens=new_tokens, use_cache=cache, device=device,
                            dtype=dtype, compile=compile and cache, cache_dtype=cache_dtype))
            for c in contexts for cache in ([True, False] if uncached else [True])]


def run_jobs(jobs: list[Job], threads: int) -> Iterator[dict[str, Any]]:
    """Each job's result as it finishes (one fresh process each), with its model values under "model"."""
    for task, arguments in jobs:
        result = run_isolated(task, arguments, threads)
        result["model"] = arguments["model_values"]
        yield result


def train_table(results: list[dict[str, Any]]) -> str:
    """Markdown table; model TFLOP/s (flops.py) always, MFU when a peak was known (GPUs)."""
    with_mfu = any(r.get("mfu") is not None for r in results)
    lines = ["| attention | seq_len | batch | tokens/s | step (ms) | peak memory (MB) | model TFLOP/s |"
             + (" MFU |" if with_mfu else ""),
             "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if with_mfu else "")]
    for r in results:
        memory = "n/a" if r["peak_memory_mb"] is None else f"{r['peak_memory_mb']:.0f}"
        tflops = r.get("model_tflops_per_s")
        row = (f"| {r['attention']} | {r['seq_len']} | {r['batch_size']} | {r['tokens_per_s']:.0f} | "
               f"{r['step_ms']:.1f} | {memory} | {'n/a' if tflops is None else f'{tflops:.3g}'} |")
        if with_mfu:
            row += " n/a |" if r.get("mfu") is None else f" {100 * r['mfu']:.1f}% |"
        lines.append(row)
    return "\n".join(lines)


def decode_table(results: list[dict[str, Any]]) -> str:
    cached = {(r["attention"], r["context"]): r for r in results if r["cache"]}
    uncached = {(r["attention"], r["context"]): r for r in results if not r["cache"]}
    lines = ["| attention | context | cached (ms/token) | no cache (ms/token) | cache speedup "
             "| kv tokens loaded/step |", "|---|---:|---:|---:|---:|---:|"]
    for key in sorted(cached.keys() | uncached.keys()):
        with_cache, without = cached.get(key), uncached.get(key)
        a = f"{with_cache['ms_per_token']:.2f}" if with_cache else "-"
        b = f"{without['ms_per_token']:.2f}" if without else "-"
        speedup = f"{without['ms_per_token'] / with_cache['ms_per_token']:.1f}x" if with_cache and without else "-"
        # per query and layer, as the cache reports it (NSA); a full-attention cache reads all `context` keys
        count = with_cache.get("kv_tokens_loaded") if with_cache else None
        loaded = "-" if count is None else f"{count:.0f}"
        lines.append(f"| {key[0]} | {key[1]} | {a} | {b} | {speedup} | {loaded} |")
    return "\n".join(lines)
