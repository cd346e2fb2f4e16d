"""Full causal attention: every token attends to all earlier tokens and itself.

"Attention Is All You Need" (Vaswani et al., arXiv 1706.03762), computed by torch's
scaled_dot_product_attention (flash / memory-efficient kernels where available).

Legend: B batch, T new tokens, L cached tokens, H query heads, G key/value heads, D head width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnlab.attention.base import AttentionSpec, HeadProjections, KVCache, causal_mask, sdpa
from attnlab.registry import ATTENTION


@dataclass(kw_only=True)
class FullAttentionConfig:
    """Full attention has no options of its own."""


class FullCache(KVCache):
    """Keys and values of every fed token, preallocated to max_len."""

    def __init__(self, batch: int, n_kv_heads: int, dim_head: int, max_len: int, device, dtype) -> None:
        shape = (batch, n_kv_heads, max_len, dim_head)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v [B, G, T, D]; return all keys and values so far, [B, G, L+T, D]."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"cache holds {self.keys.shape[2]} tokens; {end} were fed")
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def truncate(self, length: int) -> None:
        self._check_truncate(length)
        self.length = length  # slots past length are overwritten by the next append


@ATTENTION.register("full")
class FullAttention(nn.Module):
    config_class = FullAttentionConfig

    @staticmethod
    def keys_per_query(config: FullAttentionConfig | None, seq_len: int, n_heads: int, layer_index: int) -> float:
        """Keys a query is scored against, for the FLOP count (flops.py): T, PaLM's convention."""
        return float(seq_len)

    def __init__(self, spec: AttentionSpec, config: FullAttentionConfig | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.heads = HeadProjections(spec)
        self.aux_losses: dict[str, Tensor] = {}

    def forward(self, x: Tensor, cache: FullCache | None = None) -> Tensor:
        dropout = self.spec.dropout if self.training else 0.0
        offset = 0 if cache is None else cache.length
        q, k, v = self.heads.split(x, offset)  # q [B, H, T, D], k v [B, G, T, D]
        if cache is None:
            y = sdpa(q, k, v, mask=None, causal=True, dropout=dropout)
        else:
            k, v = cache.append(k, v)  # [B, G, L+T, D]
            n_new, n_keys = q.shape[2], k.shape[2]
            # one new token sees every key; a chunk needs the causal mask shifted by L
            mask = None if n_new == 1 else causal_mask(n_new, n_keys, q.device)
            y = sdpa(q, k, v, mask=mask, causal=False, dropout=dropout)
        return self.heads.merge(y)

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> FullCache:
        return FullCache(batch, self.spec.n_kv_heads, self.spec.dim_head, max_len, device, dtype)
