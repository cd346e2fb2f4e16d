"""Column products: an opt-in inference transform for decoding on a CPU whose BLAS is MKL.

Decoding multiplies a handful of rows x [N, K] (one per sequence and new token) by every weight
W [O, K] of the model once per forward. torch.nn.functional.linear computes x W^T; for so few rows
MKL takes a matrix-vector path (one row) or a small-matrix path, both fast while W sits in the
caches and slow when W must come from memory. The same product as W x^T (torch.mm(W, x^T),
transposed back) costs about the same wherever W comes from. On the 2-core machine where it was
measured, W x^T was up to 2.9x faster than F.linear for weights streamed from memory and up to 2.4x
slower for weights in the caches; whether it pays depends on the machine and the model, so the
model never takes it by itself: `use_column_products(model)` turns it on for one model
(`attnlab sample / speculative / bench decode --column-products`), as `quantize_weights` does int8.

A transformed layer takes the column product only for float32 on the CPU, without autograd, for at
most COLUMN_PRODUCT_MAX_ROWS rows; everything else keeps F.linear. One row is padded to two columns
(a one-column product takes the matrix-vector path again), and up to CONTIGUOUS_ROWS_MAX strided
rows are copied contiguous first. Both constants are what was measured on that machine; they are
shape limits of this transform, not of the model. The two layouts agree to float rounding.

Legend: N rows of activations, K input width, O output width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.model.quantize import Int8Linear

# with weights streamed from memory, W x^T was as fast as x W^T or faster for 1-32 rows
COLUMN_PRODUCT_MAX_ROWS = 32
# MKL's W x^T with x^T row-major (x the transposed result of another column product, as the
# feed-forward's down projection receives it) took 1.4-4.0x as long as with the rows contiguous at
# 2-10 rows, and 0.86-1.0x as long at 12-32 rows
CONTIGUOUS_ROWS_MAX = 10


def uses_column_product(x: Tensor, weight: Tensor) -> bool:
    """Whether a ColumnLinear multiplies x by weight as W x^T (the conditions in the module docstring)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and x.numel() <= COLUMN_PRODUCT_MAX_ROWS * x.shape[-1]
    )


def column_product(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [..., K] W^T (+ bias) computed as (W x^T)^T; the result is a transposed view."""
    flat = x.reshape(-1, x.shape[-1])  # [N, K]
    rows = flat.shape[0]
    if rows == 1:
        columns = torch.cat((flat, flat))  # one column takes the slow path again: pad to two
    elif rows <= CONTIGUOUS_ROWS_MAX:
        columns = flat.contiguous()  # no-op unless x is itself a transposed column product
    else:
        columns = flat
    if bias is None:
        y = torch.mm(weight, columns.T)  # [O, N]
    else:
        y = torch.addmm(bias[:, None], weight, columns.T)  # [O, N]
    return y.T[:rows].reshape(*x.shape[:-1], weight.shape[0])  # [..., O]


class ColumnLinear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose decoding-sized products run as W x^T."""

    def forward(self, x: Tensor) -> Tensor:
        if uses_column_product(x, self.weight):
            return column_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_column_products(model: nn.Module, enabled: bool = True) -> int:
    """Turn every nn.Linear of `model` into a ColumnLinear in place (enabled=False: back), keeping
    its parameter objects, so tied weights stay tied. Returns how many layers changed."""
    source, target = (nn.Linear, ColumnLinear) if enabled else (ColumnLinear, nn.Linear)
    changed = 0
    for module in model.modules():
        if type(module) is source:
            module.__class__ = target  # same attributes and parameters; only forward differs
            changed += 1
    return changed


def decoding_products(model: nn.Module, device: torch.device | str = "cpu") -> str:
    """How `model`'s linear layers multiply the rows of a float32 decoding step on `device`:
    "columns", "F.linear", "int8" (quantized layers, model/quantize.py), or several joined by "+"
    (benchmark records say which ran)."""
    on_cpu = torch.device(device).type == "cpu"
    kinds = set()
    for module in model.modules():
        if isinstance(module, Int8Linear):
            kinds.add("int8")
        elif isinstance(module, nn.Linear):
            kinds.add("columns" if on_cpu and isinstance(module, ColumnLinear) else "F.linear")
    return "+".join(sorted(kinds)) or "none"
