"""A CPU operator for Int8Linear (model/quantize.py): float32 activations times an int8 weight with
one scale per output, in one C++ call (int8_linear_cpu.cpp says how), the `cpu` kernel of an int8
product (the default of eager decoding and of compiled steps that read their weights:
Int8Linear.product_for).

Built on first use like the attention kernels (attention/kernels/cpu.py: cached by source, compiler
and CPU) and registered with torch's dispatcher as attnlab::int8_linear_cpu, so a compiled decode
step that takes it calls it from inductor's C++ wrapper. Without a compiler, or
with ATTNLAB_CPU_KERNELS=0, `available()` is False and Int8Linear takes torch's kernel or the
dequantized weight.

Legend: N rows of activations, K input width, O outputs.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from attnlab.attention.kernels.cpu import OperatorLibrary

SOURCE = Path(__file__).parent / "int8_linear_cpu.cpp"


def _register_fake() -> None:
    """The operator's shape for torch.compile, once it is loaded (its schema is the library's)."""
    torch.library.register_fake("attnlab::int8_linear_cpu")(
        lambda x, weight, scale: x.new_empty((x.shape[0], weight.shape[0])))


_library = OperatorLibrary("attnlab_int8_linear", SOURCE, _register_fake, "using torch's int8 kernel")

available = _library.availability()


def serves(x: Tensor) -> bool:
    """Whether the operator takes activations x [N, K]: float32 on the CPU."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and available()


def int8_linear(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """x [N, K] float32, weight [O, K] int8, scale [O] float32 -> (x @ weight^T) * scale [N, O]
    float32 (`serves` says where it runs)."""
    if not available():
        raise RuntimeError("the cpu int8 product is not built here (no C++ compiler, or ATTNLAB_CPU_KERNELS=0): "
                           "choose the torch or dequantized product")
    return torch.ops.attnlab.int8_linear_cpu(x, weight, scale)
