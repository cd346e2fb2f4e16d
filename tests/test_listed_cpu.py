"""The CPU listed-key attention kernel (attention/kernels/listed_cpu.py): equal to dense attention
over each query's keys, forward and every gradient (the key bias's included), at head widths that
are and are not a multiple of its vector width; bit-exact causality; its custom ops pass torch's
operator checks; the fallback when it cannot be built."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from attnlab.attention import routing, sinkhorn
from attnlab.attention.kernels import cpu, listed_cpu
from attnlab.attention.kernels.listed_cpu import bucket_attention_cpu, routed_attention_cpu

needs_kernel = pytest.mark.skipif(not cpu.available(), reason="no C++ compiler")


def test_kernel_builds_where_a_compiler_exists():
    """CI has a compiler: the kernel must build there, not silently fall back."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    assert cpu.available(), cpu._failure


def random_units(batch_heads: int, n_tokens: int, seed: int) -> tuple[listed_cpu.Units, torch.Tensor, torch.Tensor]:
    """Units with shared key rows across the units of a (batch, head) (one group each), random
    lists, random contiguous ranges, and a dense [B H, T, T] bias of what each query sees (-inf:
    not seen), built from the same lists."""
    generator = torch.Generator().manual_seed(seed)
    bh, key_start, key_tokens, query_start, query_tokens, lo, hi = [], [0], [], [0], [], [], []
    dense = torch.full((batch_heads, n_tokens, n_tokens), float("-inf"))
    bias = []
    queries = torch.randperm(n_tokens, generator=generator)
    for row in range(batch_heads):
        for part in queries.chunk(3):  # three units per row, together naming every token once as a query
            n_keys = int(torch.randint(1, 40, (), generator=generator))
            keys = torch.randperm(n_tokens, generator=generator)[:n_keys]
            key_bias = torch.randn(n_keys, generator=generator)
            bh.append(row)
            key_tokens += keys.tolist()
            bias += key_bias.tolist()
            key_start.append(len(key_tokens))
            for query in part.tolist():
                first = int(torch.randint(0, n_keys, (), generator=generator))
                last = int(torch.randint(first, n_keys, (), generator=generator))
                query_tokens.append(query)
                lo.append(first)
                hi.append(last)
                dense[row, query, keys[first : last + 1]] = key_bias[first : last + 1]
            query_start.append(len(query_tokens))
    units = listed_cpu.Units(
        bh=torch.tensor(bh), key_start=torch.tensor(key_start), key_tokens=torch.tensor(key_tokens),
        query_start=torch.tensor(query_start), query_tokens=torch.tensor(query_tokens), query_lo=torch.tensor(lo),
        query_hi=torch.tensor(hi), group_start=torch.arange(0, len(bh) + 1, 3),
    )
    return units, torch.tensor(bias), dense


@needs_kernel
@pytest.mark.parametrize("dim", [64, 24, 8])
def test_equals_dense_attention_with_gradients(dim):
    torch.manual_seed(0)
    batch, heads, n_tokens = 2, 2, 50
    units, bias, dense = random_units(batch * heads, n_tokens, seed=dim)
    q, k, v = (torch.randn(batch, heads, n_tokens, dim, dtype=torch.float64).requires_grad_() for _ in range(3))
    bias64 = bias.double().requires_grad_()
    target = torch.randn(batch, heads, n_tokens, dim, dtype=torch.float64)

    # the reference: dense scores, each listed key raised by its bias (a key listed twice by one
    # unit cannot happen: randperm lists are distinct)
    seen = dense.isfinite().view(batch, heads, n_tokens, n_tokens)
    flat_index = torch.zeros(batch * heads, n_tokens, n_tokens, dtype=torch.long)  # bias position, for grads
    position = 0
    for unit in range(units.bh.numel()):
        row, start, end = int(units.bh[unit]), int(units.key_start[unit]), int(units.key_start[unit + 1])
        for query in units.query_tokens[units.query_start[unit] : units.query_start[unit + 1]].tolist():
            flat_index[row, query, units.key_tokens[start:end]] = torch.arange(start, end)
        position = end
    assert position == bias.numel()
    bias_dense = torch.where(seen, bias64[flat_index.view(batch, heads, n_tokens, n_tokens)], float("-inf"))
    scores = q @ k.transpose(-1, -2) / math.sqrt(dim) + bias_dense
    expected = torch.softmax(scores, -1) @ v

    q32, k32, v32, bias32 = (x.detach().float() for x in (q, k, v, bias64))
    y, lse = listed_cpu._forward(q32, k32, v32, bias32, units)
    torch.testing.assert_close(y.double(), expected, atol=2e-6, rtol=2e-5)
    got = listed_cpu._backward(target.float(), q32, k32, v32, y, lse, bias32, units)
    want = torch.autograd.grad((expected * target).sum(), (q, k, v, bias64))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-4)
    assert got[3].abs().sum() > 0


@needs_kernel
@pytest.mark.parametrize("dim", [64, 8])
def test_routing_kernel_causal_to_the_bit(dim):
    """Changing later tokens (their clusters too) leaves every earlier output and gradient bit
    for bit equal. After the change no later token joins an earlier cluster, so the tiles of
    queries that straddle the cut hold fewer queries than before."""
    torch.manual_seed(1)
    length, cut = 500, 233
    q, k, v = torch.randn(3, 2, 2, length, dim).unbind(0)
    clusters = torch.randint(0, 3, (2, 2, length))
    changed = [x.clone() for x in (q, k, v)]
    for x in changed:
        x[:, :, cut:] = torch.randn_like(x[:, :, cut:])
    changed_clusters = clusters.clone()
    changed_clusters[..., cut:] = torch.randint(3, 5, changed_clusters[..., cut:].shape)
    outputs, grads = [], []
    for inputs, ids in (((q, k, v), clusters), (changed, changed_clusters)):
        inputs = [x.clone().requires_grad_() for x in inputs]
        y = routed_attention_cpu(*inputs, ids, 16)[0]
        y[:, :, :cut].pow(2).sum().backward()
        outputs.append(y[:, :, :cut])
        grads.append([x.grad[:, :, :cut] for x in inputs])
    assert torch.equal(outputs[0], outputs[1])
    for before, after in zip(grads[0], grads[1]):
        assert torch.equal(before, after)


@needs_kernel
def test_sinkhorn_kernel_equals_the_reference_with_holes():
    """The kernel's bucket units against sinkhorn's reference: a partial last bucket, holes
    (buckets with fewer past buckets than n_sortcut), gradients into the sorting weights."""
    torch.manual_seed(2)
    batch, heads, length, size, dim, sortcut = 2, 3, 29, 4, 16, 2
    q, k, v = (torch.randn(batch, heads, length, dim).requires_grad_() for _ in range(3))
    means = [sinkhorn.bucket_means(x.detach(), size).requires_grad_() for x in (q, k)]
    chosen, weights = sinkhorn.sort_buckets(*means, sortcut, 3, 0.75, gumbel=False)
    assert (~weights.isfinite()).any()  # holes
    target = torch.randn(batch, heads, length, dim)
    results = []
    for kernel in (True, False):
        if kernel:
            y = bucket_attention_cpu(q, k, v, chosen, weights, size)[0]
        else:
            y = sinkhorn.bucket_attention(q, k, v, chosen, weights, size)
        results.append((y, torch.autograd.grad((y * target).sum(), (q, k, v, *means), retain_graph=True)))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_inference_equals_training_forward():
    torch.manual_seed(3)
    q, k, v = torch.randn(3, 1, 2, 100, 32).unbind(0)
    clusters = torch.randint(0, 4, (1, 2, 100))
    with torch.no_grad():
        inference = routed_attention_cpu(q, k, v, clusters, 8)[0]
    training = routed_attention_cpu(q.requires_grad_(), k, v, clusters, 8)[0]
    assert torch.equal(inference, training)


@needs_kernel
def test_custom_ops_pass_the_operator_checks():
    """Schema, fake (meta) implementation, autograd registration and dispatch, as torch.compile and
    FlopCounterMode rely on them (torch.library.opcheck)."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, 23, 8, requires_grad=True) for _ in range(3))
    clusters = torch.randint(0, 3, (1, 2, 23))
    torch.library.opcheck(routed_attention_cpu, (q, k, v, clusters, 4))
    means = [sinkhorn.bucket_means(x.detach(), 5) for x in (q, k)]
    chosen, weights = sinkhorn.sort_buckets(*means, 2, 3, 0.75, gumbel=False)
    torch.library.opcheck(bucket_attention_cpu, (q, k, v, chosen, weights.requires_grad_(), 5))


def test_a_failed_build_is_logged_once_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu, "_library", None)
    monkeypatch.setattr(cpu, "_failure", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level("WARNING", logger=cpu.__name__):
        assert cpu.library() is None
        assert cpu.library() is None  # remembered: no second attempt, no second message
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "CPU attention kernel unavailable" in caplog.records[0].message
    # the attention modules keep working on their reference paths
    torch.manual_seed(4)
    q, k, v = torch.randn(3, 1, 2, 30, 8).unbind(0)
    clusters = torch.randint(0, 3, (1, 2, 30))
    assert routing.routed_attention(q, k, v, clusters, 4).shape == q.shape
