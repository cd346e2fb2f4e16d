"""Benchmark measurements, each meant to run in a fresh process (see bench/runner.py).

Training: median time of an optimiser step (forward, backward, AdamW) after warm-up, tokens/s,
and peak memory: on CUDA the allocator's peak, on CPU the growth of the process's resident-set
high-water mark over its size before the measured steps (Linux /proc; the mark is reset first).
On the CPU the runner takes the peak from a run in which glibc returns freed blocks at once (so
that the mark follows live memory) and the time from a run with the allocator as users have it.

Decoding: per-token latency with the KV cache after prefilling a context of length C, and the
same without the cache (re-running the whole prefix for each token), median over tokens.
"""

from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from attnlab.config import ModelConfig, config_from_dict

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_config_from(values: dict[str, Any]) -> ModelConfig:
    """A benchmark's model settings (attnlab's names, nested dicts) as a checked ModelConfig."""
    return config_from_dict(values, ModelConfig)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_bytes(field: str) -> int | None:
    status = Path("/proc/self/status")
    if not status.exists():
        return None
    for line in status.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def _reset_peak(device: torch.device) -> int | None:
    """Reset the peak-memory mark; return the baseline it is measured from."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        return None
    return _rss_bytes("VmRSS")


def _peak_since(device: torch.device, baseline: int | None) -> int | None:
    if baseline is None:
        return None
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - baseline
    peak = _rss_bytes("VmHWM")
    return None if peak is None else peak - baseline


def environment(device: torch.device, dtype: str) -> dict[str, Any]:
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "device": device.type,
        "machine": platform.processor() or platform.machine(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def measure_train(
    model_values: dict[str, Any], seq_len: int, batch_size: int, steps: int, warmup: int,
    device: str = "cpu", dtype: str = "fp32",
) -> dict[str, Any]:
    """Training steps of the configured model: tokens/s and MFU (the median step of `steps` after
    `warmup`) and peak memory; bfloat16 or float16 under autocast."""
    from attnlab.model import Transformer

    torch_device = torch.device(device)
    config = model_config_from({**model_values, "max_seq_len": max(seq_len, model_values.get("max_seq_len", 0))})
    torch.manual_seed(0)
    model = Transformer(config).to(torch_device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.num_tokens, (batch_size, seq_len + 1), device=torch_device)
    autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]

    def step() -> None:
        with torch.autocast(torch_device.type, dtype=autocast_dtype or torch.float32,
                            enabled=autocast_dtype is not None):
            loss = model(tokens[:, :-1], targets=tokens[:, 1:]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    _synchronize(torch_device)
    baseline = _reset_peak(torch_device)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        _synchronize(torch_device)
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    peak = _peak_since(torch_device, baseline)
    from attnlab.flops import flops_per_token, peak_flops

    model_flops = flops_per_token(config, seq_len) * batch_size * seq_len / median  # FLOP/s
    device_peak_flops = peak_flops(torch_device, autocast_dtype)  # not `peak`: that is the memory peak
    return {
        "kind": "train", "attention": config.attention.kind, "seq_len": seq_len, "batch_size": batch_size,
        "step_ms": median * 1e3, "tokens_per_s": batch_size * seq_len / median,
        "model_tflops_per_s": model_flops / 1e12, "mfu": model_flops / device_peak_flops if device_peak_flops else None,
        "peak_memory_mb": None if peak is None else peak / 2**20,
        "parameters": model.num_parameters(), "steps": steps, **environment(torch_device, dtype),
    }


@torch.no_grad()
def measure_decode(
    model_values: dict[str, Any], context: int, new_tokens: int, use_cache: bool,
    device: str = "cpu", dtype: str = "fp32", compile: bool = False, cache_dtype: str | None = None,
) -> dict[str, Any]:
    """compile: decode with the model's compiled step (its compilation is the first, untimed token).
    cache_dtype: the cache's keys and values (a short name, bf16; None: the weights' dtype)."""
    from attnlab.model import Transformer

    torch_device = torch.device(device)
    length = context + new_tokens
    config = model_config_from({**model_values, "max_seq_len": max(length, model_values.get("max_seq_len", 0))})
    torch.manual_seed(0)
    model = Transformer(config).to(torch_device).eval()
    if dtype != "fp32":
        model = model.to(DTYPES[dtype])
    if compile:
        model.compile_decoding()
    sequence = torch.randint(0, config.num_tokens, (1, length), device=torch_device)
    times = []
    loaded = []  # key/value tokens one query read per layer and step, where the cache reports it (NSA)
    # decoding as generate() decodes: under inference mode (the model was made outside it, so a
    # compiled step packs its weights)
    with torch.inference_mode():
        if use_cache:
            cache = model.new_cache(1, length, dtype=cache_dtype and DTYPES[cache_dtype])
            model(sequence[:, :context], cache=cache)
            for position in range(context, length):
                _synchronize(torch_device)
                started = time.perf_counter()
                model(sequence[:, position : position + 1], cache=cache)
                _synchronize(torch_device)
                times.append(time.perf_counter() - started)
                counts = [getattr(layer, "kv_tokens_loaded", None) for layer in cache.layers]
                if None not in counts:
                    loaded.append(sum(counts) / len(counts))
        else:
            for position in range(context, length):
                _synchronize(torch_device)
                started = time.perf_counter()
                model(sequence[:, : position + 1])
                _synchronize(torch_device)
                times.append(time.perf_counter() - started)
    median = statistics.median(times[1:] if len(times) > 1 else times)
    return {
        "kind": "decode", "attention": config.attention.kind, "context": context, "cache": use_cache,
        "ms_per_token": median * 1e3, "tokens_per_s": 1 / median, "new_tokens": new_tokens,
        # whether the compiled step served to the end (a failed one leaves decoding eager), and its products
        "compiled": model.decoding_linear is not None, "linear": model.decoding_linear,
        "cache_dtype": (cache_dtype or dtype) if use_cache else None,
        "kv_tokens_loaded": statistics.mean(loaded) if loaded else None,  # paper NSA's Table 4 quantity
        **environment(torch_device, dtype),
    }


def attention_layer(model_values: dict[str, Any], seq_len: int, device: str, dtype: str):
    """One attention layer of the configured model, in training mode on `device` in `dtype`, with
    its rotary table there too -> (layer, model config)."""
    from attnlab.attention.base import RotaryEmbedding
    from attnlab.model.transformer import Block

    torch_device = torch.device(device)
    config = model_config_from({**model_values, "max_seq_len": max(seq_len, model_values.get("max_seq_len", 0))})
    torch.manual_seed(0)
    rotary = RotaryEmbedding(config.dim_head, config.rope_theta, seq_len) if config.position == "rotary" else None
    attention = Block(config, 0, rotary).attention.to(torch_device, DTYPES[dtype]).train()
    if rotary is not None:
        rotary.to(torch_device)
    return attention, config


def measure_layer(
    model_values: dict[str, Any], seq_len: int, batch_size: int, repeats: int, warmup: int,
    device: str = "cpu", dtype: str = "fp32",
) -> dict[str, Any]:
    """Forward and forward+backward time of one attention layer alone (median of `repeats`), and
    the peak memory of one forward+backward."""
    torch_device = torch.device(device)
    attention, config = attention_layer(model_values, seq_len, device, dtype)
    x = torch.randn(batch_size, seq_len, config.dim, device=torch_device, dtype=DTYPES[dtype], requires_grad=True)

    def timed(function) -> float:
        for _ in range(warmup):
            function()
        times = []
        for _ in range(repeats):
            _synchronize(torch_device)
            started = time.perf_counter()
            function()
            _synchronize(torch_device)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    def forward() -> None:
        with torch.no_grad():
            attention(x)

    def forward_backward() -> None:
        attention(x).sum().backward()
        x.grad = None
        attention.zero_grad(set_to_none=True)

    result = {
        "kind": "layer", "attention": config.attention.kind, "seq_len": seq_len, "batch_size": batch_size,
        "forward_ms": timed(forward) * 1e3, "forward_backward_ms": timed(forward_backward) * 1e3,
    }
    _synchronize(torch_device)
    baseline = _reset_peak(torch_device)
    forward_backward()
    _synchronize(torch_device)
    peak = _peak_since(torch_device, baseline)
    return {**result, "forward_backward_peak_mb": None if peak is None else max(peak, 0) / 1e6,
            **environment(torch_device, dtype)}
