"""nn.Linear, with a faster product for the few rows of activations that decoding multiplies on a CPU.

Decoding multiplies a handful of rows x [N, K] (one per sequence and new token) by every weight
W [O, K] of the model once per forward. torch.nn.functional.linear computes x W^T; for so few
rows MKL takes a matrix-vector path (one row) or a small-matrix path. Both are fast while W sits
in the caches, and slow when W must come from memory. The same product as W x^T, the rows as the
columns of a matrix product (torch.mm(W, x^T), transposed back), costs about the same wherever W
comes from: on the machine measured, up to 2.9 times faster than F.linear for weights streamed
from memory, up to 2.4 times slower for weights in the caches (docs/benchmarks.md, "Decoding
products on the CPU"). One row is padded to two columns: a one-column product takes the
matrix-vector path again; up to CONTIGUOUS_ROWS_MAX strided rows are copied contiguous first.

Which one a weight takes when decoding depends on the model: a model whose linear weights come to
COLUMN_PRODUCT_MIN_MODEL_BYTES or more reads each weight from memory once per token (the others
evict it in between), one below stays in the caches. `set_column_layout(model)` marks every Linear
of a model by that rule (Transformer does so when built; a Linear alone takes the column layout).
The column layout is taken only where it was measured: float32 on a CPU whose BLAS is MKL, at
most COLUMN_PRODUCT_MAX_ROWS rows, no autograd (inference mode or no_grad: decoding, evaluation).
Training, GPUs, other dtypes and other BLAS libraries keep F.linear. The two layouts agree to
float rounding (the sums run in another order). ATTNLAB_COLUMN_PRODUCTS=0 in the environment
turns the column layout off everywhere.

Legend: N rows of activations, K input width, O output width.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.model.quantize import Int8Linear

# with weights streamed from memory, W x^T was as fast as x W^T or faster for 1-32 rows of the CPU
# pair's widths (docs/benchmarks.md, "Decoding products on the CPU")
COLUMN_PRODUCT_MAX_ROWS = 32
# the two layouts broke even for a working set of 8 MB of weights (a 32 MB L3 cache shared with
# other work): below it F.linear's products were the faster, above it the column products
COLUMN_PRODUCT_MIN_MODEL_BYTES = 8 << 20
# MKL's W x^T with x^T row-major (the rows of x strided: x the transposed result of another column
# product, as the feed-forward's down projection receives it) took 1.4-4.0x as long as with the
# rows of x contiguous at 2-10 rows, and 0.86-1.0x as long at 12-32 rows (docs/benchmarks.md,
# "The rows of a column product"): up to this many rows, the column product copies x contiguous
CONTIGUOUS_ROWS_MAX = 10

_enabled = torch.backends.mkl.is_available() and os.environ.get("ATTNLAB_COLUMN_PRODUCTS", "1") != "0"


def column_products_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def column_products(enabled: bool) -> Iterator[None]:
    """Turn the column layout on or off for a while (benchmarks compare both; tests force it)."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


def uses_column_product(x: Tensor, weight: Tensor) -> bool:
    """Whether Linear multiplies x by weight as W x^T (the conditions in the module docstring)."""
    return (
        _enabled
        and x.device.type == "cpu"
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


class Linear(nn.Linear):
    """nn.Linear (same parameters, state dict and initialisation) whose decoding-sized products
    on a CPU run as W x^T when `column_layout` (module docstring)."""

    column_layout = True  # set_column_layout decides it for a model's layers

    def forward(self, x: Tensor) -> Tensor:
        if self.column_layout and uses_column_product(x, self.weight):
            return column_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights of every Linear of `model` as float32 (a shared weight counted once)."""
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(4 * weight.numel() for weight in weights.values())


def set_column_layout(model: nn.Module, min_bytes: int | None = None) -> bool:
    """Let every Linear of `model` take the column layout iff the model's linear weights come to
    min_bytes (default COLUMN_PRODUCT_MIN_MODEL_BYTES) or more; returns that choice."""
    columns = linear_weight_bytes(model) >= (COLUMN_PRODUCT_MIN_MODEL_BYTES if min_bytes is None else min_bytes)
    for module in model.modules():
        if isinstance(module, Linear):
            module.column_layout = columns
    return columns


def decoding_products(model: nn.Module, device: torch.device | str = "cpu") -> str:
    """How `model`'s linear layers multiply the rows of a float32 decoding step on `device`:
    "columns", "F.linear", "int8" (quantized layers, model/quantize.py), or several joined by "+"
    (benchmark records say which ran)."""
    columns = _enabled and torch.device(device).type == "cpu"
    kinds = set()
    for module in model.modules():
        if isinstance(module, Int8Linear):
            kinds.add("int8")
        elif isinstance(module, nn.Linear):
            kinds.add("columns" if columns and isinstance(module, Linear) and module.column_layout else "F.linear")
    return "+".join(sorted(kinds)) or "none"
