"""FlexAttention back-end of routed attention (attention/routing.py): sort the tokens of each routed
head by cluster (stably, so each cluster is one contiguous run in time order); then a token's keys
-- itself and the last `window` earlier tokens of its cluster -- are exactly the sorted positions
j with j <= i, i - j <= window and the same cluster. That is a band of width window + 1 in sorted
order, so the BlockMask keeps only the blocks on the band and the fused kernel skips the rest.

Same outputs as `routed_attention` to float rounding (tests/test_flex_routing.py); unlike the
torch path it is not bit-exact under changes to later tokens (the kernel's block reductions see
the sorted layout), so it is offered for speed on GPUs, and the contract is held by the torch path.
Forward only on CPU in torch 2.13 (FlexAttention's eager reference); compiled once per shape on CUDA.

Legend: B batch, R routed heads, T tokens, D head width, W window.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.attention.kernels.flex import band_tiles, flex_kernel, tile_block_mask


def sorted_band_block_mask(sorted_clusters: Tensor, window: int):
    """Sorted position i sees j <= i with i - j <= window in the same cluster; sorted_clusters [B, R, T]."""
    n_tokens = sorted_clusters.shape[-1]

    def same_cluster_band(b, h, query, key):
        return (key <= query) & (query - key <= window) & (sorted_clusters[b, h, query] == sorted_clusters[b, h, key])

    # the tiles of the band of window + 1 sorted positions; the cluster test inside a tile is the mask's
    tiles = band_tiles(n_tokens, n_tokens, 0, window + 1, sorted_clusters.device)
    return tile_block_mask(tiles, same_cluster_band, n_tokens, n_tokens)


def flex_routed_attention(q: Tensor, k: Tensor, v: Tensor, clusters: Tensor, window: int) -> Tensor:
    """q, k, v [B, R, T, D], clusters [B, R, T] -> [B, R, T, D], as routing.routed_attention."""
    batch, n_heads, n_tokens, dim_head = q.shape
    order = torch.sort(clusters, dim=-1, stable=True).indices  # [B, R, T]
    index = order[..., None].expand(-1, -1, -1, dim_head)  # [B, R, T, D]
    sorted_q, sorted_k, sorted_v = (x.gather(2, index) for x in (q, k, v))  # [B, R, T, D]
    block_mask = sorted_band_block_mask(clusters.gather(2, order), window)
    y_sorted = flex_kernel(q.device.type)(sorted_q, sorted_k, sorted_v, block_mask=block_mask)  # [B, R, T, D]
    return torch.empty_like(y_sorted).scatter_(2, index, y_sorted)  # back to time order
