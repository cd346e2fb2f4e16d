"""Listed-key attention on the CPU (listed_cpu.cpp): each unit, a (batch, head)'s list of key
tokens, is attended to by its query tokens, query i seeing the contiguous range lo_i..hi_i of the
list (each key's score raised by an optional bias). Routing attention makes one unit per cluster,
sinkhorn attention one per bucket (attention/routing.py, attention/sinkhorn.py).

Forward and backward each run in one pass over the units, reading q, k, v and writing the outputs
and gradients as rows in place (`rows_of`): no block layout is gathered, padded or scattered. The
backward keeps only what torch's fused attention keeps (q, k, v, the output, one log-sum-exp per
query) and the small index lists.

The kernel is compiled on first use with the other CPU kernels (kernels/cpu.py). Without a
compiler, or with ATTNLAB_CPU_KERNELS=0, `available()` is False and the attention modules keep
their pure-torch paths.

Legend: B batch, H heads, T tokens, D head width, U units, L listed keys, Q queries.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab.attention.gathered import rows_of
from attnlab.attention.kernels.cpu import available, library, usable  # noqa: F401 - this module's API


class _Rows(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("start", ctypes.c_void_p), ("step", ctypes.c_int64)]


class _Units(ctypes.Structure):
    _fields_ = [
        ("n_units", ctypes.c_int64), ("bh", ctypes.c_void_p), ("key_start", ctypes.c_void_p),
        ("key_tokens", ctypes.c_void_p), ("key_bias", ctypes.c_void_p), ("query_start", ctypes.c_void_p),
        ("query_tokens", ctypes.c_void_p), ("query_lo", ctypes.c_void_p), ("query_hi", ctypes.c_void_p),
    ]


@dataclass
class Units:
    """The unit lists (all int64 on the CPU, contiguous). bh [U]; key_start [U + 1] into
    key_tokens [L]; query_start [U + 1] into query_tokens, query_lo,
    query_hi [Q] (lo/hi index the unit's own list, hi inclusive); group_start [G + 1]: the units
    of a group share key rows, and run in order; groups run in parallel."""

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


def _rows(x: Tensor) -> tuple[_Rows, tuple]:
    """x [B, H, T, D] -> the kernel's row view, and what must stay alive while it is used."""
    rows, start, step = rows_of(x)
    start = start.contiguous()
    return _Rows(rows.data_ptr(), start.data_ptr(), step), (rows, start)


def _forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, units: Units) -> tuple[Tensor, Tensor]:
    batch, n_heads, n_tokens, dim = q.shape
    out = q.new_zeros(batch, n_tokens, n_heads, dim).transpose(1, 2)  # merging heads after: a view
    lse = q.new_empty(batch, n_heads, n_tokens, 1)
    views = [_rows(x) for x in (q, k, v, out, lse)]
    library().listed_attention_forward(
        ctypes.byref(units.struct(bias)), *(ctypes.byref(view) for view, _ in views),
        ctypes.c_int64(dim), ctypes.c_float(dim ** -0.5),
    )
    return out, lse


class _ListedAttention(torch.autograd.Function):
    """Keys come in before their rotary positions (`rotary`: keys -> rotated keys, or None) and
    are rotated here, in the forward and again in the backward, so that autograd keeps one copy
    of the keys, the one the caller keeps anyway."""

    @staticmethod
    def forward(ctx, q, k, v, key_bias, units, rotary):
        bias = None if key_bias is None else key_bias.detach().contiguous()
        rotated = k if rotary is None else rotary(k)
        out, lse = _forward(q, rotated, v, bias, units)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.units, ctx.rotary = units, rotary
        ctx.library = library()  # the backward runs on the library the forward ran on, whatever the settings then
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, out, lse = ctx.saved_tensors
        units, rotary = ctx.units, ctx.rotary
        with torch.enable_grad():  # rotate the keys again, to carry their gradient back through it
            unrotated = k.detach().requires_grad_(rotary is not None)
            rotated = unrotated if rotary is None else rotary(unrotated)
        dim = q.shape[-1]
        grad_q, grad_k, grad_v = (torch.zeros(x.shape, dtype=x.dtype) for x in (q, k, v))
        grad_bias = None if bias is None else torch.empty_like(bias)
        views = [_rows(x) for x in (q, rotated.detach(), v, out, lse, grad_out, grad_q, grad_k, grad_v)]
        ctx.library.listed_attention_backward(
            ctypes.byref(units.struct(bias)), ctypes.c_void_p(units.group_start.data_ptr()),
            ctypes.c_int64(units.group_start.numel() - 1), *(ctypes.byref(view) for view, _ in views),
            ctypes.c_void_p(0 if grad_bias is None else grad_bias.data_ptr()), ctypes.c_int64(dim),
            ctypes.c_float(dim ** -0.5),
        )
        if rotary is not None:
            (grad_k,) = torch.autograd.grad(rotated, unrotated, grad_k)
        return grad_q, grad_k, grad_v, grad_bias, None, None


def listed_attention(
    q: Tensor, k: Tensor, v: Tensor, units: Units, key_bias: Tensor | None = None,
    rotary: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """q, k, v [B, H, T, D] float32 on the CPU; units over their tokens; key_bias [L] (gets a
    gradient) or None; rotary: applied to k first -> [B, H, T, D] (laid out [B, T, H, D]). Rows
    that no query names are zero."""
    if not usable(q, k, v):
        raise RuntimeError("listed_attention needs float32 CPU tensors and the compiled kernel")
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, key_bias)):
        return _ListedAttention.apply(q, k, v, key_bias, units, rotary)
    k = k if rotary is None else rotary(k)
    return _forward(q, k, v, None if key_bias is None else key_bias.contiguous(), units)[0]
