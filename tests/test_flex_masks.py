"""The FlexAttention back-ends build their BlockMasks from tile maps (kernels/flex.py), not by
evaluating the mask everywhere. A fused kernel skips every tile outside the map, while the CPU's
eager reference evaluates the mask at every pair, so the back-ends' own equality tests cannot see
a missing tile. Here each map is checked against the tiles where the dense mask has a visible
pair: it must hold all of them, and for the bands exactly them. Lengths span several 128-token
tiles, and blocks and buckets straddle tile edges."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.variants import random_selection

from attnlab.attention.kernels.flex import TILE, n_tiles, tile_block_mask
from attnlab.attention.kernels.flex_local import sliding_window_block_mask
from attnlab.attention.kernels.flex_routing import sorted_band_block_mask
from attnlab.attention.kernels.flex_sinkhorn import bucket_block_mask
from attnlab.attention.kernels.nsa_flex import selection_block_mask


def needed_tiles(block_mask, batch: int, heads: int, n_queries: int, n_keys: int) -> torch.Tensor:
    """[B, H, Qt, Kt]: the tiles where block_mask's mask function allows some pair."""
    b = torch.arange(batch)[:, None, None, None]
    h = torch.arange(heads)[None, :, None, None]
    q = torch.arange(n_queries)[None, None, :, None]
    k = torch.arange(n_keys)[None, None, None, :]
    dense = block_mask.mask_mod(b, h, q, k).expand(batch, heads, n_queries, n_keys)
    dense = F.pad(dense, (0, n_tiles(n_keys) * TILE - n_keys, 0, n_tiles(n_queries) * TILE - n_queries))
    return dense.unflatten(3, (-1, TILE)).unflatten(2, (-1, TILE)).any(dim=(3, 5))


def tiles_of(block_mask, batch: int, heads: int) -> torch.Tensor:
    return block_mask.to_dense().bool().expand(batch, heads, -1, -1)


def check(block_mask, batch: int, heads: int, n_queries: int, n_keys: int, exact: bool) -> None:
    need = needed_tiles(block_mask, batch, heads, n_queries, n_keys)
    have = tiles_of(block_mask, batch, heads)
    assert need.any()
    assert not (need & ~have).any(), "a tile holding visible pairs is missing"
    if exact:
        assert torch.equal(need, have)


@pytest.mark.parametrize("window, n_queries, n_keys", [(64, 700, 700), (200, 99, 354), (1, 300, 300), (300, 513, 900)])
def test_sliding_window_tiles(window, n_queries, n_keys):
    block_mask = sliding_window_block_mask(window, n_queries, n_keys, torch.device("cpu"), n_keys - n_queries)
    check(block_mask, 1, 1, n_queries, n_keys, exact=True)


@pytest.mark.parametrize("window, n_clusters", [(16, 3), (150, 1), (64, 7)])
def test_routing_band_tiles(window, n_clusters):
    torch.manual_seed(window)
    sorted_clusters = torch.randint(0, n_clusters, (2, 3, 600)).sort(dim=-1).values
    check(sorted_band_block_mask(sorted_clusters, window), 2, 3, 600, 600, exact=n_clusters == 1)


@pytest.mark.parametrize("bucket, n_tokens", [(48, 530), (128, 640), (200, 610)])
def test_sinkhorn_bucket_tiles(bucket, n_tokens):
    torch.manual_seed(bucket)
    n_buckets = -(-n_tokens // bucket)
    chosen = torch.rand(2, 2, n_buckets, n_buckets) < 0.2
    chosen &= torch.ones(n_buckets, n_buckets, dtype=torch.bool).tril(-1)  # past buckets only
    check(bucket_block_mask(chosen, bucket, n_tokens), 2, 2, n_tokens, n_tokens, exact=False)


@pytest.mark.parametrize("block, offset", [(48, 0), (64, 0), (200, 0), (48, 333)])
def test_nsa_selection_tiles(block, offset):
    """Random selections as choose_blocks makes them (block 0 and the own block in), and a chunk
    of queries after `offset` cached tokens (decoding a long chunk)."""
    torch.manual_seed(block + offset)
    n_queries, groups, heads_per_group = 500, 2, 3
    n_keys = offset + n_queries
    indices, valid = random_selection(1, groups, torch.arange(offset, n_keys), block, n_selected=4)
    block_mask = selection_block_mask(indices, valid, offset, block, heads_per_group, n_keys)
    check(block_mask, 1, groups * heads_per_group, n_queries, n_keys, exact=False)


def test_a_missing_tile_is_caught():
    """The check itself: dropping one needed tile from a map fails it."""
    block_mask = sliding_window_block_mask(64, 300, 300, torch.device("cpu"), 0)
    tiles = tiles_of(block_mask, 1, 1).clone()
    tiles[0, 0, 1, 0] = False  # the first keys, needed by the second query tile's first rows
    broken = tile_block_mask(tiles, block_mask.mask_mod, 300, 300)
    with pytest.raises(AssertionError, match="missing"):
        check(broken, 1, 1, 300, 300, exact=False)
