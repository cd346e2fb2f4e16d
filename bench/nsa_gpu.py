"""One NSA layer against full attention (torch's scaled_dot_product_attention, flash kernel) on a
GPU: forward and forward+backward time and peak memory per length, and per-token decode latency
with the cache at long contexts. All in one process; medians after warm-up, timed by
attnlab.bench.measure (device-synchronised wall clock).

    python bench/nsa_gpu.py --out docs/bench/nsa-gpu        # 8k-64k, bf16, paper-sized layer

    python bench/nsa_gpu.py --out DIR --seq-len --context --kernels 8192 65536   # each branch alone
    python bench/nsa_gpu.py --out DIR --seq-len --context --train                 # tokens/s and MFU

`--kernels`: each NSA branch on the triton back-end's kernels (compressed branch with the
selection, selected branch, the sliding window on FlexAttention) and on the torch reference, and
full causal attention alone (SDPA flash, and flash-attn's flash_attn_func where installed), forward
and forward+backward, without the projections. `--train`: a short training run of a small model
(`--train-depth` layers at `--train-len` tokens, bf16 autocast) per configuration, tokens/s and MFU.

Layer (defaults, the NSA paper's settings): 32 query heads of 64 over 2 key/value heads (GQA groups
of 16), compressed blocks of 32 with stride 16 (MLP compressor), selection blocks of 64, 16
selected, sliding window 512. Both layers include their projections. Writes layer.jsonl,
decode.jsonl, a markdown table (layer.md, or decode.md when only decoding) and a profile of the
largest NSA layer (profile.txt).
On a CPU (`--device cpu`, small lengths) it is a dry run of the script itself.
"""

from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path
from typing import Any

import torch

from attnlab.bench.measure import DTYPES, attention_layer, environment, measure_decode, measure_layer


def layer_values(args: argparse.Namespace, kind: str, backend: str | None, seq_len: int, depth: int = 1) -> dict:
    nsa = dict(sliding_window_size=args.window, compress_block_size=args.compress_block,
               compress_stride=args.compress_stride, selection_block_size=args.selection_block,
               num_selected=args.num_selected, query_chunk_size=args.query_chunk, backend=backend or "torch")
    return dict(num_tokens=256, dim=args.heads * args.dim_head, depth=depth, heads=args.heads,
                dim_head=args.dim_head, kv_heads=args.kv_heads, max_seq_len=seq_len,
                attention=dict(kind=kind, nsa=nsa))


def measure(args, kind: str, backend: str | None, seq_len: int) -> dict[str, Any]:
    values = layer_values(args, kind, backend, seq_len)
    result = measure_layer(values, seq_len, 1, args.repeats, args.warmup, device=args.device, dtype=args.dtype)
    return {**result, "backend": backend}


def profile_layer(args, backend: str, seq_len: int, device: torch.device, path: Path) -> None:
    """The top kernels of one NSA forward+backward (where the time goes)."""
    from torch.profiler import ProfilerActivity, profile

    layer, config = attention_layer(layer_values(args, "nsa", backend, seq_len), seq_len, args.device, args.dtype)
    x = torch.randn(1, seq_len, config.dim, device=device, dtype=DTYPES[args.dtype], requires_grad=True)
    layer(x).sum().backward()  # warm-up (compilation)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        layer(x).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = profiler.key_averages().table(sort_by=sort, row_limit=30)
    path.write_text(f"NSA backend={backend} seq_len={seq_len}\n{table}")


def timed_ms(function, device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of function() (device-synchronised wall clock), after warm-up."""
    import statistics
    import time

    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def kernel_cases(args, seq_len: int, device: torch.device) -> dict[str, Any]:
    """Each NSA branch on its triton kernels and on the torch reference, and full causal attention
    (SDPA flash; flash-attn where installed), on random bf16/fp32 inputs of one sequence: name ->
    a function of requires_grad returning the output(s) to sum."""
    from attnlab.attention.kernels import nsa_compressed_triton, nsa_triton
    from attnlab.attention.kernels.flex_local import flex_local_attention
    from attnlab.attention.local import local_attention
    from attnlab.attention.nsa import compressed_branch, n_complete_blocks, selected_attention
    from attnlab.config import NSAAttentionConfig

    dtype, heads, groups, dim_head = DTYPES[args.dtype], args.heads, args.kv_heads, args.dim_head
    config = NSAAttentionConfig(compress_block_size=args.compress_block, compress_stride=args.compress_stride,
                                selection_block_size=args.selection_block, num_selected=args.num_selected,
                                sliding_window_size=args.window, query_chunk_size=args.query_chunk)
    n_blocks = n_complete_blocks(seq_len, args.compress_block, args.compress_stride)
    q = torch.randn(1, heads, seq_len, dim_head, device=device, dtype=dtype)
    k, v = (torch.randn(1, groups, seq_len, dim_head, device=device, dtype=dtype) for _ in range(2))
    compressed_k, compressed_v = (torch.randn(1, groups, 1 + n_blocks, dim_head, device=device, dtype=dtype)
                                  for _ in range(2))
    positions = torch.arange(seq_len, device=device)
    with torch.no_grad():  # one selection, made once, for the selected branch's timings
        _, indices, valid, _ = nsa_compressed_triton.compressed_branch(
            q, compressed_k, compressed_v, config.compress_block_size, config.compress_stride,
            config.selection_block_size, config.num_selected, False)
    sizes = (config.compress_block_size, config.compress_stride, config.selection_block_size, config.num_selected)
    cases = {
        ("compressed+selection", "triton"): lambda q, ck, cv, k, v: nsa_compressed_triton.compressed_branch(
            q, ck, cv, *sizes, False)[0],
        ("compressed+selection", "torch"): lambda q, ck, cv, k, v: compressed_branch(
            q, ck, cv, positions, 0, config)[0],
        ("selected", "triton"): lambda q, ck, cv, k, v: nsa_triton.selected_attention(
            q, k, v, indices, valid, None, 0, config.selection_block_size),
        ("selected", "torch"): lambda q, ck, cv, k, v: selected_attention(
            q, k, v, indices, valid, None, positions, config.selection_block_size, config.query_chunk_size),
        ("sliding", "flex"): lambda q, ck, cv, k, v: flex_local_attention(q, k, v, config.sliding_window_size),
        ("sliding", "torch"): lambda q, ck, cv, k, v: local_attention(q, k, v, config.sliding_window_size),
        ("full", "sdpa flash"): lambda q, ck, cv, k, v: sdpa_flash(q, k, v),
    }
    if flash_attn_function() is not None:
        cases[("full", "flash-attn")] = lambda q, ck, cv, k, v: flash_attn_function()(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    return {"cases": cases, "inputs": (q, compressed_k, compressed_v, k, v)}


def sdpa_flash(q, k, v):
    """Causal SDPA on its flash kernel, the key/value heads repeated to the query heads' count."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    repeat = q.shape[1] // k.shape[1]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1), is_causal=True)


def flash_attn_function():
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def measure_kernels(args, seq_len: int, device: torch.device) -> list[dict[str, Any]]:
    """Forward and forward+backward of each case of kernel_cases at one length."""
    built = kernel_cases(args, seq_len, device)
    results = []
    for (branch, backend), function in built["cases"].items():
        details = {"kind": "kernel", "branch": branch, "backend": backend, "seq_len": seq_len}
        results.append({**details, **run_guarded(time_kernel, details, function, built["inputs"], args, device)})
    return results


def time_kernel(function, inputs, args, device) -> dict[str, Any]:
    leaves = [tensor.detach().requires_grad_() for tensor in inputs]

    def forward() -> None:
        with torch.no_grad():
            function(*inputs)

    def forward_backward() -> None:
        function(*leaves).float().sum().backward()
        for leaf in leaves:
            leaf.grad = None

    return {"forward_ms": timed_ms(forward, device, args.warmup, args.repeats),
            "forward_backward_ms": timed_ms(forward_backward, device, args.warmup, args.repeats)}


def kernel_markdown(kernels: list[dict[str, Any]]) -> list[str]:
    lines = ["", "### Each NSA branch on its kernels and on the torch reference, and full attention alone", "",
             "| branch | backend | seq_len | forward (ms) | fwd+bwd (ms) |", "|---|---|---:|---:|---:|"]
    for r in kernels:
        if "error" in r:
            lines.append(f"| {r['branch']} | {r['backend']} | {r['seq_len']} | failed: {r['error'][:80]} | |")
        else:
            lines.append(f"| {r['branch']} | {r['backend']} | {r['seq_len']} | {r['forward_ms']:.2f} "
                         f"| {r['forward_backward_ms']:.2f} |")
    return lines


def measure_training(args, backend: str | None, device: torch.device) -> dict[str, Any]:
    """A short training run of a small model (autocast to --dtype, AdamW): tokens/s and MFU."""
    from attnlab.bench.measure import measure_train

    kind = "full" if backend is None else "nsa"
    values = layer_values(args, kind, backend, args.train_len, depth=args.train_depth)
    result = measure_train(values, args.train_len, 1, args.train_steps, 2, device=args.device, dtype=args.dtype)
    return {**result, "backend": backend}


def train_markdown(trains: list[dict[str, Any]]) -> list[str]:
    lines = ["", "### A short training run (AdamW, autocast to the table's dtype)", "",
             "| attention | backend | seq_len | step (ms) | tokens/s | MFU |", "|---|---|---:|---:|---:|---:|"]
    for r in trains:
        if "error" in r:
            lines.append(f"| {r['attention']} | {r.get('backend') or 'sdpa'} | | failed: {r['error'][:80]} | | |")
            continue
        mfu = "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
        lines.append(f"| {r['attention']} | {r.get('backend') or 'sdpa'} | {r['seq_len']} | {r['step_ms']:.1f} "
                     f"| {r['tokens_per_s']:.0f} | {mfu} |")
    return lines


def record(result: dict[str, Any], path: Path) -> dict[str, Any]:
    """Print a result and append it to a JSON-lines file; return it."""
    print(json.dumps(result), flush=True)
    with open(path, "a") as handle:
        handle.write(json.dumps(result) + "\n")
    return result


def run_guarded(function, details: dict[str, Any], *args, **kwargs) -> dict[str, Any]:
    """function(*args, **kwargs), or `details` with the error where it fails (the rest still runs)."""
    try:
        return function(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - a failing configuration is reported, the rest still runs
        message = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        traceback.print_exc()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"error": message, **details}


def markdown(layers: list[dict], decodes: list[dict], header: str) -> str:
    lines = [header]
    if layers:
        lines += ["", "### One layer, forward and forward+backward", "",
                  "| attention | backend | seq_len | forward (ms) | fwd+bwd (ms) | fwd+bwd peak (MiB) "
                  "| forward speedup | fwd+bwd speedup |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
    full = {r["seq_len"]: r for r in layers if r.get("attention") == "full" and "error" not in r}
    for r in layers:
        if "error" in r:
            lines.append(f"| {r.get('attention')} | {r.get('backend') or '-'} | {r.get('seq_len')} | "
                         f"failed: {r['error'][:80]} | | | | |")
            continue
        base = full.get(r["seq_len"])
        forward = f"{base['forward_ms'] / r['forward_ms']:.2f}x" if base else ""
        both = f"{base['forward_backward_ms'] / r['forward_backward_ms']:.2f}x" if base else ""
        peak = r.get("forward_backward_peak_mb")
        peak = None if peak is None else peak * 1e6 / 2**20  # MiB
        lines.append(f"| {r['attention']} | {r.get('backend') or 'sdpa'} | {r['seq_len']} | {r['forward_ms']:.2f} | "
                     f"{r['forward_backward_ms']:.2f} | {'' if peak is None else f'{peak:.0f}'} | {forward} | {both} |")
    if decodes:
        lines += ["", "### Decoding one token with the cache", "",
                  "| attention | backend | context | ms per token | key/value tokens loaded per layer |",
                  "|---|---|---:|---:|---:|"]
        for r in decodes:
            if "error" in r:
                lines.append(f"| {r.get('attention')} | {r.get('backend') or '-'} | {r.get('context')} "
                             f"| failed: {r['error'][:80]} | |")
                continue
            loaded = r.get("kv_tokens_loaded")
            loaded = r["context"] + 1 if r["attention"] == "full" else (f"{loaded:.0f}" if loaded else "")
            lines.append(f"| {r['attention']} | {r.get('backend') or 'sdpa'} | {r['context']} "
                         f"| {r['ms_per_token']:.2f} | {loaded} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--seq-len", type=int, nargs="*", default=[8192, 16384, 32768, 65536],
                        help="layer lengths (none: skip the layer timings)")
    parser.add_argument("--context", type=int, nargs="*", default=[8192, 16384, 32768, 65536],
                        help="decode contexts (none: skip decoding)")
    parser.add_argument("--backends", nargs="+", default=["triton", "torch"], help="NSA back-ends timed")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim-head", type=int, default=64)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--compress-block", type=int, default=32)
    parser.add_argument("--compress-stride", type=int, default=16)
    parser.add_argument("--selection-block", type=int, default=64)
    parser.add_argument("--num-selected", type=int, default=16)
    parser.add_argument("--query-chunk", type=int, default=2048, help="NSA query_chunk_size")
    parser.add_argument("--decode-depth", type=int, default=2, help="layers of the decoding model")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kernels", type=int, nargs="*", default=[],
                        help="lengths at which each NSA branch's kernels, its reference and full attention are timed")
    parser.add_argument("--train", action="store_true", help="a short training run per configuration: tokens/s, MFU")
    parser.add_argument("--train-len", type=int, default=8192)
    parser.add_argument("--train-depth", type=int, default=4)
    parser.add_argument("--train-steps", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="profile one NSA layer (first back-end)")
    parser.add_argument("--profile-len", type=int, default=65536)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON lines, table and profile")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    info = environment(device, args.dtype)
    layers: list[dict] = []
    decodes: list[dict] = []
    configurations = [("full", None)] + [("nsa", backend) for backend in args.backends]
    for seq_len in args.seq_len:
        for kind, backend in configurations:
            details = {"kind": "layer", "attention": kind, "backend": backend, "seq_len": seq_len}
            layers.append(record(run_guarded(measure, details, args, kind, backend, seq_len), args.out / "layer.jsonl"))
    for context in args.context:
        for kind, backend in configurations:
            values = layer_values(args, kind, backend, context + args.new_tokens, depth=args.decode_depth)
            details = {"kind": "decode", "attention": kind, "backend": backend, "context": context}
            result = run_guarded(measure_decode, details, values, context, args.new_tokens, use_cache=True,
                                 device=args.device, dtype=args.dtype)
            decodes.append(record({**result, "backend": backend}, args.out / "decode.jsonl"))
    kernels = [record(result, args.out / "kernels.jsonl")
               for seq_len in args.kernels for result in measure_kernels(args, seq_len, device)]
    trains = []
    if args.train:
        for kind, backend in configurations:
            details = {"kind": "train", "attention": kind, "backend": backend}
            trains.append(record(run_guarded(measure_training, details, args, backend, device),
                                 args.out / "train.jsonl"))
    if args.profile:
        run_guarded(profile_layer, {}, args, args.backends[0], args.profile_len, device, args.out / "profile.txt")
    header = (f"Machine: {info.get('gpu', info['machine'])}, torch {info.get('torch')}, "
              f"{args.dtype}. Layer: {args.heads} heads of {args.dim_head}, {args.kv_heads} key/value heads; "
              f"NSA compressed {args.compress_block}/{args.compress_stride}, selection {args.selection_block} x "
              f"{args.num_selected}, window {args.window}. Decoding: a {args.decode_depth}-layer model, median of "
              f"{args.new_tokens} tokens. Medians of {args.repeats} after {args.warmup} warm-up.")
    table = markdown(layers, decodes, header)
    extra = (kernel_markdown(kernels) if kernels else []) + (train_markdown(trains) if trains else [])
    table += "\n".join(extra) + ("\n" if extra else "")
    name = "layer.md" if layers else "decode.md" if decodes else "kernels.md" if kernels else "train.md"
    (args.out / name).write_text(table)
    print(table)


if __name__ == "__main__":
    main()
