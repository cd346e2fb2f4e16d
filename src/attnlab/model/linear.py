"""nn.Linear, with a faster product for the few rows of activations that decoding multiplies on a CPU.

Decoding multiplies a handful of rows x [N, K] (one per sequence and new token) by every weight
W [O, K] of the model, a weight that is not in the caches. torch.nn.functional.linear computes
x W^T; for so few rows MKL takes a matrix-vector path (one row) or a small-matrix path that
stream W slowly. The same product as W x^T, the rows as the columns of a matrix product
(torch.mm(W, x^T), transposed back), streams W two to four times as fast on the machines
measured (docs/benchmarks.md, "Decoding products"). One row is padded to two columns: a
one-column product takes the matrix-vector path again.

Linear uses this layout where it was measured to pay and nothing else changes: float32 on a CPU
whose BLAS is MKL, at most COLUMN_PRODUCT_MAX_ROWS rows, and no autograd (inference mode or
no_grad: decoding, evaluation). Training, GPUs, other dtypes and other BLAS libraries keep
F.linear. The two layouts agree to float rounding (the sums run in another order).
ATTNLAB_COLUMN_PRODUCTS=0 in the environment turns the column layout off.

Legend: N rows of activations, K input width, O output width.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# up to here W x^T was faster than x W^T for every width of the CPU pair measured (1..128 rows)
COLUMN_PRODUCT_MAX_ROWS = 32

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
    columns = torch.cat((flat, flat)) if rows == 1 else flat  # one column: the slow path again
    if bias is None:
        y = torch.mm(weight, columns.T)  # [O, N]
    else:
        y = torch.addmm(bias[:, None], weight, columns.T)  # [O, N]
    return y.T[:rows].reshape(*x.shape[:-1], weight.shape[0])  # [..., O]


class Linear(nn.Linear):
    """nn.Linear (same parameters, state dict and initialisation) whose decoding-sized products
    on a CPU run as W x^T (module docstring)."""

    def forward(self, x: Tensor) -> Tensor:
        if uses_column_product(x, self.weight):
            return column_product(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
