"""Weight-only int8 quantization for decoding: every nn.Linear of a model keeps its weight as int8
with one float scale per output row (symmetric, absmax / 127); activations stay float.

Decoding a small batch on a CPU streams every weight from memory once per token, so the bytes
of the weights set the pace: int8 weights are a quarter of float32's. Speculative decoding uses it
for the draft (`attnlab speculative --draft-quantize int8`): the draft only proposes tokens, so a
quantized draft changes how many of them the target accepts, never the distribution of the
output. A quantized target would be a different model, and is not offered there.

The product of a few rows of activations (decoding) with the int8 weight has three named kernels
(PRODUCTS): "cpu", attnlab's own operator (model/int8_linear_cpu.cpp: float32 activations, the
weights widened to float32 in registers; built on first use), "torch", torch's int8 weight-only
kernel (`torch._weight_int8pack_mm`, bfloat16 activations: outputs agree with the dequantized
weight's to about 3 significant digits), and "dequantized", the float weight rebuilt for an
ordinary product (any device, any number of rows). By default a few rows on the CPU take "torch"
in a packed compiled step (inductor's own int8 template over the frozen weight), "cpu" elsewhere
(eager, or a compiled step that reads its weights: float32 rows, where it is built), else "torch"
where it applies, else "dequantized" (Int8Linear.product_for).

Legend: N rows of activations, K input width, O output width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.compiler import assume_constant_result
from attnlab.model import int8_linear_cpu

QUANTIZATIONS = ("none", "int8")
PRODUCTS = ("cpu", "torch", "dequantized")  # the kernels of an int8 product (the module docstring)

# the int8 kernels are made for a few rows of activations (decoding); more (a prompt's prefill)
# multiply by the dequantized weight, a float GEMM
FAST_PATH_MAX_ROWS = 16


def _kernel_handles(in_features: int) -> bool:
    """Reduction widths torch's CPU int8 kernel computes correctly (it returns garbage or crashes
    on some widths that are not multiples of 16, such as 8 or 24)."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm") and in_features % 16 == 0


class Int8Linear(nn.Module):
    """y = (x @ weight^T) * scale + bias, with weight int8 [O, K] and scale [O]."""

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("weight", weight)  # int8 [O, K]
        self.register_buffer("scale", scale)  # float32 [O]
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))  # torch's kernel's
        self.register_buffer("bias", bias)  # float [O] or None
        self.torch_kernel_handles = _kernel_handles(self.in_features)
        self.product: str | None = None  # the kernel forward uses (PRODUCTS); None: product_for's

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        weight = linear.weight.detach().float()
        # rows of zeros keep a scale of 1: their int8 weights are zero and so are their outputs
        absmax = weight.abs().amax(dim=1)
        scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))  # [O]
        quantized = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(quantized, scale, bias)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The float weight [O, K] this layer multiplies by."""
        return self.weight.to(dtype) * self.scale.to(dtype)[:, None]

    def product_for(self, flat: Tensor, compiled: bool | None = None, packed: bool | None = None) -> str:
        """The kernel (PRODUCTS) that multiplies activations flat [N, K] by default. compiled: in a
        step torch.compile traces (None: whether this call is traced); packed: a step whose weights
        are frozen into it (Transformer.compile_decoding's packed kernels; None: whether such a step
        is compiling now). In a packed step, torch's kernel where it applies: inductor makes the
        product in an int8 template of its own over the frozen weight, converting the activations
        inside (a compiled draft's proposal took 0.92-0.965x the time it took with attnlab's
        operator: bench/int8_products.py). Elsewhere attnlab's operator: eager, 1.2-1.5x faster than
        torch's kernel at the draft's shapes; in a compiled step that reads its weights
        (linear="library"), where inductor calls torch's kernel as it is, a proposal 1.15-1.20x
        faster (bench/int8_products.py --linear packed library)."""
        if flat.device.type != "cpu" or flat.shape[0] > FAST_PATH_MAX_ROWS:
            return "dequantized"
        if compiled is None:
            compiled = torch.compiler.is_compiling()
        if compiled and self.torch_kernel_handles and (packed_step_compiling_now() if packed is None else packed):
            return "torch"
        if int8_linear_cpu.serves(flat):
            return "cpu"
        return "torch" if self.torch_kernel_handles else "dequantized"

    def forward(self, x: Tensor, product: str | None = None) -> Tensor:
        """x [..., K] -> [..., O] in x's dtype. product: the kernel (PRODUCTS); None takes the
        layer's `product`, or where that is None product_for's."""
        flat = x.reshape(-1, self.in_features)  # [N, K]
        product = product or self.product or self.product_for(flat)
        if product == "cpu":
            y = int8_linear_cpu.int8_linear(flat, self.weight, self.scale)
        elif product == "torch":
            y = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), self.weight, self.scale_bf16).to(x.dtype)
        elif product == "dequantized":
            y = F.linear(flat, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        else:
            raise ValueError(f"an int8 product is one of {', '.join(PRODUCTS)}; got {product!r}")
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@assume_constant_result
def packed_step_compiling_now() -> bool:
    """Whether a packed decode step (its weights frozen into it) is compiling now. A constant of the
    graph being traced, not a guard on the flag: a step's graphs all compile under its model's one
    setting (each compile_decoding makes new code objects), and a guard on the flag, false once the
    compile is over, failed at every later call, so an int8 draft's steps never ran dynamo's code
    directly (Transformer._run_compiled)."""
    from attnlab.model.decode_compile import COMPILING_PACKED_STEP

    return COMPILING_PACKED_STEP[0]


def decoding_products(model: nn.Module, compiled: bool = False) -> str:
    """How `model`'s linear layers multiply when decoding: "F.linear", or "linear KERNELS" in its
    compiled step where `compiled` (Transformer.decoding_linear: compile_decoding's `linear`), "int8
    KERNEL" (quantized layers, KERNEL the product one row of the model's activations takes, in its
    compiled step where `compiled`: PRODUCTS), or several joined by "+" (benchmark records say which
    ran)."""
    packed = compiled and getattr(model, "_frozen_weights", None) is not None  # compile_decoding's packed kernels
    compiled_linear = getattr(model, "decoding_linear", None) if compiled else None
    floats = [tensor for tensor in model.parameters() if tensor.is_floating_point()]
    dtype = floats[0].dtype if floats else torch.float32  # the activations' (an embedding's, where quantized)
    kinds = set()
    for module in model.modules():
        if isinstance(module, Int8Linear):
            row = torch.empty(1, module.in_features, dtype=dtype, device=module.weight.device)
            kinds.add(f"int8 {module.product or module.product_for(row, compiled, packed)}")
        elif isinstance(module, nn.Linear):
            kinds.add(f"linear {compiled_linear}" if compiled_linear else "F.linear")
    return "+".join(sorted(kinds)) or "none"


def choose_products(model: nn.Module, product: str | None) -> None:
    """Every int8 layer of `model` multiplies by `product` (PRODUCTS; None: each call's default,
    Int8Linear.product_for), as a benchmark compares them. A compiled decoding checks its calls
    in full again after (counted as a change of structure), so it compiles for the new kernels."""
    from attnlab.model.decode_compile import STRUCTURE_CHANGES

    if product is not None and product not in PRODUCTS:
        raise ValueError(f"an int8 product is one of {', '.join(PRODUCTS)}; got {product!r}")
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.product = product
    STRUCTURE_CHANGES[0] += 1


def quantize_weights(model: nn.Module, quantization: str = "int8") -> int:
    """Replace every nn.Linear of `model` (in place) by its int8 version; embeddings and norms
    stay float. Returns how many layers were replaced; quantization "none" replaces none."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose from {', '.join(QUANTIZATIONS)}")
    if quantization == "none":
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_linear(child))
                replaced += 1
    return replaced
