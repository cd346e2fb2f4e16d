"""Sinkhorn attention: equal to a masked dense oracle, causal sorting, options honoured."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.attention.base import AttentionSpec
from attnlab.attention.kernels.cpu import available
from attnlab.attention.kernels.listed_cpu import bucket_attention_cpu
from attnlab.attention.sinkhorn import (
    SinkhornAttention,
    bucket_attention,
    bucket_means,
    cached_bucket_attention,
    causal_sinkhorn,
    sort_buckets,
)
from attnlab.config import SinkhornAttentionConfig
from attnlab.model import Transformer
from variants import variant_config


def layer(**options) -> SinkhornAttention:
    spec = AttentionSpec(dim=16, n_heads=2, dim_head=8, n_kv_heads=2, dropout=0.0, max_seq_len=64,
                         layer_index=0, n_layers=1, rotary=None)
    torch.manual_seed(0)
    return SinkhornAttention(spec, SinkhornAttentionConfig(**{"bucket_size": 4, "n_sortcut": 2, **options})).eval()


@pytest.mark.parametrize("length", [4, 13, 24])
def test_equals_dense_oracle(length, cpu_path):
    attention = layer()
    x = torch.randn(2, length, 16)
    q, k, v = attention.heads.project(x)  # [B, H, T, D]
    chosen, weights = sort_buckets(bucket_means(q, 4), bucket_means(k, 4), 2, 5, 0.75, gumbel=False)
    bucket = torch.arange(length) // 4
    bias = torch.full((2, 2, length, length), float("-inf"))
    for slot in range(2):  # chosen past buckets, with their log sorting weight
        picked = chosen[..., slot][..., bucket]  # [B, H, T]: the bucket each query picked in this slot
        hit = picked[..., :, None] == bucket[None, None, None, :]
        bias = torch.where(hit, weights[..., slot][..., bucket][..., None].expand_as(bias), bias)
    own = (bucket[:, None] == bucket[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    bias = torch.where(own, torch.zeros(()), bias)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8) + bias
    expected = attention.heads.merge(torch.softmax(scores, -1) @ v)
    with torch.no_grad():
        torch.testing.assert_close(attention(x), expected, atol=1e-5, rtol=1e-5)


def bucket_attention_reference(q, keys, values, chosen, weights, offset, size):
    """The scores written out densely: own bucket causal, chosen buckets plus their log weight."""
    n_new, n_keys = q.shape[2], keys.shape[2]
    position = offset + torch.arange(n_new)  # [T]
    key_position = torch.arange(n_keys)  # [S]
    bucket, key_bucket = position // size, key_position // size
    own = (bucket[:, None] == key_bucket[None, :]) & (key_position[None, :] <= position[:, None])
    bias = torch.where(own, 0.0, float("-inf")).expand(*q.shape[:2], -1, -1)  # [B, H, T, S]
    query_bucket = bucket - offset // size  # row of chosen/weights
    for slot in range(chosen.shape[-1]):
        picked = chosen[..., slot][..., query_bucket]  # [B, H, T]
        weight = weights[..., slot][..., query_bucket]
        hit = (picked[..., None] == key_bucket) & weight[..., None].isfinite()
        bias = torch.where(hit, weight[..., None].expand_as(bias), bias)
    scores = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    return torch.softmax(scores, dim=-1) @ values


@pytest.mark.parametrize("path, offset, n_new", [("torch", 0, 23), ("torch", 13, 9), ("cpu", 0, 23), ("cpu", 0, 25)])
def test_bucket_attention_equals_written_out_scores_with_gradients(path, offset, n_new):
    """The reference (whole sequences and chunks through a cache) and the cpu back-end (whole
    sequences, the sorting weight as a per-key bias): outputs and gradients (the weights'
    included, holes included) must equal the densely written-out scores'."""
    if path == "cpu" and not available():
        pytest.skip("the CPU kernels could not be built here")
    torch.manual_seed(3)
    batch, heads, size, dim, sortcut = 2, 3, 5, 8, 2
    n_keys = offset + n_new
    first, n_buckets = offset // size, math.ceil(n_keys / size)
    q = torch.randn(batch, heads, n_new, dim)
    keys, values = torch.randn(2, batch, heads, n_keys, dim).unbind(0)
    bucket = torch.arange(first, n_buckets)[:, None]  # [M, 1]
    start = (torch.rand(batch, heads, n_buckets - first, 1) * bucket).long()
    chosen = (start + torch.arange(sortcut)) % bucket.clamp(min=1)  # distinct past buckets
    weights = torch.randn(batch, heads, n_buckets - first, sortcut)
    weights = weights.masked_fill(bucket.expand_as(weights) <= torch.arange(sortcut), float("-inf"))  # holes
    inputs = [x.requires_grad_() for x in (q, keys, values, weights)]
    target = torch.randn(batch, heads, n_new, dim)
    results = []

    def cpu_back_end(q, keys, values, chosen, weights, offset, size):
        return bucket_attention_cpu(q, keys, values, chosen, weights, size)[0]

    def reference(q, keys, values, chosen, weights, offset, size):
        if offset == 0:
            return bucket_attention(q, keys, values, chosen, weights, size)
        # a chunk through a cache: every bucket's choice (the rows before `first` unused)
        pad = (0, 0, first, 0)
        positions = (offset + torch.arange(q.shape[2])).expand(q.shape[0], -1)
        return cached_bucket_attention(q, keys, values, F.pad(chosen, pad), F.pad(weights, pad), positions, size)

    for function in (cpu_back_end if path == "cpu" else reference, bucket_attention_reference):
        y = function(*inputs[:3], chosen, inputs[3], offset, size)
        results.append((y, torch.autograd.grad((y * target).sum(), inputs)))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for fused, written in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(fused, written.nan_to_num(0.0), atol=1e-5, rtol=1e-5)
    assert results[0][1][-1].abs().sum() > 0  # the sorting weights get a gradient


def test_sorting_chooses_past_buckets_only():
    torch.manual_seed(0)
    means = torch.randn(2, 3, 10, 8)
    chosen, weights = sort_buckets(means, torch.randn(2, 3, 10, 8), 3, 5, 0.5, gumbel=True)
    row = torch.arange(10)[:, None]
    assert torch.all((chosen < row) | weights.isinf())
    assert torch.all(weights[:, :, 0].isinf()) and torch.all(weights[:, :, 3:].isfinite())


def test_causal_sinkhorn_rows_ignore_later_rows():
    logits = torch.randn(1, 1, 8, 8)
    valid = torch.ones(8, 8, dtype=torch.bool).tril(-1)
    changed = logits.clone()
    changed[..., 5:, :] = torch.randn(1, 1, 3, 8)
    before = causal_sinkhorn(logits.masked_fill(~valid, -1e4), valid, 4)
    after = causal_sinkhorn(changed.masked_fill(~valid, -1e4), valid, 4)
    assert torch.equal(before[..., :5, :], after[..., :5, :])
    assert not torch.equal(before[..., 5:, :], after[..., 5:, :])


def test_gumbel_noise_in_training_only():
    attention = layer(n_sortcut=1)
    x = torch.randn(1, 40, 16)
    with torch.no_grad():
        assert torch.equal(attention(x), attention(x))
        attention.train()
        assert not torch.equal(attention(x), attention(x))


X = torch.randint(0, 61, (2, 45), generator=torch.Generator().manual_seed(5))


def logits(**options) -> torch.Tensor:
    config = variant_config("sinkhorn")
    config.attention.sinkhorn = dataclasses.replace(config.attention.sinkhorn, **options)
    torch.manual_seed(0)
    with torch.no_grad():
        return Transformer(config).eval()(X).logits


@pytest.mark.parametrize(
    "option, value",
    [("bucket_size", 4), ("n_sortcut", 1), ("sinkhorn_iter", 1), ("temperature", 0.1), ("n_local_heads", 3)],
)
def test_options_change_outputs(option, value):
    assert not torch.allclose(logits(**{option: value}), logits(), atol=1e-5)
