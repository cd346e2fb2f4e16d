"""Full causal attention: every token attends to all earlier tokens and itself.

"Attention Is All You Need" (Vaswani et al., arXiv 1706.03762), computed by torch's
scaled_dot_product_attention (flash / memory-efficient kernels where available); a call through a
cache by the `cpu` back-end's operator on the CPU (kernels/decode_cpu.py) or the `triton` back-end's
kernels on CUDA (kernels/decode_triton.py) where they serve: both read only the keys its queries see.

Legend: B batch, T new tokens, H query heads, G key/value heads, D head width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.attention.base import Attention, AttentionSpec, KVCache, masked_attention, new_lengths, sdpa, write_rows
from attnlab.attention.kernels import check_backend, choose_cached, decode_cpu, decode_triton
from attnlab.config import FullAttentionConfig
from attnlab.registry import ATTENTION

OFFERED = ("torch", "cpu", "triton")  # cpu, triton: calls through a cache only


class FullCache(KVCache):
    """Keys and values of every fed token, [B, G, max_len, D]; each new query sees its row's keys up
    to itself (a mask over the whole storage: the same shapes at every position)."""

    def __init__(self, lengths: Tensor, max_len: int, n_kv_heads: int, dim_head: int, dtype) -> None:
        super().__init__(lengths, max_len)
        shape = (lengths.shape[0], n_kv_heads, max_len, dim_head)
        self.keys = torch.zeros(shape, device=lengths.device, dtype=dtype)
        self.values = torch.zeros(shape, device=lengths.device, dtype=dtype)

    def append(self, k: Tensor, v: Tensor, positions: Tensor) -> None:
        """Store k, v [B, G, T, D] at positions [B, T]."""
        write_rows(self.keys, k, positions)
        write_rows(self.values, v, positions)

    def visible(self, positions: Tensor) -> Tensor:
        """The mask [B, 1, T, max_len] of the keys each query at positions [B, T] sees."""
        keys = torch.arange(self.max_len, device=positions.device)
        return (keys <= positions[..., None])[:, None]


@ATTENTION.register("full")
class FullAttention(Attention):
    config_class = FullAttentionConfig

    @staticmethod
    def keys_per_query(config: FullAttentionConfig | None, seq_len: int, n_heads: int, layer_index: int) -> float:
        """T, PaLM's convention."""
        return float(seq_len)

    def __init__(self, spec: AttentionSpec, config: FullAttentionConfig | None = None) -> None:
        config = config or FullAttentionConfig()
        super().__init__(spec, config)
        check_backend("full", config.backend, OFFERED)

    def forward(self, x: Tensor, cache: FullCache | None = None) -> Tensor:
        dropout = self.spec.dropout if self.training else 0.0
        if cache is None:
            q, k, v = self.heads.split(x, 0)  # q [B, H, T, D], k v [B, G, T, D]
            return self.heads.merge(sdpa(q, k, v, mask=None, causal=True, dropout=dropout))
        positions = cache.positions(x.shape[1])  # [B, T]
        q, k, v = self.heads.split(x, positions)
        cache.append(k, v, positions)
        if cache.prefill:  # every row empty: the chunk is a whole sequence
            return self.heads.merge(sdpa(q, k, v, mask=None, causal=True, dropout=dropout))
        backend = choose_cached(self.config.backend, OFFERED, q, cache.keys, dropout)
        if backend == "cpu":
            return self.heads.merge(decode_cpu.cached_attention(q, cache.keys, cache.values, positions))
        if backend == "triton":
            return self.heads.merge(decode_triton.cached_attention(q, cache.keys, cache.values, positions))
        return self.heads.merge(masked_attention(q, cache.keys, cache.values, cache.visible(positions)))

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None, lengths: Tensor | None = None) -> FullCache:
        lengths = new_lengths(batch, device) if lengths is None else lengths
        self.heads.reserve(max_len, lengths.device)
        return FullCache(lengths, max_len, self.spec.n_kv_heads, self.spec.dim_head, dtype)
