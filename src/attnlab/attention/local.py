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
from torch import Tensor

from attnlab.attention.base import (
    Attention,
    AttentionSpec,
    KVCache,
    RowLengths,
    expand_kv,
    overlapping_windows,
    sdpa,
)
from attnlab.attention.kernels import check_backend, choose
from attnlab.attention.kernels.flex_local import flex_local_attention
from attnlab.config import LocalAttentionConfig
from attnlab.errors import ConfigError
from attnlab.registry import ATTENTION


def local_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, dropout: float = 0.0, positions: Tensor | None = None
) -> Tensor:
    """Banded causal attention. q [B, H, T, D] are the last T of the S >= T keys k, v [B, G, S, D];
    query i (key index S - T + i) sees keys S - T + i - window < j <= S - T + i. -> [B, H, T, D].
    positions [B, T]: the queries' key indices instead, each row's own (rows of a cache that differ
    in length; what lies past a row's last query is never seen)."""
    batch, n_heads, n_queries, dim_head = q.shape
    n_keys = k.shape[2]
    if positions is not None:
        key = torch.arange(n_keys, device=q.device)
        band = (key <= positions[..., None]) & (key > positions[..., None] - window)  # [B, T, S]
        return sdpa(q, k, v, mask=band[:, None], causal=False, dropout=dropout)
    if n_queries == 1:  # decoding: the last `window` keys, no mask needed
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
    """Keys and values of the last window - 1 + max_rollback tokens (the capacity C).

    Rows may have lengths of their own (truncate_rows). The kept keys are then right-aligned per
    row: slot C - 1 holds each row's last token, slot s the token C - 1 - s before it, and the
    first C - valid[b] slots of row b hold nothing (masked). A per-row rollback shifts each row
    right by the tokens it drops, so the next tokens of every row are appended at the same slots."""

    per_row_rollback = True

    def __init__(self, window: int, max_rollback: int) -> None:
        self.window = window
        self.capacity = window - 1 + max_rollback
        self.keys: Tensor | None = None  # [B, G, kept, D]; kept = C once rows differ
        self.values: Tensor | None = None
        self.length = 0
        self.rows = None
        self.valid: Tensor | None = None  # [B] kept slots holding a token, while rows differ

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Keep the last `capacity` of kept + new keys/values and return them for the T new
        queries: while rows are level, all of them [B, G, kept+T, D] and no mask (`local_attention`
        finds the band); while rows differ, the last window - 1 + T slots (all a query can reach)
        and the mask [B, 1, T, S] of each row's band."""
        n_new = k.shape[2]
        if self.keys is not None:
            k, v = torch.cat((self.keys, k), dim=2), torch.cat((self.values, v), dim=2)
        self.keys = k[:, :, -self.capacity :].contiguous()
        self.values = v[:, :, -self.capacity :].contiguous()
        self.length += n_new
        if self.rows is None:
            return k, v, None
        # rows differ: the slots the new queries can reach (the last window - 1 + T), each row's band
        n_seen = min(k.shape[2], self.window - 1 + n_new)
        band_key = ("local band", n_new, n_seen, self.window)
        band = self.rows.memo.get(band_key)  # every layer's rows hold the same tokens: one mask
        if band is None:
            band = self.rows.memo[band_key] = self._row_band(n_new, n_seen)
        self.rows, _ = self.rows.advance(n_new)
        self.valid = (self.valid + n_new).clamp(max=self.capacity)
        return k[:, :, -n_seen:], v[:, :, -n_seen:], band

    def _row_band(self, n_new: int, n_keys: int) -> Tensor:
        """[B, 1, T, S] over the last S slots: new query t (slot S - T + t) sees the slots of the
        last `window` tokens up to itself that hold a token of its row (valid: before the T new)."""
        device = self.valid.device
        slot = torch.arange(n_keys, device=device)
        query = n_keys - n_new + torch.arange(n_new, device=device)[:, None]  # [T, 1]
        band = (slot <= query) & (slot > query - self.window)  # [T, S]
        held = slot >= (n_keys - n_new - self.valid)[:, None]  # [B, S]
        return (band & held[:, None, :])[:, None]

    def truncate(self, length: int) -> None:
        self._check_truncate(length)
        if self.rows is not None:
            lengths = self.rows.lengths
            self._level_rows(length)
            self._drop_per_row(lengths - length, torch.full_like(lengths, length))
            # level again: the last slots that hold a token in every row (at least the window the
            # next token sees, checked above), so a later rollback is checked against real tokens
            kept = min(length, self.capacity, int(self.valid.min()))
            self.keys, self.values = self.keys[:, :, self.capacity - kept :], self.values[:, :, self.capacity - kept :]
            self.valid, self.length = None, length
            return
        drop = self.length - length
        kept = 0 if self.keys is None else self.keys.shape[2]
        self._check_rollback(kept - drop, min(length, self.window - 1))
        if drop and self.keys is not None:
            self.keys, self.values = self.keys[:, :, : kept - drop], self.values[:, :, : kept - drop]
        self.length = length

    def truncate_rows(self, rows: RowLengths) -> None:
        """Rows checked against the lengths fed by the caller (ModelCache.truncate_rows)."""
        if rows.longest > self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to rows up to {rows.longest}")
        if self.keys is None:  # nothing fed: every row is at 0, level
            return
        if self.rows is None:  # level until now: every row holds the same kept slots
            batch = rows.lengths.shape[0]
            kept = self.keys.shape[2]
            if kept < self.capacity:  # right-align to C slots
                pad = (0, 0, self.capacity - kept, 0)
                self.keys, self.values = F.pad(self.keys, pad), F.pad(self.values, pad)
            self.valid = torch.full((batch,), kept, dtype=torch.long, device=rows.lengths.device)
            current = torch.full_like(rows.lengths, self.length)
        else:
            current = self.rows.lengths
        self._drop_per_row(current - rows.lengths, rows.lengths)
        self.rows, self.length = rows, rows.longest

    def _drop_per_row(self, drop: Tensor, lengths: Tensor) -> None:
        """Forget the last drop[b] tokens of row b (rows right-aligned in C slots): each row is
        shifted right by its drop, a copy of one slice per row (a few times cheaper than a gather)."""
        self._check_rollback(self.valid - drop, torch.clamp(lengths, max=self.window - 1))
        keys, values = torch.zeros_like(self.keys), torch.zeros_like(self.values)
        for row, n_dropped in enumerate(drop.tolist()):
            keys[row, :, n_dropped:] = self.keys[row, :, : self.capacity - n_dropped]
            values[row, :, n_dropped:] = self.values[row, :, : self.capacity - n_dropped]
        self.keys, self.values = keys, values
        self.valid = self.valid - drop

    def _check_rollback(self, kept: int | Tensor, needed: int | Tensor) -> None:
        """Each row must keep the keys its next token still sees: its last window - 1 tokens."""
        short = kept < needed
        if bool(short.any() if isinstance(short, Tensor) else short):
            raise ValueError(f"local cache keeps {self.capacity} tokens at most; cannot roll back that far "
                             "(raise attention.local.max_rollback)")


OFFERED = ("torch", "flex")


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
        if cache is None:
            q, k, v = self.heads.split(x, 0)  # q [B, H, T, D], k v [B, G, T, D]
        else:
            q, k, v = self.heads.split(x, cache.offset, cache.length + x.shape[1])
            k, v, row_mask = cache.extend(k, v)  # [B, G, kept + T, D]
            if row_mask is not None:  # rows of different lengths: each its own band
                return self.heads.merge(sdpa(q, k, v, mask=row_mask, causal=False, dropout=dropout))
        # flex serves chunks at any position (its band ends where the keys do)
        if choose(self.config.backend, OFFERED, q, whole=True, dropout=dropout) == "flex":
            y = flex_local_attention(q, k, v, self.config.window_size)
        else:
            y = local_attention(q, k, v, self.config.window_size, dropout)
        return self.heads.merge(y)

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> LocalCache:
        return LocalCache(self.config.window_size, self.config.max_rollback)
