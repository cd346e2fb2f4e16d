"""FlexAttention back-end of sinkhorn bucket attention (attention/sinkhorn.py): a query in bucket m
sees the earlier slots of its own bucket and itself (causal), and every slot of the past buckets the
sorting network chose for bucket m, whose scores are raised by that bucket's log sorting weight.
The mask and the weight are functions of (query bucket, key bucket), so one BlockMask keeps only
the chosen bucket blocks and a score_mod adds the weight inside the fused kernel.

Same outputs as `bucket_attention` over a whole sequence to float rounding
(tests/test_flex_sinkhorn.py). Forward only on CPU in torch 2.13 (FlexAttention's eager
reference); compiled once per shape on CUDA. Decoding keeps the torch path.

Legend: B batch, H heads, T tokens, D head width, N buckets, S chosen buckets per bucket, b bucket size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.attention.kernels.flex import flex_kernel, n_tiles, span_tiles, tile_block_mask


def bucket_block_mask(chosen_bucket: Tensor, bucket_size: int, n_tokens: int):
    """A query sees the earlier slots of its own bucket and itself, and every slot of the key
    buckets chosen for its bucket: chosen_bucket [B, H, N, N] bool (query bucket, key bucket)."""
    n_buckets, device = chosen_bucket.shape[-1], chosen_bucket.device

    def visible(b, h, query, key):
        query_bucket, key_bucket = query // bucket_size, key // bucket_size
        own = (query_bucket == key_bucket) & (key <= query)
        return own | chosen_bucket[b, h, query_bucket, key_bucket]

    # tiles: any pair of buckets they overlap is the same bucket or a chosen one
    first, last = span_tiles(torch.arange(n_buckets, device=device) * bucket_size, bucket_size)
    tile = torch.arange(n_tiles(n_tokens), device=device)[:, None]
    overlap = ((tile >= first) & (tile <= last)).float()  # [Qt, N]
    buckets = chosen_bucket | torch.eye(n_buckets, dtype=torch.bool, device=device)  # [B, H, N, N]
    tiles = (overlap @ buckets.float() @ overlap.t()) > 0  # [B, H, Qt, Kt]
    return tile_block_mask(tiles, visible, n_tokens, n_tokens)


def flex_bucket_attention(q: Tensor, k: Tensor, v: Tensor, chosen: Tensor, chosen_weights: Tensor,
                          bucket_size: int) -> Tensor:
    """q, k, v [B, H, T, D] (a whole sequence from position 0); chosen, chosen_weights [B, H, N, S]
    from sort_buckets (weights -inf where bucket n has no such choice) -> [B, H, T, D]."""
    batch, n_heads, n_tokens, _ = q.shape
    n_buckets = chosen.shape[2]
    # log weight of key bucket j for query bucket n; -inf: not chosen. amax: an invalid slot's index
    # never overwrites a valid choice of the same bucket
    bucket_weight = torch.full((batch, n_heads, n_buckets, n_buckets), float("-inf"), device=q.device,
                               dtype=torch.float32)
    bucket_weight.scatter_reduce_(-1, chosen.clamp(0, n_buckets - 1), chosen_weights.float(), reduce="amax")

    def add_sorting_weight(score, b, h, query, key):
        query_bucket, key_bucket = query // bucket_size, key // bucket_size
        weight = bucket_weight[b, h, query_bucket, key_bucket]
        return score + torch.where(query_bucket == key_bucket, 0.0, weight).to(score.dtype)

    # a mask may not capture a tensor that needs grad: the choices go in detached
    block_mask = bucket_block_mask(bucket_weight.detach() > float("-inf"), bucket_size, n_tokens)
    return flex_kernel(q.device.type)(q, k, v, score_mod=add_sorting_weight, block_mask=block_mask)
