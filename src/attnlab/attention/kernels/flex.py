"""The flex_attention callable every FlexAttention back-end calls (local, routing, sinkhorn, NSA).

On CUDA it is compiled (the fused kernels that skip empty blocks), one graph per shape or length
bucket, with dynamo's recompile limits raised so that a model meeting many shapes never falls back
to the unfused path silently. Elsewhere it is FlexAttention's eager reference (forward only on
CPU in torch 2.13, and it builds the whole query x key score matrix: for checks and short inputs).
"""

from __future__ import annotations

import functools
import warnings

RECOMPILE_LIMIT = 256  # dynamo cache entries per function: one per shape, far above what runs use


@functools.cache
def flex_kernel(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return _eager(flex_attention)
    import torch._dynamo

    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, RECOMPILE_LIMIT)
    config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, RECOMPILE_LIMIT)
    return torch.compile(flex_attention, dynamic=False)


def _eager(flex_attention):
    """flex_attention without its "call me under torch.compile" warning: eager is deliberate here."""

    @functools.wraps(flex_attention)
    def call(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return flex_attention(*args, **kwargs)

    return call
