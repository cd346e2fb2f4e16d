"""The `cpu` back-end of routing and sinkhorn attention: listed-key attention (listed_cpu.cpp).

Each unit, a (batch, head)'s list of key tokens, is attended to by its query tokens, query i seeing
the contiguous range lo_i..hi_i of the list (each key's score raised by an optional bias). Routing
attention makes one unit per cluster (`cluster_units`), sinkhorn attention one per bucket
(`bucket_units`). Forward and backward each run in one pass over the units, reading q, k, v and
writing the outputs and gradients as rows in place (`rows_of`): no block layout is gathered,
padded or scattered. The backward keeps only what torch's fused attention keeps (q, k, v, the
output, one log-sum-exp per query); the unit lists are rebuilt from the clusters or buckets, which
costs a sort, not an attention.

Both are torch custom ops (`attnlab::routed_attention_cpu`, `attnlab::bucket_attention_cpu`) with
fake and autograd registrations, so a model using them compiles whole and FlopCounterMode runs.
The kernel is compiled on first use with the other CPU kernels (kernels/cpu.py).

Legend: B batch, H heads, T tokens, D head width, U units, L listed keys, Q queries, C clusters,
N buckets, S chosen buckets per bucket, b bucket size.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.attention.kernels.cpu import library, require

# ----------------------------------------------------------------------------------------------
# Rows and unit lists, as the kernel reads them


class _Rows(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("start", ctypes.c_void_p), ("step", ctypes.c_int64)]


class _Units(ctypes.Structure):
    _fields_ = [
        ("n_units", ctypes.c_int64), ("bh", ctypes.c_void_p), ("key_start", ctypes.c_void_p),
        ("key_tokens", ctypes.c_void_p), ("key_bias", ctypes.c_void_p), ("query_start", ctypes.c_void_p),
        ("query_tokens", ctypes.c_void_p), ("query_lo", ctypes.c_void_p), ("query_hi", ctypes.c_void_p),
    ]


def rows_of(x: Tensor) -> tuple[Tensor, Tensor, int]:
    """x [B, H, T, D] as rows of D numbers over its own memory -> (rows [n, D], a view; the row of
    token 0 of each (batch, head), [B H]; the row step of one token). Copies only when x's rows
    are not whole, D-aligned runs of its memory (so [B, T, H, D] layouts are read in place)."""
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


@dataclass
class Units:
    """The unit lists (all int64 on the CPU, contiguous). bh [U]; key_start [U + 1] into
    key_tokens [L]; query_start [U + 1] into query_tokens, query_lo, query_hi [Q] (lo/hi index the
    unit's own list, hi inclusive); group_start [G + 1]: the units of a group share key rows, and
    run in order in the backward; groups run in parallel."""

    bh: Tensor
    key_start: Tensor
    key_tokens: Tensor
    query_start: Tensor
    query_tokens: Tensor
    query_lo: Tensor
    query_hi: Tensor
    group_start: Tensor

    def __post_init__(self) -> None:
        for name in ("bh", "key_start", "key_tokens", "query_start", "query_tokens", "query_lo", "query_hi",
                     "group_start"):
            setattr(self, name, getattr(self, name).to(torch.int64).contiguous())

    def struct(self, key_bias: Tensor | None) -> _Units:
        return _Units(
            self.bh.numel(), self.bh.data_ptr(), self.key_start.data_ptr(), self.key_tokens.data_ptr(),
            0 if key_bias is None else key_bias.data_ptr(), self.query_start.data_ptr(),
            self.query_tokens.data_ptr(), self.query_lo.data_ptr(), self.query_hi.data_ptr(),
        )


def cluster_units(clusters: Tensor, window: int) -> Units:
    """Routed attention's units: one per (batch, head, cluster), listing the cluster's tokens in time
    order; the token of rank r in its cluster sees ranks max(0, r - window) .. r. clusters [B, R, T]."""
    n_tokens = clusters.shape[-1]
    flat = clusters.reshape(-1, n_tokens)  # [B R, T]
    n_rows, n_clusters = flat.shape[0], int(flat.max()) + 1
    order = torch.sort(flat, dim=-1, stable=True).indices  # time order within each cluster
    index = (flat + torch.arange(n_rows)[:, None] * n_clusters).flatten()
    counts = torch.bincount(index, minlength=n_rows * n_clusters)  # [B R C]
    starts = (counts.cumsum(0) - counts).view(n_rows, n_clusters) - torch.arange(n_rows)[:, None] * n_tokens
    rank = torch.arange(n_tokens) - starts.gather(-1, flat.gather(-1, order))  # [B R, T] in sorted order
    key_start = F.pad(counts.cumsum(0), (1, 0))
    tokens = order.flatten()
    return Units(
        bh=torch.arange(n_rows).repeat_interleave(n_clusters), key_start=key_start, key_tokens=tokens,
        query_start=key_start, query_tokens=tokens, query_lo=(rank - window).clamp(min=0).flatten(),
        query_hi=rank.flatten(), group_start=torch.arange(n_rows * n_clusters + 1),
    )


def bucket_units(chosen: Tensor, weights: Tensor, n_tokens: int, bucket_size: int) -> tuple[Units, Tensor, Tensor]:
    """Sinkhorn attention's units for a whole sequence: one per (batch, head, bucket), listing the
    tokens of its chosen buckets (holes left out) and then its own; slot s of the bucket sees the
    chosen tokens and its own slots 0..s. chosen, weights [B, H, N, S] -> (units, the key bias [L]:
    each chosen bucket's log sorting weight, 0 for its own tokens; and `listed` [B H, N, (S + 1) b],
    where the bias came from, to carry its gradient back to the weights)."""
    batch, n_heads, n_buckets, _ = chosen.shape
    size = bucket_size
    slot = torch.arange(size)
    own = torch.arange(n_buckets)[:, None] * size + slot  # [N, b]
    tokens = torch.cat((
        (chosen[..., None] * size + slot).flatten(-2),  # [B, H, N, S b]
        own.expand(batch, n_heads, -1, -1),
    ), dim=-1).flatten(0, 1)  # [B H, N, (S + 1) b]
    valid = weights.isfinite()  # [B, H, N, S]
    listed = torch.cat((
        valid.repeat_interleave(size, dim=-1), (own < n_tokens).expand(batch, n_heads, -1, -1),
    ), dim=-1).flatten(0, 1)
    bias = torch.cat((
        weights.repeat_interleave(size, dim=-1), weights.new_zeros(batch, n_heads, n_buckets, size),
    ), dim=-1).flatten(0, 1)
    n_listed = listed.sum(-1).flatten()  # [B H N]
    key_start = F.pad(n_listed.cumsum(0), (1, 0))
    n_rows = batch * n_heads
    queries = torch.arange(n_tokens).expand(n_rows, -1)  # [B H, T]: bucket by bucket
    per_bucket = (n_tokens - own[:, 0]).clamp(max=size)  # [N]: queries of each bucket (the last may be partial)
    query_start = F.pad(per_bucket.repeat(n_rows).cumsum(0), (1, 0))
    n_chosen_slots = (valid.sum(-1) * size).flatten(0, 1)  # [B H, N]
    bucket = queries // size
    units = Units(
        bh=torch.arange(n_rows).repeat_interleave(n_buckets), key_start=key_start,
        key_tokens=tokens[listed], query_start=query_start, query_tokens=queries.flatten(),
        query_lo=torch.zeros(n_rows * n_tokens, dtype=torch.long),
        query_hi=(n_chosen_slots.gather(-1, bucket) + queries % size).flatten(),
        group_start=torch.arange(0, n_rows * n_buckets + 1, n_buckets),  # a head's buckets share keys
    )
    return units, bias[listed].contiguous(), listed


# ----------------------------------------------------------------------------------------------
# The kernel calls


def _rows(x: Tensor) -> tuple[_Rows, tuple]:
    """x [B, H, T, D] -> the kernel's row view, and what must stay alive while it is used."""
    rows, start, step = rows_of(x)
    start = start.contiguous()
    return _Rows(rows.data_ptr(), start.data_ptr(), step), (rows, start)


def _empty_output(q: Tensor) -> tuple[Tensor, Tensor]:
    """The output [B, H, T, D] laid out [B, T, H, D] (merging heads after is a view) and the
    log-sum-exp [B, H, T, 1]."""
    batch, n_heads, n_tokens, dim = q.shape
    return q.new_empty(batch, n_tokens, n_heads, dim).transpose(1, 2), q.new_empty(batch, n_heads, n_tokens, 1)


def _forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, units: Units) -> tuple[Tensor, Tensor]:
    out, lse = _empty_output(q)
    out.zero_()  # rows no query names stay zero
    views = [_rows(x) for x in (q, k, v, out, lse)]
    dim = q.shape[-1]
    library().listed_attention_forward(
        ctypes.byref(units.struct(bias)), *(ctypes.byref(view) for view, _ in views),
        ctypes.c_int64(dim), ctypes.c_float(dim ** -0.5),
    )
    return out, lse


def _backward(grad_out, q, k, v, out, lse, bias: Tensor | None, units: Units):
    """-> grad_q, grad_k, grad_v [B, H, T, D] and the bias gradient [L] (None without a bias)."""
    grad_q, grad_k, grad_v = (torch.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))
    grad_bias = None if bias is None else torch.empty_like(bias)
    views = [_rows(x) for x in (q, k, v, out, lse, grad_out, grad_q, grad_k, grad_v)]
    dim = q.shape[-1]
    library().listed_attention_backward(
        ctypes.byref(units.struct(bias)), ctypes.c_void_p(units.group_start.data_ptr()),
        ctypes.c_int64(units.group_start.numel() - 1), *(ctypes.byref(view) for view, _ in views),
        ctypes.c_void_p(0 if grad_bias is None else grad_bias.data_ptr()), ctypes.c_int64(dim),
        ctypes.c_float(dim ** -0.5),
    )
    return grad_q, grad_k, grad_v, grad_bias


# ----------------------------------------------------------------------------------------------
# Routed attention: attnlab::routed_attention_cpu


@torch.library.custom_op("attnlab::routed_attention_cpu", mutates_args=())
def routed_attention_cpu(q: Tensor, k: Tensor, v: Tensor, clusters: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """Token t of each routed head sees itself and the last `window` earlier tokens of its cluster.
    q, k, v [B, R, T, D] (keys rotated), clusters [B, R, T] -> (output [B, R, T, D] laid out
    [B, T, R, D], log-sum-exp [B, R, T, 1])."""
    require(q, k, v)
    return _forward(q, k, v, None, cluster_units(clusters, window))


@routed_attention_cpu.register_fake
def _(q, k, v, clusters, window):
    return _empty_output(q)


@torch.library.custom_op("attnlab::routed_attention_cpu_backward", mutates_args=())
def routed_attention_cpu_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, clusters: Tensor, window: int,
                                  out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    grad_q, grad_k, grad_v, _ = _backward(grad_out, q, k, v, out, lse, None, cluster_units(clusters, window))
    return grad_q, grad_k, grad_v


@routed_attention_cpu_backward.register_fake
def _(grad_out, q, k, v, clusters, window, out, lse):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _routed_setup(ctx, inputs, output) -> None:
    q, k, v, clusters, window = inputs
    ctx.save_for_backward(q, k, v, clusters, *output)
    ctx.window = window


def _routed_backward(ctx, grad_out, _grad_lse):
    q, k, v, clusters, out, lse = ctx.saved_tensors
    grads = routed_attention_cpu_backward(grad_out.contiguous(), q, k, v, clusters, ctx.window, out, lse)
    return *grads, None, None


routed_attention_cpu.register_autograd(_routed_backward, setup_context=_routed_setup)


# ----------------------------------------------------------------------------------------------
# Sorted-bucket attention: attnlab::bucket_attention_cpu


@torch.library.custom_op("attnlab::bucket_attention_cpu", mutates_args=())
def bucket_attention_cpu(q: Tensor, k: Tensor, v: Tensor, chosen: Tensor, weights: Tensor,
                         bucket_size: int) -> tuple[Tensor, Tensor]:
    """Token t sees the earlier tokens of its bucket and itself, and every token of the buckets its
    bucket chose, those scores raised by the bucket's log sorting weight. q, k, v [B, H, T, D] (a
    whole sequence), chosen, weights [B, H, N, S] (-inf: no such bucket) -> (output laid out
    [B, T, H, D], log-sum-exp [B, H, T, 1])."""
    require(q, k, v)
    units, bias, _ = bucket_units(chosen, weights, q.shape[2], bucket_size)
    return _forward(q, k, v, bias, units)


@bucket_attention_cpu.register_fake
def _(q, k, v, chosen, weights, bucket_size):
    return _empty_output(q)


@torch.library.custom_op("attnlab::bucket_attention_cpu_backward", mutates_args=())
def bucket_attention_cpu_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, chosen: Tensor, weights: Tensor,
                                  bucket_size: int, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    units, bias, listed = bucket_units(chosen, weights, q.shape[2], bucket_size)
    grad_q, grad_k, grad_v, grad_bias = _backward(grad_out, q, k, v, out, lse, bias, units)
    # the bias of every listed key back to its bucket's weight: [B H, N, (S + 1) b] -> [B, H, N, S]
    per_key = torch.zeros(listed.shape, dtype=grad_bias.dtype)
    per_key[listed] = grad_bias
    n_sortcut = weights.shape[-1]
    grad_weights = per_key.view(*weights.shape[:3], n_sortcut + 1, bucket_size)[..., :n_sortcut, :].sum(-1)
    return grad_q, grad_k, grad_v, grad_weights


@bucket_attention_cpu_backward.register_fake
def _(grad_out, q, k, v, chosen, weights, bucket_size, out, lse):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), weights.new_empty(weights.shape)


def _bucket_setup(ctx, inputs, output) -> None:
    q, k, v, chosen, weights, bucket_size = inputs
    ctx.save_for_backward(q, k, v, chosen, weights, *output)
    ctx.bucket_size = bucket_size


def _bucket_backward(ctx, grad_out, _grad_lse):
    q, k, v, chosen, weights, out, lse = ctx.saved_tensors
    grad_q, grad_k, grad_v, grad_weights = bucket_attention_cpu_backward(
        grad_out.contiguous(), q, k, v, chosen, weights, ctx.bucket_size, out, lse)
    return grad_q, grad_k, grad_v, None, grad_weights, None


bucket_attention_cpu.register_autograd(_bucket_backward, setup_context=_bucket_setup)
