"""The `cpu` back-end of attention's cached calls: a decode step's or a speculative verification's
few queries through a cache's storage, by decode_cpu.cpp (its header says how): over a range of
positions for full and local attention (`cached_attention`), over listed blocks of positions for
routing and sinkhorn attention and NSA's selected branch (`listed_attention`), NSA's compressed
branch with its block selection over the blocks complete at each query (`compressed_selection`),
and routing's keys found by a scan back from each query (`routed_keys`).

The operator attnlab::cached_attention_cpu is C++ through and through (built against torch's
headers, registered with torch's dispatcher), so a compiled decode step calls it from inductor's
C++ wrapper directly: a Python custom operator would cost each call a return to Python, as much
as the attention itself at these sizes. Built on first use like the other CPU kernels
(kernels/cpu.py: cached by source, compiler and CPU); about ten seconds, as it includes torch's
headers. Without a compiler, or with ATTNLAB_CPU_KERNELS=0, `available()` is False and `auto`
takes torch's fused attention.

Legend: B batch, H query heads, G key/value heads, T queries, L storage positions, D head width,
N listed blocks a query reads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from attnlab.attention.kernels.cpu import OperatorLibrary

SOURCE = Path(__file__).parent / "decode_cpu.cpp"
HEAD_WIDTHS = tuple(range(16, 129, 16))  # decode_cpu.cpp's register blocks
MAX_QUERIES = 64  # queries per call (decode_cpu.cpp's MAX_QUERIES)


def _register_fake() -> None:
    """The operator's shape for torch.compile, once it is loaded (its schema is the library's)."""
    torch.library.register_fake("attnlab::cached_attention_cpu")(
        lambda q, keys, values, positions, window, lanes=0: out_layout(q))
    torch.library.register_fake("attnlab::listed_attention_cpu")(
        lambda q, keys, values, starts, biases, block, positions: out_layout(q))
    torch.library.register_fake("attnlab::routed_keys_cpu")(
        lambda clusters, positions, n_keys: clusters.new_empty((*clusters.shape[:2], positions.shape[1], n_keys)))
    torch.library.register_fake("attnlab::compressed_selection_cpu")(
        lambda q, memory, keys, values, positions, compress_block, stride, selection_block, n_select: (
            out_layout(q), positions.new_empty((q.shape[0], keys.shape[1], q.shape[2], n_select))))


_library = OperatorLibrary("attnlab_decode", SOURCE, _register_fake, "using torch's attention")

available = _library.availability()


def serves(q: Tensor) -> bool:
    """Whether the operator takes queries q [B, H, T, D]: head widths 16 to 128 in steps of 16, at most
    MAX_QUERIES queries."""
    return q.shape[-1] in HEAD_WIDTHS and q.shape[-2] <= MAX_QUERIES


def cached_attention(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, window: int = 0,
                     lanes: int = 0) -> Tensor:
    """q [B, H, T, D] at positions [B, T] over a cache's storage keys, values [B, G, L, D]: query t of
    row b sees the keys at lo..positions[b, t] (lo = position - window + 1 with a window, else 0).
    -> [B, H, T, D] in q's dtype, laid out as [B, T, H, D] (out_layout): the heads merge back into
    rows without a copy. q is read through its strides (a slice of the projections, not copied).
    lanes: the keys the kernel scores together, 8 or 16 (0: the CPU's vector width, 16 with
    AVX-512, else 8; the same result up to rounding). The caller has checked that it can
    (kernels.choose_cached)."""
    return torch.ops.attnlab.cached_attention_cpu(q, keys, values, positions, window, lanes)


def listed_attention(q: Tensor, keys: Tensor, values: Tensor, starts: Tensor, biases: Tensor, block: int,
                     positions: Tensor) -> Tensor:
    """q [B, H, T, D] at positions [B, T] over a cache's storage keys, values [B, G, L, D] (each
    position's row contiguous; a slice of its heads is read in place): query t of row b, head h
    sees the keys starts[b, h, t, n] .. + block - 1 of each listed block n (starts [B, H, T, N]
    int64) that lie at or before its position and in the storage, each score raised by the block's
    bias (biases [B, H, T, N] float32; -inf: no such block). -> [B, H, T, D] in q's dtype, laid out
    as out_layout's. The caller has checked that it can (kernels.choose_cached)."""
    return torch.ops.attnlab.listed_attention_cpu(q, keys, values, starts, biases, block, positions)


def routed_keys(clusters: Tensor, positions: Tensor, n_keys: int) -> Tensor:
    """Routing's keys of queries at positions [B, T] over a cache's clusters [B, R, L] (int64): the
    last n_keys positions at or before each query in its own cluster, latest first, -1 past the ones
    there are -> [B, R, T, n_keys] int64, what routing.routed_key_positions's top-k gives (found by a
    scan back from the query instead of a comparison over every stored position)."""
    return torch.ops.attnlab.routed_keys_cpu(clusters, positions, n_keys)


def compressed_selection(q: Tensor, memory: Tensor, keys: Tensor, values: Tensor, positions: Tensor,
                         compress_block: int, stride: int, selection_block: int, n_select: int
                         ) -> tuple[Tensor, Tensor]:
    """NSA's compressed branch and block selection for queries q [B, H, T, D] (no rotary) at
    positions [B, T] through a cache's compressed storage keys, values [B, G, N, D] (block i:
    tokens i * stride .. + compress_block - 1), the memory slot's key and value memory [2, G, D]
    first: each query reads the memory slot and the blocks complete at its position only, and
    chooses n_select selection blocks (attention/nsa.py's choose_blocks; ties: the lower block) from
    its heads' summed probabilities. -> (output [B, H, T, D] in q's dtype, laid out as
    out_layout's; the chosen blocks [B, G, T, n_select] int64, ascending, -1 for slots left empty).
    The caller has checked that it can (kernels.choose_cached)."""
    return torch.ops.attnlab.compressed_selection_cpu(q, memory, keys, values, positions, compress_block, stride,
                                                      selection_block, n_select)


def out_layout(q: Tensor) -> Tensor:
    """An empty output for q [B, H, T, D] as the operator makes it: [B, T, H, D] in memory, seen as
    [B, H, T, D] (decode_cpu.cpp's `out`)."""
    batch, n_heads, n_queries, width = q.shape
    return q.new_empty((batch, n_queries, n_heads, width)).transpose(1, 2)
