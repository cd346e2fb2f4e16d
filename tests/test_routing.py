"""Routing attention: equal to the masked oracle, options honoured, centroids updated explicitly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from attnlab.attention import routing
from attnlab.attention.base import naive_attention
from attnlab.attention.kernels.listed_cpu import routed_attention_cpu
from attnlab.attention.routing import (
    RoutingAttention,
    cached_routed_attention,
    commitment_loss,
    routed_attention,
    routing_stats,
)
from attnlab.model import Transformer
from variants import variant_config


def oracle_mask(clusters: torch.Tensor, window: int) -> torch.Tensor:
    """[B, R, T] -> allowed [B, R, T, T]: same cluster, not later, at most `window` same-cluster
    tokens back."""
    same = clusters[..., :, None] == clusters[..., None, :]
    one_hot = F.one_hot(clusters).float()
    rank = (one_hot.cumsum(2) * one_hot).sum(-1)  # [B, R, T], 1-based rank within the cluster
    length = clusters.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return same & causal & (rank[..., :, None] - rank[..., None, :] <= window)


def attend(path: str, q, k, v, clusters, window: int):
    """Routed attention of a whole sequence on one path: the reference (torch) or the cpu back-end."""
    if path == "cpu":
        return routed_attention_cpu(q, k, v, clusters, window)[0]
    return routed_attention(q, k, v, clusters, window)


@pytest.mark.parametrize("window", [1, 3, 16])
def test_routed_attention_equals_oracle(window, cpu_path):
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 37, 8).unbind(0)
    clusters = torch.randint(0, 4, (2, 2, 37))
    expected = naive_attention(q, k, v, oracle_mask(clusters, window))
    torch.testing.assert_close(attend(cpu_path, q, k, v, clusters, window), expected, atol=1e-5, rtol=1e-5)
    # through a cache's storage (48 positions, the last 11 unfed and holding garbage): a chunk of the
    # last 9 tokens, and one decoded token at every length (clusters with fewer and more than W
    # earlier tokens)
    storage = [torch.cat((x, torch.randn(2, 2, 11, 8)), dim=2) for x in (k, v)]
    stored_clusters = torch.cat((clusters, torch.randint(0, 4, (2, 2, 11))), dim=2)
    positions = torch.arange(28, 37).expand(2, -1)
    cached = cached_routed_attention(q[:, :, -9:], *storage, stored_clusters, positions, window)
    torch.testing.assert_close(cached, expected[:, :, -9:], atol=1e-5, rtol=1e-5)
    for length in range(1, 38):
        one = cached_routed_attention(q[:, :, length - 1 : length], *storage, stored_clusters,
                                      torch.full((2, 1), length - 1), window)
        torch.testing.assert_close(one, expected[:, :, length - 1 : length], atol=1e-5, rtol=1e-5)


def test_routed_attention_equals_oracle_long_clusters(cpu_path):
    """Clusters much longer than the window, a row with few long clusters, chunks of queries."""
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 2, 3, 301, 8).unbind(0)
    clusters = torch.randint(0, 5, (2, 3, 301))
    clusters[1, 2] = torch.randint(0, 2, (301,))  # a row with few, long clusters
    expected = naive_attention(q, k, v, oracle_mask(clusters, 16))
    torch.testing.assert_close(attend(cpu_path, q, k, v, clusters, 16), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [256, 6])
def test_routed_attention_gradients_equal_oracle(chunk, monkeypatch, cpu_path):
    """Gradients equal the dense oracle's, whether the reference checkpoints one chunk of queries
    or several."""
    monkeypatch.setattr(routing, "QUERY_CHUNK", chunk)
    torch.manual_seed(4)
    inputs = [x.requires_grad_() for x in torch.randn(3, 2, 2, 53, 8).unbind(0)]
    clusters = torch.randint(0, 3, (2, 2, 53))
    target = torch.randn(2, 2, 53, 8)
    fused = torch.autograd.grad((attend(cpu_path, *inputs, clusters, 3) * target).sum(), inputs)
    dense = torch.autograd.grad((naive_attention(*inputs, oracle_mask(clusters, 3)) * target).sum(), inputs)
    for a, b in zip(fused, dense):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_commitment_loss_gradient_equals_autograd():
    torch.manual_seed(6)
    keys = torch.randn(2, 3, 17, 8, dtype=torch.float64, requires_grad=True)
    centroids = F.normalize(torch.randn(3, 4, 8, dtype=torch.float64), dim=-1)
    clusters = torch.randint(0, 4, (2, 3, 17))
    loss = commitment_loss(keys, centroids, clusters)
    chosen = centroids[torch.arange(3)[:, None], clusters]
    expected = (F.normalize(keys, dim=-1) - chosen).pow(2).sum(-1).mean()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(torch.autograd.grad(loss, keys)[0], torch.autograd.grad(expected, keys)[0])


def test_routed_attention_causal_to_the_bit_at_scale(monkeypatch, cpu_path):
    """Window 64 (the benchmark's), two threads, a length not a multiple of the window, chunks of
    100 queries: changing later tokens (their clusters too) must leave every earlier output bit for
    bit equal, forward and gradient."""
    monkeypatch.setattr(routing, "QUERY_CHUNK", 100)
    torch.manual_seed(2)
    length, cut = 700, 389
    q, k, v = torch.randn(3, 1, 2, length, 64).unbind(0)
    clusters = torch.randint(0, 6, (1, 2, length))
    changed = [x.clone() for x in (q, k, v)]
    for x in changed:
        x[:, :, cut:] = torch.randn_like(x[:, :, cut:])
    changed_clusters = clusters.clone()
    changed_clusters[..., cut:] = torch.randint(0, 9, changed_clusters[..., cut:].shape)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outputs, grads = [], []
        for inputs, ids in (((q, k, v), clusters), (changed, changed_clusters)):
            inputs = [x.clone().requires_grad_() for x in inputs]
            y = attend(cpu_path, *inputs, ids, 64)
            y[:, :, :cut].pow(2).sum().backward()
            outputs.append(y[:, :, :cut])
            grads.append([x.grad[:, :, :cut] for x in inputs])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1])
    for before, after in zip(grads[0], grads[1]):
        assert torch.equal(before, after)


def make(name: str = "routing", seed: int = 0, **routing) -> Transformer:
    config = variant_config(name)
    config.attention.routing = dataclasses.replace(config.attention.routing, **routing)
    torch.manual_seed(seed)
    return Transformer(config)


def routing_layers(model: Transformer) -> list[RoutingAttention]:
    return [m for m in model.modules() if isinstance(m, RoutingAttention)]


def logits(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x).logits


X = torch.randint(0, 61, (2, 45), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize(
    "option, value", [("window_size", 2), ("n_clusters", 2), ("n_local_heads", (0, 0))]
)
def test_options_change_outputs(option, value):
    base = logits(make(), X)
    assert not torch.allclose(logits(make(**{option: value}), X), base, atol=1e-5)


def train_step(model: Transformer, x: torch.Tensor) -> torch.Tensor:
    model.train()
    output = model(x[:, :-1], targets=x[:, 1:])
    output.loss.backward()
    return output.aux_losses["commitment"]


def test_commitment_weight_scales_the_loss():
    small = train_step(make(commitment_weight=0.1), X)
    large = train_step(make(commitment_weight=0.3), X)
    torch.testing.assert_close(large, 3 * small)
    assert small > 0


def test_ema_decay_moves_centroids_once_per_step():
    moved = {}
    for decay in (0.5, 0.9):
        model = make(ema_decay=decay)
        layer = routing_layers(model)[0]
        before = layer.centroids.clone()
        train_step(model, X)
        assert torch.equal(layer.centroids, before), "the forward must not move centroids"
        assert layer.centroid_counts.sum() == 2 * 44 * layer.n_routed  # every token, every routed head
        layer.update_centroids()
        assert layer.centroid_counts.sum() == 0
        assert torch.allclose(layer.centroids.norm(dim=-1), torch.ones(()))
        moved[decay] = (layer.centroids - before).norm()
        layer.after_optimizer_step()  # no new statistics: nothing moves
        assert (layer.centroids - before).norm() == moved[decay]
    assert moved[0.5] > moved[0.9] > 0


def test_eval_accumulates_nothing():
    model = make().eval()
    with torch.no_grad():
        model(X)
    assert all(layer.centroid_counts.sum() == 0 for layer in routing_layers(model))
    assert model(X).aux_losses == {}


def test_reversible_recomputation_counts_once():
    model = make("routing-reversible")
    train_step(model, X)
    for layer in routing_layers(model):
        assert layer.centroid_counts.sum() == 2 * 44 * layer.n_routed
    assert all(p.grad is not None for p in model.parameters())


def test_commitment_gradient_reaches_keys_through_reversible():
    grads = []
    for weight in (0.0, 10.0):
        model = make("routing-reversible", commitment_weight=weight)
        train_step(model, X)
        grads.append(routing_layers(model)[0].heads.to_k.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])


def test_routing_stats():
    model = make(n_clusters=4)
    stats = routing_stats(model, X)
    assert stats["no_routed_key_fraction"] == 0.0
    assert 0 < stats["only_itself_fraction"] < 1
    assert len(stats["cluster_occupancy"]) == 4
    assert abs(sum(stats["cluster_occupancy"]) - 1) < 1e-5
    assert 0 < stats["largest_cluster_share"] <= 1
    assert all(layer.last_clusters is None for layer in routing_layers(model))


def test_long_rollback_is_exact():
    model = make().eval()
    x = torch.randint(0, 61, (1, 60), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = model.new_cache(1, 64)
        model(x[:, :50], cache=cache)
        cache.truncate(10)  # back 40 tokens, further than any window
        resumed = model(x[:, 10:20], cache=cache).logits
        expected = model(x[:, :20]).logits[:, 10:]
    torch.testing.assert_close(resumed, expected, atol=1e-5, rtol=1e-5)
