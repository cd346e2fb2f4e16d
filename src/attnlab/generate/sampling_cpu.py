"""A CPU operator for token_at (generate/distribution.py): the token at which a row's cumulative
distribution passes a uniform, in one C++ call (sampling_cpu.cpp says how, and why it gives torch's
tokens bit for bit).

Built on first use like the attention kernels (attention/kernels/cpu.py: cached by source, compiler
and CPU) and registered with torch's dispatcher as attnlab::token_at_cpu, so a compiled decode step
calls it from inductor's C++ wrapper. Without a compiler, or with ATTNLAB_CPU_KERNELS=0,
`available()` is False and token_at keeps torch's cumsum and searchsorted.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from attnlab.attention.kernels.cpu import OperatorLibrary

SOURCE = Path(__file__).parent / "sampling_cpu.cpp"


def _register_fake() -> None:
    """The operator's shape for torch.compile, once it is loaded (its schema is the library's)."""
    torch.library.register_fake("attnlab::token_at_cpu")(
        lambda probs, uniform: probs.new_empty(probs.shape[:-1], dtype=torch.long))


_library = OperatorLibrary("attnlab_sampling", SOURCE, _register_fake, "sampling with torch's operators")

available = _library.availability()


def serves(probs: Tensor, uniform: Tensor) -> bool:
    """Whether the operator takes these: float32 probabilities [..., V] and uniforms [...] on the CPU
    (other shapes broadcast in torch's path)."""
    return (probs.device.type == "cpu" and probs.dtype == torch.float32 and uniform.dtype == torch.float32
            and uniform.shape == probs.shape[:-1] and available())


def token_at(probs: Tensor, uniform: Tensor) -> Tensor:
    """probs [..., V], uniform [...] -> [...] int64: distribution.token_at's token (the caller has
    checked `serves`)."""
    return torch.ops.attnlab.token_at_cpu(probs, uniform)
