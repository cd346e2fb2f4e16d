"""FlexAttention back-end for NSA's selected branch (torch.nn.attention.flex_attention); the
sliding branch uses local attention's flex kernel (kernels/flex_local.py).

The selected branch is attention over the layer's own keys under a mask, so it is one
flex_attention call with a BlockMask built from a `mask_mod`: from the per-query selected block
indices that the compressed branch chose (shared by the query heads of a key/value group). Same
semantics as the torch path in attention/nsa.py, which the tests compare against.

- On CUDA flex_attention is compiled (fused kernels that skip empty tiles), once per length bucket:
  lengths are padded up to a multiple of `LENGTH_BUCKET`, and dynamo's recompile limit is raised so
  that new buckets never make it fall back silently to the unfused path.
- On CPU it runs eagerly (torch 2.13 has no flex backward on CPU): the unfused path builds the
  T x S scores, so it is a correctness check and an inference path for short inputs, not a
  memory-lean one. The compressed branch and the selection stay in torch.

Legend: B batch, H query heads, G key/value heads, T queries, S keys, D head width, n selected blocks.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from attnlab.attention.kernels.flex import LENGTH_BUCKET, flex_kernel


def _masked_attention(q: Tensor, k: Tensor, v: Tensor, mask_mod, batch_dependent: bool) -> Tensor:
    """flex_attention of q [B, H, T, D] over k, v [B, G, S, D] where mask_mod allows. -> [B, H, T, D]."""
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = q.device.type == "cuda"
    n_queries, n_keys = q.shape[2], k.shape[2]
    if compiled:  # pad to the length bucket so that each bucket compiles once
        padded_queries = -(-n_queries // LENGTH_BUCKET) * LENGTH_BUCKET
        padded_keys = -(-n_keys // LENGTH_BUCKET) * LENGTH_BUCKET
        q = F.pad(q, (0, 0, 0, padded_queries - n_queries))
        k = F.pad(k, (0, 0, 0, padded_keys - n_keys))
        v = F.pad(v, (0, 0, 0, padded_keys - n_keys))
    block_mask = create_block_mask(
        mask_mod, B=q.shape[0] if batch_dependent else None, H=q.shape[1] if batch_dependent else None,
        Q_LEN=q.shape[2], KV_LEN=k.shape[2], device=q.device,
    )
    output = flex_kernel(q.device.type)(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
    return output[:, :, :n_queries]


def selected_attention(
    q: Tensor, k: Tensor, v: Tensor, indices: Tensor, valid: Tensor, positions: Tensor, block: int
) -> Tensor:
    """Attention of each query to the tokens at or before it in its selected blocks.

    q [B, H, T, D] at absolute `positions` [T] (consecutive); k, v [B, G, S, D]; indices, valid
    [B, G, T, n] (the blocks of `block` tokens a query's key/value group chose). -> [B, H, T, D].
    No straight-through gates: the caller uses the torch path when they need a gradient.
    """
    offset = int(positions[0]) if positions.numel() else 0
    n_queries, n_groups = q.shape[2], k.shape[1]
    heads_per_group = q.shape[1] // n_groups
    # padded query rows select nothing (their outputs are cut off)
    pad = max(0, -(-n_queries // LENGTH_BUCKET) * LENGTH_BUCKET - n_queries) if q.device.type == "cuda" else 0
    indices = F.pad(indices, (0, 0, 0, pad))
    valid = F.pad(valid, (0, 0, 0, pad), value=False)

    def mask_mod(batch, head, query, key):
        group = head // heads_per_group
        key_block = key // block
        chosen = valid[batch, group, query, 0] & (indices[batch, group, query, 0] == key_block)
        for slot in range(1, indices.shape[-1]):
            chosen = chosen | (valid[batch, group, query, slot] & (indices[batch, group, query, slot] == key_block))
        return chosen & (key <= query + offset)

    return _masked_attention(q, k, v, mask_mod, batch_dependent=True)
