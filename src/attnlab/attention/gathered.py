"""Blocked attention over gathered rows, with the gathers recomputed in the backward.

Sinkhorn attention lays its queries out in blocks (buckets) and gives each block of queries its
own short list of keys (its chosen buckets and itself). Gathering keys and values
into that layout copies them about twice, and autograd would keep those copies, and the scores'
mask, for the backward: at 4096 tokens that is several times what torch's fused attention keeps
for full attention (q, k, v, output and one log-sum-exp per query). `gathered_attention` keeps
only that: the ungathered q, k, v, the output in time order, the log-sum-exp and the small index
tensors; the backward gathers again and calls the fused kernel's backward.

Rows move as whole rows of D numbers (`rows_of`, `select_rows`, `index_add_`), never element by
element. Used by Sinkhorn attention; routing attention (attention/routing.py) runs the same idea on
its own block plan and shares the row helpers.

Legend: B batch, H heads, T query rows, S key rows, D head width, N blocks, Q query slots per
block, K key slots per block, U output rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_KEY_SLOTS = 4096  # gathered key slots per head processed at once (the chunk size above)


def rows_of(x: Tensor) -> tuple[Tensor, Tensor, int]:
    """x [B, H, T, D] as rows of D numbers over its own memory -> (rows [n, D], a view; the row of
    token 0 of each (batch, head), [B H]; the row step of one token). Copies only when x's rows
    are not whole, D-aligned runs of its memory.

    Moving whole rows (index_select, index_add_ on dim 0) is several times faster than an
    element-wise gather or scatter with an index expanded over D."""
    width = x.shape[-1]

    def strides(x: Tensor) -> list[int]:
        return [0 if size == 1 else stride for size, stride in zip(x.shape, x.stride())]

    if (width > 1 and x.stride(-1) != 1) or any(stride % width for stride in strides(x)[:-1]):
        x = x.contiguous()
    batch_step, head_step, token_step = (stride // width for stride in strides(x)[:-1])
    n_rows = 1 + sum((size - 1) * step for size, step in zip(x.shape[:-1], (batch_step, head_step, token_step)))
    start = (torch.arange(x.shape[0], device=x.device)[:, None] * batch_step
             + torch.arange(x.shape[1], device=x.device) * head_step)
    return x.as_strided((n_rows, width), (width, 1)), start.flatten(), token_step


def row_numbers(index: Tensor, n_rows: int) -> Tensor:
    """index [B, H, *] of rows within each (batch, head)'s n_rows -> row numbers [B, H, *] of the
    [B H n_rows] flattening."""
    batch, n_heads = index.shape[:2]
    heads = torch.arange(batch * n_heads, device=index.device).view(batch, n_heads, *[1] * (index.dim() - 2))
    return index + heads * n_rows


def select_rows(x: tuple[Tensor, Tensor, int], index: Tensor) -> Tensor:
    """Rows of x = rows_of(...) at token index [B, H, *] -> [B H, *, D]."""
    rows, start, step = x
    flat = index.flatten(2) * step + start.view(*index.shape[:2], 1)
    return rows.index_select(0, flat.flatten()).view(-1, *index.shape[2:], rows.shape[-1])


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """bool mask -> 0 / -inf, as torch's attention does for a boolean mask."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _extended(q: Tensor, k: Tensor, v: Tensor, featured: bool) -> tuple[Tensor, Tensor, Tensor]:
    """With a key feature, q, k, v [B, H, T, D] -> [B, H, T, D + 1]: queries get a 1, keys and
    values a 0 in the new column (the keys' is set per slot by `_blocks`); else as they are."""
    if not featured:
        return q, k, v
    return F.pad(q, (0, 1), value=1.0), F.pad(k, (0, 1)), F.pad(v, (0, 1))


def _blocks(q: Tensor, k: Tensor, v: Tensor, query_index: Tensor, key_index: Tensor,
            key_feature: Tensor | None, extended: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Gather the block layout: queries [B H N, Q, D'], keys [B H N, K, D'], values [B H N, K, D'].
    With a key feature, D' = D + 1 and the keys' extra column is set to it: q, k, v come in
    `_extended` (extended: whole sequences, one copy each), or are extended here after the gather
    (decoding from a long cache: only the gathered rows are copied)."""
    queries = select_rows(rows_of(q), query_index).flatten(0, 1)
    keys = select_rows(rows_of(k), key_index).flatten(0, 1)
    values = select_rows(rows_of(v), key_index).flatten(0, 1)
    if key_feature is None:
        return queries, keys, values
    feature = key_feature.reshape(keys.shape[:-1]).to(keys.dtype)
    if extended:
        keys[..., -1] = feature
        return queries, keys, values
    return F.pad(queries, (0, 1), value=1.0), torch.cat((keys, feature[..., None]), dim=-1), F.pad(values, (0, 1))


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
    def forward(ctx, q, k, v, key_feature, query_index, key_index, output_index, mask, scale):
        batch, n_heads, n_blocks, n_query_slots = query_index.shape
        featured = key_feature is not None
        q_in, k_in, v_in = _extended(q, k, v, featured)
        out = q.new_empty(batch * n_heads, n_blocks, n_query_slots, q_in.shape[-1])
        attn_mask = additive_mask(mask, q_in.dtype)[None, None]  # one [Q, K] mask for every block
        logsumexp = None  # [B H, N, Q], in the kernel's accumulation dtype
        for chunk in block_chunks(n_blocks, key_index.shape[-1]):
            feature = None if key_feature is None else key_feature[:, :, chunk]
            queries, keys, values = _blocks(q_in, k_in, v_in, query_index[:, :, chunk], key_index[:, :, chunk], feature,
                                            extended=True)
            part, part_logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                queries[None], keys[None], values[None], 0.0, False, attn_mask=attn_mask, scale=scale,
            )
            if logsumexp is None:
                logsumexp = part_logsumexp.new_empty(batch * n_heads, n_blocks, n_query_slots)
            out[:, chunk] = part.view(batch * n_heads, -1, n_query_slots, part.shape[-1])
            logsumexp[:, chunk] = part_logsumexp.view(batch * n_heads, -1, n_query_slots)
        # y laid out [B, U, H, D] as torch's fused attention lays out its output: merging the heads
        # for the output projection is then a view, and autograd keeps one copy of y, not two
        y = _to_outputs(out[..., : v.shape[-1]].reshape(batch, n_heads, -1, v.shape[-1]), output_index)
        ctx.save_for_backward(q, k, v, key_feature, query_index, key_index, output_index, y, logsumexp, mask)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad_y):
        q, k, v, key_feature, query_index, key_index, output_index, y, logsumexp, mask = ctx.saved_tensors
        batch, n_heads, n_blocks, n_query_slots = query_index.shape
        n_slots = n_blocks * n_query_slots
        featured = key_feature is not None
        q_in, k_in, v_in = _extended(q, k, v, featured)
        # the output row of every slot, -1 for slots without one: they get zero output gradient,
        # so they add exactly nothing below
        slot_output = torch.full((batch, n_heads, n_slots), -1, dtype=torch.long, device=q.device)
        outputs = torch.arange(output_index.shape[-1], device=q.device).expand_as(output_index)
        slot_output.scatter_(2, output_index, outputs)
        no_output = (slot_output < 0).view(batch * n_heads, n_blocks, n_query_slots, 1)
        slot_output = slot_output.clamp(min=0).view(batch, n_heads, n_blocks, n_query_slots)
        grad_rows, y_rows = rows_of(grad_y.to(y.dtype)), rows_of(y)
        grads = [q.new_zeros(batch * n_heads * x.shape[2], x.shape[-1] + featured) for x in (q, k, v)]
        grad_feature = None if key_feature is None else torch.zeros_like(key_feature)
        width = v_in.shape[-1]
        attn_mask = additive_mask(mask, q_in.dtype)[None, None]

        def add_rows(grad: Tensor, part: Tensor, index: Tensor, n_rows: int) -> None:  # into time order
            rows = row_numbers(index.flatten(2), n_rows)
            # the kernel's gradients [1, B H n, slots, D'] lie in memory slots-major: read them so
            rows = rows.view(-1, part.shape[2]).t().flatten()
            grad.index_add_(0, rows, part[0].transpose(0, 1).reshape(-1, part.shape[-1]).to(grad.dtype))

        for chunk in block_chunks(n_blocks, key_index.shape[-1]):
            feature = None if key_feature is None else key_feature[:, :, chunk]
            queries, keys, values = _blocks(q_in, k_in, v_in, query_index[:, :, chunk], key_index[:, :, chunk], feature,
                                            extended=True)
            outputs = slot_output[:, :, chunk]
            grad_out = select_rows(grad_rows, outputs).masked_fill_(no_output[:, chunk], 0.0)
            grad_out = F.pad(grad_out, (0, width - v.shape[-1]))
            out = F.pad(select_rows(y_rows, outputs), (0, width - v.shape[-1]))
            grad_queries, grad_keys, grad_values = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out.flatten(0, 1)[None], queries[None], keys[None], values[None], out.flatten(0, 1)[None],
                logsumexp[:, chunk].flatten(0, 1)[None], 0.0, False, attn_mask=attn_mask, scale=ctx.scale,
            )
            add_rows(grads[0], grad_queries, query_index[:, :, chunk], q.shape[2])
            add_rows(grads[1], grad_keys, key_index[:, :, chunk], k.shape[2])
            add_rows(grads[2], grad_values, key_index[:, :, chunk], v.shape[2])
            if grad_feature is not None:
                grad_feature[:, :, chunk] = grad_keys[0, ..., -1].reshape(grad_feature[:, :, chunk].shape)
        grad_q, grad_k, grad_v = (
            grad.view(batch, n_heads, x.shape[2], -1)[..., : x.shape[-1]] for grad, x in zip(grads, (q, k, v))
        )
        return grad_q, grad_k, grad_v, grad_feature, None, None, None, None, None


def _to_outputs(slots: Tensor, output_index: Tensor) -> Tensor:
    """slots [B, H, N Q, D] -> the rows at output_index [B, H, U]: [B, H, U, D] laid out [B, U, H, D]."""
    batch, n_heads = slots.shape[:2]
    rows = row_numbers(output_index, slots.shape[2])
    picked = slots.reshape(-1, slots.shape[-1]).index_select(0, rows.transpose(1, 2).flatten())
    return picked.view(batch, output_index.shape[-1], n_heads, -1).transpose(1, 2)


def gathered_attention(
    q: Tensor, k: Tensor, v: Tensor, query_index: Tensor, key_index: Tensor, output_index: Tensor,
    mask: Tensor, key_feature: Tensor | None = None, dropout: float = 0.0,
) -> Tensor:
    """Attention of each block of query slots over its own key slots.

    q [B, H, T, D], k v [B, H, S, D]; query_index [B, H, N, Q] and key_index [B, H, N, K] name the
    row of q (of k and v) in every slot; mask bool [Q, K], the same for every block (True: visible;
    a slot that has an output must see at least one key); key_feature [B, H, N, K] or None: added
    to the scores as scale * key_feature (an extra key feature against a query feature of 1, so it
    gets a gradient; a very negative one hides a key); output_index [B, H, U] picks the slots
    (flattened N Q) returned, [B, H, U, D].

    Training on the CPU without dropout keeps only the ungathered tensors for the backward (see the
    module docstring); otherwise plain autograd through the gathers and torch's attention.
    """
    scale = q.shape[-1] ** -0.5
    fused = dropout == 0.0 and q.device.type == "cpu" and torch.is_grad_enabled()
    if fused and any(x is not None and x.requires_grad for x in (q, k, v, key_feature)):
        q, k, v = autocast_inputs(q, k, v)
        return _GatheredAttention.apply(q, k, v, key_feature, query_index, key_index, output_index, mask, scale)
    queries, keys, values = _blocks(q, k, v, query_index, key_index, key_feature, extended=False)
    out = F.scaled_dot_product_attention(queries[None], keys[None], values[None], attn_mask=mask[None, None],
                                         dropout_p=dropout, scale=scale)[0]  # 4-d: torch's fused CPU kernel
    width = v.shape[-1]
    return _to_outputs(out[..., :width].reshape(*query_index.shape[:2], -1, width), output_index)
