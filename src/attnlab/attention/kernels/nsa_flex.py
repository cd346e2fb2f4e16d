"""FlexAttention back-end for NSA's selected branch (torch.nn.attention.flex_attention); the
sliding branch uses local attention's flex kernel (kernels/flex_local.py).

The selected branch is attention over the layer's own keys under a mask, so it is one
flex_attention call with a BlockMask: its tiles come from the per-query selected block indices
that the compressed branch chose (shared by the query heads of a key/value group; a query tile
sees the key tiles its queries' blocks overlap, O(T x n) to build), and a `mask_mod` decides each
pair inside them. Same semantics as the torch path in attention/nsa.py, which the tests compare
against.

- On CUDA flex_attention is compiled (fused kernels that skip empty tiles), once per length bucket:
  lengths are padded up to a multiple of `LENGTH_BUCKET`, and dynamo's recompile limit is raised so
  that new buckets never make it fall back silently to the unfused path.
- On CPU it runs eagerly (torch 2.13 has no flex backward on CPU): the unfused path builds the
  T x S scores, so it is a correctness check and an inference path for short inputs, not a
  memory-lean one. The compressed branch and the selection stay in torch.

Legend: B batch, H query heads, G key/value heads, T queries, S keys, D head width, n selected blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.attention.kernels.flex import TILE, flex_kernel, n_tiles, pad_to_bucket, span_tiles, tile_block_mask


def selection_tiles(indices: Tensor, valid: Tensor, block: int, n_keys: int) -> Tensor:
    """Tile map [B, G, Qt, Kt] of the selected branch: a query tile sees the key tiles that a
    selected block of any of its queries overlaps. indices, valid [B, G, T, n]."""
    batch, n_groups, n_queries, _ = indices.shape
    rows, columns = n_tiles(n_queries), n_tiles(n_keys)
    first, last = span_tiles(indices * block, block)  # [B, G, T, n]
    query_tile = (torch.arange(n_queries, device=indices.device) // TILE)[:, None]  # [T, 1]
    counts = torch.zeros(batch, n_groups, rows * columns, dtype=torch.int32, device=indices.device)
    for step in range((block - 1) // TILE + 2):  # the most tiles one block can overlap
        tile = first + step
        hit = valid & (tile <= last) & (tile < columns)
        place = query_tile * columns + tile.clamp(max=columns - 1)
        counts.scatter_add_(-1, place.flatten(2), hit.to(torch.int32).flatten(2))
    return (counts > 0).view(batch, n_groups, rows, columns)


def selection_block_mask(indices: Tensor, valid: Tensor, offset: int, block: int, heads_per_group: int,
                         n_keys: int):
    """Query i (at position offset + i) of head h sees the keys at or before it in the blocks its
    group (h // heads_per_group) selected: indices, valid [B, G, T, n]."""

    def mask_mod(batch, head, query, key):
        group = head // heads_per_group
        key_block = key // block
        chosen = valid[batch, group, query, 0] & (indices[batch, group, query, 0] == key_block)
        for slot in range(1, indices.shape[-1]):
            chosen = chosen | (valid[batch, group, query, slot] & (indices[batch, group, query, slot] == key_block))
        return chosen & (key <= query + offset)

    tiles = selection_tiles(indices, valid, block, n_keys).repeat_interleave(heads_per_group, dim=1)
    return tile_block_mask(tiles, mask_mod, indices.shape[2], n_keys)


def selected_attention(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, valid: Tensor, offset: int, block: int
) -> Tensor:
    """Attention of each query to the tokens at or before it in its selected blocks.

    q [B, H, T, D] at positions offset..offset+T-1; k, v [B, G, S, D]; indices, valid
    [B, G, T, n] (the blocks of `block` tokens a query's key/value group chose). -> [B, H, T, D].
    No straight-through gates: the caller uses the torch path when they need a gradient.
    """
    n_queries, n_groups = q.shape[2], k.shape[1]
    heads_per_group = q.shape[1] // n_groups
    q, k, v = pad_to_bucket(q, k, v)
    # padded query rows select nothing (their outputs are cut off)
    pad = q.shape[2] - n_queries
    indices = F.pad(indices, (0, 0, 0, pad))
    valid = F.pad(valid, (0, 0, 0, pad), value=False)

    block_mask = selection_block_mask(indices, valid, offset, block, heads_per_group, k.shape[2])
    output = flex_kernel(q.device.type)(q, k, v, block_mask=block_mask, enable_gqa=n_groups != q.shape[1])
    return output[:, :, :n_queries]
