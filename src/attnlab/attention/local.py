"""Local (sliding-window) causal attention: each token attends to the last `window_size` tokens,
itself included.

As used by the Longformer (Beltagy et al., arXiv 2004.05150) and as the local heads of the Routing
and Sinkhorn Transformers. Computed in blocks of `window` queries, each attending to its own
block and the one before, so memory is O(T * window), never T x T.

Legend: B batch, T queries, S keys, H query heads, G key/value heads, D head width,
N query blocks, W window.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.attention.base import AttentionSpec, HeadProjections, KVCache, expand_kv, overlapping_windows, sdpa
from attnlab.attention.kernels.flex import worth_flex
from attnlab.attention.kernels.flex_local import flex_local_attention
from attnlab.config import LocalAttentionConfig
from attnlab.errors import ConfigError
from attnlab.registry import ATTENTION


def local_attention(q: Tensor, k: Tensor, v: Tensor, window: int, dropout: float = 0.0) -> Tensor:
    """Banded causal attention. q [B, H, T, D] are the last T of the S >= T keys k, v [B, G, S, D];
    query i (key index S - T + i) sees keys S - T + i - window < j <= S - T + i. -> [B, H, T, D]."""
    batch, n_heads, n_queries, dim_head = q.shape
    n_keys = k.shape[2]
    if n_queries == 1:  # decoding: the last `window` keys, no mask needed
        return sdpa(q, k[:, :, -window:], v[:, :, -window:], mask=None, causal=False, dropout=dropout)
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
    """Keys and values of the last window - 1 + max_rollback tokens."""

    def __init__(self, window: int, max_rollback: int) -> None:
        self.window = window
        self.capacity = window - 1 + max_rollback
        self.keys: Tensor | None = None  # [B, G, kept, D]
        self.values: Tensor | None = None
        self.length = 0

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Return kept + new keys/values [B, G, kept+T, D] and keep the last `capacity` of them."""
        n_new = k.shape[2]
        if self.keys is not None:
            k, v = torch.cat((self.keys, k), dim=2), torch.cat((self.values, v), dim=2)
        self.keys = k[:, :, -self.capacity :].contiguous()
        self.values = v[:, :, -self.capacity :].contiguous()
        self.length += n_new
        return k, v

    def truncate(self, length: int) -> None:
        self._check_truncate(length)
        drop = self.length - length
        kept = 0 if self.keys is None else self.keys.shape[2]
        needed = min(length, self.window - 1)  # keys the next token must still see
        if kept - drop < needed:
            raise ValueError(
                f"local cache keeps {kept} tokens; cannot roll back {drop} (raise max_rollback)"
            )
        if drop and self.keys is not None:
            self.keys, self.values = self.keys[:, :, : kept - drop], self.values[:, :, : kept - drop]
        self.length = length


@ATTENTION.register("local")
class LocalAttention(nn.Module):
    config_class = LocalAttentionConfig

    @staticmethod
    def keys_per_query(config: LocalAttentionConfig, seq_len: int, n_heads: int, layer_index: int) -> float:
        """Keys a query is scored against, for the FLOP count (flops.py)."""
        return float(min(config.window_size, seq_len))

    def __init__(self, spec: AttentionSpec, config: LocalAttentionConfig) -> None:
        super().__init__()
        self.spec, self.config = spec, config
        self.heads = HeadProjections(spec)
        self.aux_losses: dict[str, Tensor] = {}
        if config.backend == "flex" and spec.dropout > 0:
            raise ConfigError("attention.local.backend=flex has no attention dropout; set model.attention.dropout=0")

    def forward(self, x: Tensor, cache: LocalCache | None = None) -> Tensor:
        dropout = self.spec.dropout if self.training else 0.0
        offset = 0 if cache is None else cache.length
        q, k, v = self.heads.split(x, offset)  # q [B, H, T, D], k v [B, G, T, D]
        if cache is not None:
            k, v = cache.extend(k, v)  # [B, G, kept + T, D]
        if self.config.backend == "flex" and worth_flex(q.shape[2], q.device.type):  # short chunks: the torch path
            y = flex_local_attention(q, k, v, self.config.window_size)
        else:
            y = local_attention(q, k, v, self.config.window_size, dropout)
        return self.heads.merge(y)

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> LocalCache:
        return LocalCache(self.config.window_size, self.config.max_rollback)
