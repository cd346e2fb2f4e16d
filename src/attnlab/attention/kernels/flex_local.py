"""FlexAttention back-end of local (sliding-window) attention: one BlockMask, so the fused kernel
skips every key block outside the band (torch.nn.attention.flex_attention, torch >= 2.5).

Same semantics as attention/local.py's `local_attention` (tests/test_flex_local.py): the queries
are the last T of the S keys, query i (key position S - T + i) sees keys S - T + i - window < j <=
S - T + i. On CUDA the kernel is compiled once per length bucket (queries and keys are padded to a
multiple of LENGTH_BUCKET; padded queries come last and are cut off, and no real query reaches a
padded key; block masks are cached per shape too); elsewhere FlexAttention runs its eager
reference, forward only on CPU in torch 2.13, so CPU training uses the torch path.

Legend: B batch, T queries, S keys, H query heads, G key/value heads, D head width.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from attnlab.attention.kernels.flex import band_tiles, flex_kernel, pad_to_bucket, tile_block_mask


@functools.lru_cache(maxsize=64)
def sliding_window_block_mask(window: int, n_queries: int, n_keys: int, device: torch.device, offset: int):
    """The band of queries at key positions offset + i over n_keys keys (lengths may be padded)."""

    def band(batch, head, query, key):
        position = query + offset  # the query's own key position
        return (key <= position) & (position - key < window)

    tiles = band_tiles(n_queries, n_keys, offset, window, device)
    return tile_block_mask(tiles, band, n_queries, n_keys)


def flex_local_attention(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    """q [B, H, T, D], the last T of the keys k, v [B, G, S, D] -> [B, H, T, D]."""
    n_queries, n_keys = q.shape[2], k.shape[2]
    offset = n_keys - n_queries
    q, k, v = pad_to_bucket(q, k, v)
    block_mask = sliding_window_block_mask(window, q.shape[2], k.shape[2], q.device, offset)
    output = flex_kernel(q.device.type)(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return output[:, :, :n_queries]
