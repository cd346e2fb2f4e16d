"""Local (sliding-window) causal attention: each token attends to the last `window_size` tokens,
itself included.

As used by the Longformer (Beltagy et al., arXiv 2004.05150) and as the local heads of the Routing
and Sinkhorn Transformers. Computed in blocks of `window` queries, each attending to its own
block and the one before, so memory is O(T * window), never T x T. A call through a cache runs on
the `cpu` back-end's operator on the CPU (kernels/decode_cpu.py) or the `triton` back-end's kernels
on CUDA (kernels/decode_triton.py) where they serve.

Legend: B batch, T queries, S keys, H query heads, G key/value heads, D head width,
N query blocks, W window.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.attention.base import (
    Attention,
    AttentionSpec,
    KVCache,
    expand_kv,
    new_lengths,
    overlapping_windows,
    sdpa,
    select_rows,
    window_positions,
    write_rows,
)
from attnlab.attention.kernels import check_backend, choose, choose_cached, decode_cpu, decode_triton
from attnlab.attention.kernels.flex_local import flex_local_attention
from attnlab.config import LocalAttentionConfig
from attnlab.errors import ConfigError
from attnlab.registry import ATTENTION


def window_attention(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, window: int,
                     dropout: float = 0.0) -> Tensor:
    """Sliding-window attention of queries q [B, H, T, D] at positions [B, T] (each row's own) over
    a cache's storage keys, values [B, G, L, D]: each query gathers the `window` positions ending at
    its own (fixed shapes whatever the position: a decode step compiles once). -> [B, H, T, D]."""
    batch, n_heads, n_queries, dim_head = q.shape
    n_groups = keys.shape[1]
    index, valid = window_positions(positions, window)  # [B, T, W]
    index = index[:, None].expand(-1, n_groups, -1, -1)  # [B, G, T, W]
    window_keys, window_values = select_rows(keys, index), select_rows(values, index)  # [B, G, T, W, D]
    grouped = q.reshape(batch, n_groups, n_heads // n_groups, n_queries, dim_head)  # [B, G, R, T, D]
    scores = torch.einsum("bgrtd,bgtwd->bgrtw", grouped, window_keys.to(q.dtype)) / math.sqrt(dim_head)
    probs = torch.softmax(scores.masked_fill(~valid[:, None, None], float("-inf")), dim=-1)
    probs = F.dropout(probs, dropout) if dropout else probs
    out = torch.einsum("bgrtw,bgtwd->bgrtd", probs, window_values.to(q.dtype))
    return out.reshape(batch, n_heads, n_queries, dim_head)


def cached_window_attention(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, window: int,
                            backend: str, dropout: float = 0.0) -> Tensor:
    """window_attention (backend torch), or with the window the cpu back-end's operator (backend cpu,
    kernels/decode_cpu.py) or the triton back-end's kernels (backend triton, kernels/decode_triton.py):
    the storage read in place, a slice of its heads too; no dropout."""
    if backend == "cpu":
        return decode_cpu.cached_attention(q, keys, values, positions, window)
    if backend == "triton":
        return decode_triton.cached_attention(q, keys, values, positions, window)
    return window_attention(q, keys, values, positions, window, dropout)


def local_attention(q: Tensor, k: Tensor, v: Tensor, window: int, dropout: float = 0.0) -> Tensor:
    """Banded causal attention. q [B, H, T, D] are the last T of the S >= T keys k, v [B, G, S, D];
    query i (key index S - T + i) sees keys S - T + i - window < j <= S - T + i. -> [B, H, T, D]."""
    batch, n_heads, n_queries, dim_head = q.shape
    n_keys = k.shape[2]
    if n_queries == 1:  # the last `window` keys, no mask needed
        return sdpa(q, k[:, :, -window:], v[:, :, -window:], mask=None, causal=False, dropout=dropout)
    if n_queries < window:  # a short chunk (speculative verification): one band, no block padding
        n_seen = min(n_keys, window - 1 + n_queries)  # the keys the first query still sees, and on
        query = n_seen - n_queries + torch.arange(n_queries, device=q.device)[:, None]  # [T, 1]
        key = torch.arange(n_seen, device=q.device)
        band = (key <= query) & (key > query - window)  # [T, S']
        return sdpa(q, k[:, :, -n_seen:], v[:, :, -n_seen:], mask=band[None, None], causal=False, dropout=dropout)
    n_blocks = math.ceil(n_queries / window)
    # Lay keys out so that index 0 is `window` positions before the first query.
    n_before = n_keys - n_queries
    if n_before >= window:
        k, v, pad_left = k[:, :, n_before - window :], v[:, :, n_before - window :], 0
    else:
        pad_left = window - n_before
    pad_right = n_blocks * window - n_queries
    k = F.pad(k, (0, 0, pad_left, pad_right))  # [B, G, (N+1) W, D]
    v = F.pad(v, (0, 0, pad_left, pad_right))
    q = F.pad(q, (0, 0, 0, pad_right)).reshape(batch, n_heads, n_blocks, window, dim_head)
    # each query block sees its own keys and the previous block's: windows of 2W with step W
    k = overlapping_windows(expand_kv(k, n_heads), 2 * window, window)  # [B, H, N, 2W, D]
    v = overlapping_windows(expand_kv(v, n_heads), 2 * window, window)

    query = torch.arange(window, device=q.device)[:, None]  # position W + query in the key block
    key = torch.arange(2 * window, device=q.device)[None, :]
    band = (key > query) & (key <= query + window)  # [W, 2W]
    key_index = torch.arange(n_blocks, device=q.device)[:, None] * window + key  # [N, 2W]
    mask = band & (key_index >= pad_left)[:, None, :]  # [N, W, 2W]; left padding never visible

    flat = (batch, n_heads * n_blocks)
    y = sdpa(
        q.reshape(*flat, window, dim_head),
        k.reshape(*flat, 2 * window, dim_head),
        v.reshape(*flat, 2 * window, dim_head),
        # a 4-D mask keeps SDPA on its fused CPU kernel (a 3-D one sends it to the slower math path)
        mask=mask.expand(n_heads, -1, -1, -1).reshape(1, n_heads * n_blocks, window, 2 * window),
        causal=False,
        dropout=dropout,
    )
    return y.reshape(batch, n_heads, n_blocks * window, dim_head)[:, :, :n_queries]


class LocalCache(KVCache):
    """Keys and values of every fed token, [B, G, max_len, D]; a query reads the last window of them
    (window_attention). Keeping every position makes any rollback exact."""

    def __init__(self, lengths: Tensor, max_len: int, n_kv_heads: int, dim_head: int, dtype) -> None:
        super().__init__(lengths, max_len)
        shape = (lengths.shape[0], n_kv_heads, max_len, dim_head)
        self.keys = torch.zeros(shape, device=lengths.device, dtype=dtype)
        self.values = torch.zeros(shape, device=lengths.device, dtype=dtype)


OFFERED = ("torch", "flex", "cpu", "triton")  # cpu, triton: calls through a cache only (choose_cached)
WHOLE_SEQUENCE = ("torch", "flex")  # the back-ends of a whole sequence (choose)


@ATTENTION.register("local")
class LocalAttention(Attention):
    config_class = LocalAttentionConfig

    @staticmethod
    def keys_per_query(config: LocalAttentionConfig, seq_len: int, n_heads: int, layer_index: int) -> float:
        return float(min(config.window_size, seq_len))

    def __init__(self, spec: AttentionSpec, config: LocalAttentionConfig) -> None:
        super().__init__(spec, config)
        check_backend("local", config.backend, OFFERED)
        if config.backend == "flex" and spec.dropout > 0:
            raise ConfigError("attention.local.backend=flex has no attention dropout; set model.attention.dropout=0")

    def forward(self, x: Tensor, cache: LocalCache | None = None) -> Tensor:
        dropout = self.spec.dropout if self.training else 0.0
        window = self.config.window_size
        if cache is None or cache.prefill:  # a whole sequence
            positions = 0 if cache is None else cache.positions(x.shape[1])
            q, k, v = self.heads.split(x, positions)  # q [B, H, T, D], k v [B, G, T, D]
            if cache is not None:
                write_rows(cache.keys, k, positions)
                write_rows(cache.values, v, positions)
            backend = "torch" if self.config.backend in ("cpu", "triton") else self.config.backend
            if choose(backend, WHOLE_SEQUENCE, q, whole=True, dropout=dropout) == "flex":
                return self.heads.merge(flex_local_attention(q, k, v, window))
            return self.heads.merge(local_attention(q, k, v, window, dropout))
        positions = cache.positions(x.shape[1])  # [B, T]
        q, k, v = self.heads.split(x, positions)
        write_rows(cache.keys, k, positions)
        write_rows(cache.values, v, positions)
        backend = choose_cached(self.config.backend, OFFERED, q, cache.keys, dropout)
        return self.heads.merge(cached_window_attention(q, cache.keys, cache.values, positions, window, backend,
                                                        dropout))

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None, lengths: Tensor | None = None) -> LocalCache:
        lengths = new_lengths(batch, device) if lengths is None else lengths
        self.heads.reserve(max_len, lengths.device)
        return LocalCache(lengths, max_len, self.spec.n_kv_heads, self.spec.dim_head, dtype)
