"""Full causal attention: every token attends to all earlier tokens and itself.

"Attention Is All You Need" (Vaswani et al., arXiv 1706.03762), computed by torch's
scaled_dot_product_attention (flash / memory-efficient kernels where available).

Legend: B batch, T new tokens, L cached tokens, H query heads, G key/value heads, D head width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab.attention.base import (
    Attention,
    AttentionSpec,
    KVCache,
    RowLengths,
    causal_mask,
    sdpa,
    write_rows,
)
from attnlab.registry import ATTENTION


@dataclass(kw_only=True)
class FullAttentionConfig:
    """Full attention has no options of its own."""


class FullCache(KVCache):
    """Keys and values of every fed token, preallocated to max_len. Rows may have lengths of
    their own (truncate_rows): row b's tokens then sit at positions 0..rows.lengths[b]-1, and
    anything past them (rejected draft tokens) is masked until overwritten."""

    per_row_rollback = True

    def __init__(self, batch: int, n_kv_heads: int, dim_head: int, max_len: int, device, dtype) -> None:
        shape = (batch, n_kv_heads, max_len, dim_head)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        self.rows = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store k, v [B, G, T, D]; return all keys and values so far, [B, G, S, D] (S = the
        longest row), and the mask the T new queries need: None (one token, rows level), [T, S]
        causal (rows level), or [B, 1, T, S] with each row's own causal band."""
        n_new = k.shape[2]
        start, end = self.length, self.length + n_new
        if end > self.keys.shape[2]:
            raise ValueError(f"cache holds {self.keys.shape[2]} tokens; {end} were fed")
        if self.rows is None:
            self.keys[:, :, start:end] = k
            self.values[:, :, start:end] = v
            self.length = end
            mask = None if n_new == 1 else causal_mask(n_new, end, k.device)
            return self.keys[:, :, :end], self.values[:, :, :end], mask
        mask = self.rows.causal_mask(n_new)  # shared by the layers: built once
        self.rows, positions = self.rows.advance(n_new)
        write_rows(self.keys, k, positions)
        write_rows(self.values, v, positions)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end], mask

    def truncate(self, length: int) -> None:
        self._check_truncate(length)
        self._level_rows(length)
        self.length = length  # slots past length are overwritten by the next append

    def truncate_rows(self, rows: RowLengths) -> None:
        self._adopt_rows(rows)


@ATTENTION.register("full")
class FullAttention(Attention):
    config_class = FullAttentionConfig

    @staticmethod
    def keys_per_query(config: FullAttentionConfig | None, seq_len: int, n_heads: int, layer_index: int) -> float:
        """T, PaLM's convention."""
        return float(seq_len)

    def __init__(self, spec: AttentionSpec, config: FullAttentionConfig | None = None) -> None:
        super().__init__(spec, config)

    def forward(self, x: Tensor, cache: FullCache | None = None) -> Tensor:
        dropout = self.spec.dropout if self.training else 0.0
        if cache is None:
            q, k, v = self.heads.split(x, 0)  # q [B, H, T, D], k v [B, G, T, D]
            y = sdpa(q, k, v, mask=None, causal=True, dropout=dropout)
        else:
            q, k, v = self.heads.split(x, cache.offset, cache.length + x.shape[1])
            k, v, mask = cache.append(k, v)  # [B, G, S, D]; mask: rows' own causal bands
            y = sdpa(q, k, v, mask=mask, causal=False, dropout=dropout)
        return self.heads.merge(y)

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> FullCache:
        return FullCache(batch, self.spec.n_kv_heads, self.spec.dim_head, max_len, device, dtype)
