"""The flex_attention callable every FlexAttention back-end calls (local, routing, sinkhorn, NSA).

On CUDA it is compiled (the fused kernels that skip empty blocks), one graph per shape or length
bucket, with dynamo's recompile limits raised so that a model meeting many shapes never falls back
to the unfused path silently. Elsewhere it is FlexAttention's eager reference (forward only on
CPU in torch 2.13, and it builds the whole query x key score matrix: for checks and short inputs).

The compiled kernels need a head width of at least 16: narrower heads are zero-padded (scores and
outputs unchanged, the scale taken from the true width). Compiling per shape suits whole
sequences, not decoding: chunks shorter than `LENGTH_BUCKET` queries on CUDA run on the variants'
reference paths (kernels/__init__.py: `serves_call`), so a growing cache never compiles a kernel per
length.

Block masks are built from each back-end's structure (`tile_block_mask`): which key tiles of
`TILE` tokens a query tile can see, worked out from the window, the selected blocks or the chosen
buckets in O(tiles) memory; the mask function decides within a tile. torch's
`create_block_mask` would evaluate the mask at every (batch, head, query, key), a B x H x T x S
grid: gigabytes at 16k tokens. A tile map must cover every tile that holds a visible pair (the
kernel skips the rest, and the CPU's eager reference does not check this), which the tests of
each back-end compare against the dense mask.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

RECOMPILE_LIMIT = 256  # dynamo cache entries per function: one per shape, far above what runs use
MIN_HEAD_WIDTH = 16  # the compiled kernels' smallest head width
TILE = 128  # FlexAttention's default block: the granularity of a BlockMask
LENGTH_BUCKET = TILE  # compiled calls pad their lengths to a multiple of this (`pad_to_bucket`)


def n_tiles(length: int) -> int:
    return -(-length // TILE)


def tile_block_mask(tiles: Tensor, mask_mod, n_queries: int, n_keys: int):
    """A BlockMask from a tile map: tiles [B, H, Qt, Kt] bool (B or H may be 1, broadcast), True
    where query tile i may see key tile j; mask_mod decides each pair inside those tiles."""
    from torch.nn.attention.flex_attention import BlockMask

    counts = tiles.sum(-1, dtype=torch.int32)  # [B, H, Qt]
    # the visible tiles of each row first, in ascending order (a stable sort of the flags)
    order = torch.sort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).indices.to(torch.int32)
    return BlockMask.from_kv_blocks(counts, order, BLOCK_SIZE=TILE, mask_mod=mask_mod, seq_lengths=(n_queries, n_keys))


def band_tiles(n_queries: int, n_keys: int, offset: int, width: int, device) -> Tensor:
    """Tile map [1, 1, Qt, Kt] of a causal band: query i (at key position offset + i) sees keys j
    with offset + i - width < j <= offset + i."""
    first_query = torch.arange(n_tiles(n_queries), device=device)[:, None] * TILE + offset
    first_key = torch.arange(n_tiles(n_keys), device=device)[None, :] * TILE
    # some query p of the tile and key k of the tile with p - width < k <= p
    return ((first_key <= first_query + TILE - 1) & (first_key + TILE - 1 > first_query - width))[None, None]


def span_tiles(starts: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """The tiles that ranges [start, start + size) overlap: (first tile, last tile), each like starts."""
    return starts // TILE, (starts + size - 1) // TILE


def pad_to_bucket(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """On CUDA, queries q [B, H, T, D] and keys/values [B, G, S, D] zero-padded at the end to a
    multiple of LENGTH_BUCKET, so that each bucket compiles once (the caller cuts the output back
    to T rows and keeps real queries off the padded keys); elsewhere unchanged."""
    if q.device.type != "cuda":
        return q, k, v
    q = F.pad(q, (0, 0, 0, -q.shape[2] % LENGTH_BUCKET))
    k, v = (F.pad(x, (0, 0, 0, -x.shape[2] % LENGTH_BUCKET)) for x in (k, v))
    return q, k, v


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
