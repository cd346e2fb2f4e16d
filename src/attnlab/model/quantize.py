"""Weight-only int8 quantization for decoding: every nn.Linear of a model keeps its weight as int8
with one float scale per output row (symmetric, absmax / 127); activations stay float.

Decoding a small batch on a CPU streams every weight from memory once per token, so the bytes
of the weights set the pace: int8 weights are a quarter of float32's. Speculative decoding uses it
for the draft (`attnlab speculative --draft-quantize int8`): the draft only proposes tokens, so a
quantized draft changes how many of them the target accepts, never the distribution of the
output. A quantized target would be a different model, and is not offered there.

The product of a few rows of activations with the int8 weight runs through torch's int8
weight-only kernel on CPU (`torch._weight_int8pack_mm`, bfloat16 activations: outputs agree with
the dequantized weight's to about 3 significant digits). Everywhere else (other devices, more
rows, reduction widths the kernel does not handle) the weight is dequantized for the product.

Legend: N rows of activations, K input width, O output width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

QUANTIZATIONS = ("none", "int8")

# the CPU kernel is faster than a float product for a few rows of activations only (decoding)
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
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))  # the CPU kernel's
        self.register_buffer("bias", bias)  # float [O] or None
        self.use_kernel = _kernel_handles(self.in_features)

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

    def forward(self, x: Tensor, use_kernel: bool | None = None) -> Tensor:
        """x [..., K] -> [..., O] in x's dtype. use_kernel: force (True) or avoid (False) the CPU
        kernel; None takes it where it applies."""
        flat = x.reshape(-1, self.in_features)  # [N, K]
        if use_kernel is None:
            use_kernel = self.use_kernel and x.device.type == "cpu" and flat.shape[0] <= FAST_PATH_MAX_ROWS
        if use_kernel:
            y = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), self.weight, self.scale_bf16).to(x.dtype)
        else:
            y = F.linear(flat, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def decoding_products(model: nn.Module) -> str:
    """How `model`'s linear layers multiply when decoding: "F.linear", "int8" (quantized layers), or
    both joined by "+" (benchmark records say which ran)."""
    kinds = {"int8" if isinstance(module, Int8Linear) else "F.linear"
             for module in model.modules() if isinstance(module, (Int8Linear, nn.Linear))}
    return "+".join(sorted(kinds)) or "none"


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
