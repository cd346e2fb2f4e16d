"""Blocked attention over gathered rows, with the gathers recomputed in the backward.

Sinkhorn attention lays its queries out in blocks (buckets) and gives each block of queries its
own short list of keys (its chosen buckets and itself). Gathering keys and values
into that layout copies them about twice, and autograd would keep those copies, and the scores'
mask, for the backward: at 4096 tokens that is several times what torch's fused attention keeps
for full attention (q, k, v, output and one log-sum-exp per query). `gathered_attention` keeps
only that: the ungathered q, k, v, the output in time order, the log-sum-exp and the small index
tensors; the backward gathers again, rebuilds the mask and calls the fused kernel's backward.

Used by Sinkhorn attention; routing attention has its own, local-attention-shaped variant of the
same idea (attention/routing.py), whose keys are an overlapping view rather than a gather.

Legend: B batch, H heads, T query rows, S key rows, D head width, N blocks, Q query slots per
block, K key slots per block, U output rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_KEY_SLOTS = 4096  # gathered key slots per head processed at once (the chunk size above)


def pick_rows(x: Tensor, index: Tensor) -> Tensor:
    """Rows of x [B, H, T, D] at index [B, H, n] -> [B, H, n, D]."""
    return x.gather(2, index[..., None].expand(-1, -1, -1, x.shape[-1]))


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """bool mask -> 0 / -inf, as torch's attention does for a boolean mask."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _blocks(q: Tensor, k: Tensor, v: Tensor, query_index: Tensor, key_index: Tensor,
            key_feature: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Gather the block layout: queries [B, H N, Q, D'], keys [B, H N, K, D'], values [B, H N, K, D'];
    with a key feature, D' = D + 1 (queries get a 1, values a 0 in the extra column)."""
    batch, n_heads, n_blocks, n_query_slots = query_index.shape
    n_key_slots = key_index.shape[-1]
    flat = (batch, n_heads * n_blocks)
    queries = pick_rows(q, query_index.flatten(2)).view(*flat, n_query_slots, q.shape[-1])
    keys = pick_rows(k, key_index.flatten(2)).view(*flat, n_key_slots, k.shape[-1])
    values = pick_rows(v, key_index.flatten(2)).view(*flat, n_key_slots, v.shape[-1])
    if key_feature is not None:
        queries = F.pad(queries, (0, 1), value=1.0)
        keys = torch.cat((keys, key_feature.reshape(*flat, n_key_slots, 1).to(keys.dtype)), dim=-1)
        values = F.pad(values, (0, 1))  # the fused CPU kernel wants one head width for all three
    return queries, keys, values


def block_chunks(n_blocks: int, slots_per_block: int, slots_per_chunk: int = CHUNK_KEY_SLOTS) -> list[slice]:
    """Block ranges processed at a time: about `slots_per_chunk` slots each, so the transient copies
    of the forward and backward stay small next to what autograd keeps."""
    size = max(1, slots_per_chunk // slots_per_block)
    return [slice(start, min(start + size, n_blocks)) for start in range(0, n_blocks, size)]


def autocast_inputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v in the dtype CPU autocast would run attention in (a custom autograd function sees
    no autocast), unchanged when autocast is off."""
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v


class _GatheredAttention(torch.autograd.Function):
    """Fused-kernel forward on the gathered blocks; backward from the ungathered tensors."""

    @staticmethod
    def forward(ctx, q, k, v, key_feature, query_index, key_index, output_index, make_mask, scale):
        batch, n_heads, n_blocks, n_query_slots = query_index.shape
        outs, logsumexps = [], []
        for chunk in block_chunks(n_blocks, key_index.shape[-1]):
            feature = None if key_feature is None else key_feature[:, :, chunk]
            queries, keys, values = _blocks(q, k, v, query_index[:, :, chunk], key_index[:, :, chunk], feature)
            mask = additive_mask(make_mask(chunk), queries.dtype).flatten(1, 2)  # [B, H n, Q, K]
            out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                queries, keys, values, 0.0, False, attn_mask=mask, scale=scale
            )
            outs.append(out[..., : v.shape[-1]].reshape(batch, n_heads, -1, v.shape[-1]))  # [B, H, n Q, D]
            logsumexps.append(logsumexp.reshape(batch, n_heads, -1))  # [B, H, n Q]
        y = pick_rows(torch.cat(outs, dim=2), output_index)  # [B, H, U, D]
        # laid out [B, U, H, D] as torch's fused attention lays out its output: merging the heads
        # for the output projection is then a view, and autograd keeps one copy of y, not two
        y = y.transpose(1, 2).contiguous().transpose(1, 2)
        logsumexp = torch.cat(logsumexps, dim=2)  # [B, H, N Q]
        ctx.save_for_backward(q, k, v, key_feature, query_index, key_index, output_index, y, logsumexp)
        ctx.make_mask, ctx.scale = make_mask, scale
        return y

    @staticmethod
    def backward(ctx, grad_y):
        q, k, v, key_feature, query_index, key_index, output_index, y, logsumexp = ctx.saved_tensors
        batch, n_heads, n_blocks, n_query_slots = query_index.shape
        n_slots = n_blocks * n_query_slots

        def to_slots(x: Tensor) -> Tensor:  # [B, H, U, D] -> [B, H, N, Q, D], zero where no output
            slots = x.new_zeros(batch, n_heads, n_slots, x.shape[-1])
            index = output_index[..., None].expand(-1, -1, -1, x.shape[-1])
            return slots.scatter_(2, index, x).view(batch, n_heads, n_blocks, n_query_slots, x.shape[-1])

        # slots without an output get zero output gradient, so they add exactly nothing below
        grad_out, out = to_slots(grad_y.contiguous().to(y.dtype)), to_slots(y)
        logsumexp = logsumexp.view(batch, n_heads, n_blocks, n_query_slots)
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        grad_feature = None if key_feature is None else torch.zeros_like(key_feature)

        def add_rows(rows: Tensor, grad: Tensor, index: Tensor) -> None:  # scatter-add into time order
            grad = grad[..., : rows.shape[-1]].reshape(batch, n_heads, -1, rows.shape[-1])
            rows.scatter_add_(2, index.flatten(2)[..., None].expand_as(grad), grad.to(rows.dtype))

        for chunk in block_chunks(n_blocks, key_index.shape[-1]):
            feature = None if key_feature is None else key_feature[:, :, chunk]
            queries, keys, values = _blocks(q, k, v, query_index[:, :, chunk], key_index[:, :, chunk], feature)
            mask = additive_mask(ctx.make_mask(chunk), queries.dtype).flatten(1, 2)
            width = values.shape[-1]
            flat = (batch, queries.shape[1], n_query_slots)
            grad_queries, grad_keys, grad_values = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                F.pad(grad_out[:, :, chunk], (0, width - grad_out.shape[-1])).reshape(*flat, width),
                queries, keys, values,
                F.pad(out[:, :, chunk], (0, width - out.shape[-1])).reshape(*flat, width),
                logsumexp[:, :, chunk].reshape(flat), 0.0, False, attn_mask=mask, scale=ctx.scale,
            )
            add_rows(grad_q, grad_queries, query_index[:, :, chunk])
            add_rows(grad_k, grad_keys, key_index[:, :, chunk])
            add_rows(grad_v, grad_values, key_index[:, :, chunk])
            if grad_feature is not None:
                grad_feature[:, :, chunk] = grad_keys[..., -1].reshape(grad_feature[:, :, chunk].shape)
        return grad_q, grad_k, grad_v, grad_feature, None, None, None, None, None


def gathered_attention(
    q: Tensor, k: Tensor, v: Tensor, query_index: Tensor, key_index: Tensor, output_index: Tensor,
    make_mask: Callable[[slice], Tensor], key_feature: Tensor | None = None, dropout: float = 0.0,
) -> Tensor:
    """Attention of each block of query slots over its own key slots.

    q [B, H, T, D], k v [B, H, S, D]; query_index [B, H, N, Q] and key_index [B, H, N, K] name the
    row of q (of k and v) in every slot; make_mask(blocks: slice) -> bool [B, H, n, Q, K] for those
    blocks (True: visible; a slot that has an output must see at least one key); key_feature
    [B, H, N, K] or None: added to the scores as scale * key_feature (an extra key feature against
    a query feature of 1, so it gets a gradient); output_index [B, H, U] picks the slots (flattened
    N Q) returned, [B, H, U, D].

    Training on the CPU without dropout keeps only the ungathered tensors for the backward (see the
    module docstring); otherwise plain autograd through the gathers and torch's attention.
    """
    scale = q.shape[-1] ** -0.5
    fused = dropout == 0.0 and q.device.type == "cpu" and torch.is_grad_enabled()
    if fused and any(x is not None and x.requires_grad for x in (q, k, v, key_feature)):
        q, k, v = autocast_inputs(q, k, v)
        return _GatheredAttention.apply(q, k, v, key_feature, query_index, key_index, output_index, make_mask, scale)
    queries, keys, values = _blocks(q, k, v, query_index, key_index, key_feature)
    mask = make_mask(slice(None)).flatten(1, 2)  # [B, H N, Q, K]; 4-d keeps torch on its fused CPU kernel
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, dropout_p=dropout, scale=scale)
    batch, n_heads = q.shape[:2]
    out = out[..., : v.shape[-1]].reshape(batch, n_heads, -1, v.shape[-1])
    return pick_rows(out, output_index)
