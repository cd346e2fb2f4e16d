"""The flex_attention callable every FlexAttention back-end calls (local, routing, sinkhorn, NSA).

On CUDA it is compiled (the fused kernels that skip empty blocks), one graph per shape or length
bucket, with dynamo's recompile limits raised so that a model meeting many shapes never falls back
to the unfused path silently. Elsewhere it is FlexAttention's eager reference (forward only on
CPU in torch 2.13, and it builds the whole query x key score matrix: for checks and short inputs).

The compiled kernels need a head width of at least 16: narrower heads are zero-padded (scores and
outputs unchanged, the scale taken from the true width). Compiling per shape suits whole
sequences, not decoding: back-ends send chunks shorter than `LENGTH_BUCKET` queries on CUDA to
their exact torch path (`worth_flex`), so a growing cache never compiles a kernel per length.
"""

from __future__ import annotations

import functools
import warnings

import torch.nn.functional as F

RECOMPILE_LIMIT = 256  # dynamo cache entries per function: one per shape, far above what runs use
LENGTH_BUCKET = 128  # compiled calls pad their lengths to a multiple of this (FlexAttention's tile)
MIN_HEAD_WIDTH = 16  # the compiled kernels' smallest head width


def worth_flex(n_queries: int, device_type: str) -> bool:
    """Whether a chunk of n_queries goes through flex: on CUDA whole sequences and long chunks
    (a short one would compile a kernel for its shape), on the CPU any chunk of 2 or more."""
    return n_queries >= (LENGTH_BUCKET if device_type == "cuda" else 2)


@functools.cache
def flex_kernel(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda":
        return _eager(flex_attention)
    import torch._dynamo

    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, RECOMPILE_LIMIT)
    config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, RECOMPILE_LIMIT)
    return _padded_heads(torch.compile(flex_attention, dynamic=False))


def _padded_heads(compiled):
    """compiled flex_attention for any head width: narrower than MIN_HEAD_WIDTH is zero-padded."""

    def call(q, k, v, scale=None, **kwargs):
        width = q.shape[-1]
        if width >= MIN_HEAD_WIDTH:
            return compiled(q, k, v, scale=scale, **kwargs)
        q, k, v = (F.pad(x, (0, MIN_HEAD_WIDTH - width)) for x in (q, k, v))
        return compiled(q, k, v, scale=width**-0.5 if scale is None else scale, **kwargs)[..., :width]

    return call


def _eager(flex_attention):
    """flex_attention without its "call me under torch.compile" warning: eager is deliberate here."""

    @functools.wraps(flex_attention)
    def call(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return flex_attention(*args, **kwargs)

    return call
