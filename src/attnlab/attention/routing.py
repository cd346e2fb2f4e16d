"""Routing attention, exactly causal: each token attends to the last `window_size` earlier tokens
of its own k-means cluster, and to itself.

"Efficient Content-Based Sparse Attention with Routing Transformers" (Roy, Saffar, Vaswani,
Grangier, arXiv 2003.05997). Every token is assigned, on its own, to the nearest of `n_clusters`
centroids (spherical k-means, section 4.1) and attends to the most recent earlier tokens of its
cluster. Departures from the paper and from the public implementation, all deliberate:

- Clusters are not balanced top-k selections over the whole sequence (which makes an earlier
  token's keys depend on later tokens); a token's keys depend only on tokens at or before it, so
  the layer is causal bit for bit and prefix-consistent.
- A token's single routing vector is its normalised key before rotary positions, so its query side
  and key side share one cluster and it always sees at least itself (no token goes unattended).
- Centroids move by an exponential moving average (eq. 10) once per optimiser step, from statistics
  accumulated during the step's forwards (`after_optimizer_step`, called by the training loop);
  forwards that recompute a layer (reversible layers) accumulate nothing.
- With grouped key/value heads, keys and values are shared as usual; each query head routes on its
  group's key with its own centroids.

The reference path of a whole sequence (`routed_attention`): tokens are sorted stably by cluster, so each cluster is
one contiguous run in time order; a token's keys are then the W + 1 places of that order ending at
its own, those of its own cluster. Which places a token reads depends only on its rank within its
cluster (how many earlier tokens share it), a causal quantity, so its row of scores has the same
layout whatever the later tokens are: that is what keeps the layer causal to the bit. Memory is
O(T * W * D) per chunk of queries; in training each chunk is checkpointed, so the backward keeps
O(T * D).

Back-ends (kernels/__init__.py): `cpu`, the listed-key C++ kernel (kernels/listed_cpu.py: one unit
per cluster, keys read in place); `flex`, a FlexAttention band in sorted order
(kernels/flex_routing.py). Both serve whole sequences (training, and a prefill into an empty cache).
Decoding through the cache (`cached_routed_attention`) finds each query's W + 1 keys by a top-k of
positions over the static storage: the same shapes at every step; on the CPU the `cpu` back-end
finds them by a scan back from each query and reads them in place (kernels/decode_cpu.py's
routed_keys and listed_attention), elsewhere torch gathers them.

Legend: B batch, T queries, S keys (cached + new), H query heads, R routed heads, L local heads,
G key/value heads, D head width, C clusters, W window, K = W + 1 key slots (itself + W earlier).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from attnlab.attention.base import (
    Attention,
    AttentionSpec,
    KVCache,
    expand_kv,
    is_recomputing,
    new_lengths,
    select_rows,
    write_rows,
)
from attnlab.attention.kernels import check_backend, choose, choose_cached
from attnlab.attention.kernels.decode_cpu import listed_attention, routed_keys
from attnlab.attention.kernels.flex_routing import flex_routed_attention
from attnlab.attention.kernels.listed_cpu import routed_attention_cpu
from attnlab.attention.local import cached_window_attention, local_attention
from attnlab.config import RoutingAttentionConfig
from attnlab.errors import ConfigError
from attnlab.registry import ATTENTION

OFFERED = ("torch", "cpu", "flex")
QUERY_CHUNK = 256  # queries whose gathered keys live at once in the reference path

# ----------------------------------------------------------------------------------------------
# Pure functions


def nearest_centroids(routing: Tensor, centroids: Tensor) -> tuple[Tensor, Tensor]:
    """Nearest centroid by cosine similarity. routing [B, R, T, D] (unit norm), centroids [R, C, D]
    (unit norm) -> (the similarity to it [B, R, T], cluster ids [B, R, T] (long))."""
    similarity = torch.einsum("brtd,rcd->brtc", routing, centroids)  # [B, R, T, C]
    return similarity.max(dim=-1)


def assigned(per_centroid: Tensor, clusters: Tensor) -> Tensor:
    """per_centroid [R, C, *] at each token's cluster (clusters [B, R, T]) -> [B, R, T, *]."""
    heads = torch.arange(per_centroid.shape[0], device=clusters.device)[:, None]  # [R, 1]
    return per_centroid[heads, clusters]


class _Commitment(torch.autograd.Function):
    """Section 4.1's commitment loss, mean ||k / |k| - c||^2, from the similarity r . c that the
    assignment already computed (|r - c|^2 = |r|^2 + |c|^2 - 2 r . c, |r| = 1), keeping only the
    keys (which attention keeps anyway) and per-token numbers for the backward."""

    @staticmethod
    def forward(ctx, keys, centroids, clusters, similarity):
        squared_norms = assigned(centroids.pow(2).sum(-1), clusters)  # |c|^2 of each token's centroid
        loss = (1 + squared_norms - 2 * similarity).mean()
        ctx.save_for_backward(keys, centroids, clusters, similarity)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        keys, centroids, clusters, similarity = ctx.saved_tensors
        norm = keys.norm(dim=-1, keepdim=True).clamp(min=1e-12)  # as F.normalize
        # d/dr = 2 (r - c) / N; through k / |k| the part along r vanishes: (r - c) - (1 - r . c) r
        # = (r . c) r - c, with r = k / |k|
        scale = 2 * grad_loss / clusters.numel()
        grad_keys = (similarity[..., None] * (keys / norm) - assigned(centroids, clusters)) * (scale / norm)
        return grad_keys, None, None, None


def commitment_loss(keys: Tensor, centroids: Tensor, clusters: Tensor, similarity: Tensor | None = None) -> Tensor:
    """Mean squared distance of each routing vector (the normalised key [B, R, T, D]) to its fixed
    centroid (centroids [R, C, D], clusters [B, R, T]), section 4.1. similarity [B, R, T]: the
    routing vectors' cosine to their centroids, when already known."""
    if similarity is None:
        similarity = (F.normalize(keys.detach(), dim=-1) * assigned(centroids, clusters)).sum(-1)
    return _Commitment.apply(keys, centroids.detach().clone(), clusters, similarity)


def cluster_statistics(routing: Tensor, clusters: Tensor, n_clusters: int) -> tuple[Tensor, Tensor]:
    """Per-centroid sum of the assigned routing vectors [R, C, D] and their count [R, C]."""
    n_heads, width = routing.shape[1], routing.shape[-1]
    index = (clusters + torch.arange(n_heads, device=clusters.device)[:, None] * n_clusters).flatten()
    sums = routing.new_zeros(n_heads * n_clusters, width).index_add_(0, index, routing.reshape(-1, width))
    counts = routing.new_zeros(n_heads * n_clusters).index_add_(0, index, routing.new_ones(index.shape))
    return sums.view(n_heads, n_clusters, width), counts.view(n_heads, n_clusters)


def ema_centroids(centroids: Tensor, sums: Tensor, counts: Tensor, decay: float) -> Tensor:
    """Eq. 10: centroids move toward the mean of their assigned vectors, then back to the sphere.
    Centroids that received no vector stay where they are."""
    means = sums / counts.clamp(min=1)[..., None]
    moved = F.normalize(decay * centroids + (1 - decay) * means, dim=-1)
    return torch.where(counts[..., None] > 0, moved, centroids)


def routed_attention(q: Tensor, k: Tensor, v: Tensor, clusters: Tensor, window: int, dropout: float = 0.0) -> Tensor:
    """The reference path: each query sees itself and the last `window` earlier tokens of its cluster.

    q, k, v [B, R, T, D] (keys rotated), clusters [B, R, T] of a whole sequence -> [B, R, T, D]."""
    n_queries, n_keys = q.shape[2], k.shape[2]
    positions = torch.arange(n_queries, device=q.device).expand(q.shape[0], -1)  # [B, T]
    order = torch.sort(clusters, dim=-1, stable=True).indices  # [B, R, S]: each cluster a run, in time order
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n_keys, device=q.device).expand_as(order))
    layout = (order, rank, clusters.gather(-1, order))  # and each token's place in it, the sorted clusters
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    outputs = []
    for start in range(0, n_queries, QUERY_CHUNK):  # bounded memory: QUERY_CHUNK * K * D per head
        part = slice(start, start + QUERY_CHUNK)
        args = (q[:, :, part], k, v, clusters, *layout, positions[:, part], window, dropout)
        outputs.append(checkpoint(_routed_chunk, *args, use_reentrant=False) if needs_grad else _routed_chunk(*args))
    return torch.cat(outputs, dim=2)


def _routed_chunk(q, k, v, clusters, order, rank, sorted_clusters, positions, window: int, dropout: float) -> Tensor:
    """Routed attention of a chunk of queries q [B, R, t, D] at positions [B, t] (see routed_attention)."""
    query_positions = positions[:, None, :].expand(-1, clusters.shape[1], -1)  # [B, R, t]
    places = rank.gather(-1, query_positions)[..., None] - torch.arange(window + 1, device=q.device)  # [B, R, t, K]
    safe = places.clamp(min=0).flatten(-2)  # [B, R, t K]
    own = clusters.gather(-1, query_positions)[..., None]
    allowed = (places >= 0) & (sorted_clusters.gather(-1, safe).view_as(places) == own)
    index = order.gather(-1, safe).view_as(places)  # [B, R, t, K]: the key position at each place
    keys, values = select_rows(k, index), select_rows(v, index)  # [B, R, t, K, D]
    scores = torch.einsum("brtd,brtkd->brtk", q, keys).float() / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).to(values.dtype)
    probs = F.dropout(probs, dropout) if dropout else probs
    return torch.einsum("brtk,brtkd->brtd", probs, values)


def routed_key_positions(clusters: Tensor, positions: Tensor, window: int) -> Tensor:
    """The keys of queries at positions [B, T] (each row's own) in a cache's storage of clusters
    [B, R, L]: the last W + 1 positions of each query's cluster at or before it, found by a top-k of
    their positions (fixed shapes whatever the position: a decode step compiles once; positions past
    a row's length are later than its queries, so never among them). -> [B, R, T, K] (-1: none)."""
    query_positions = positions[:, None, :].expand(-1, clusters.shape[1], -1)  # [B, R, T]
    own = clusters.gather(-1, query_positions)  # [B, R, T]
    key_positions = torch.arange(clusters.shape[2], device=clusters.device)
    same = (clusters[:, :, None, :] == own[..., None]) & (key_positions <= query_positions[..., None])  # [B, R, T, L]
    return torch.where(same, key_positions, -1).topk(min(window + 1, clusters.shape[2]), dim=-1).values


def cached_routed_attention(q: Tensor, keys: Tensor, values: Tensor, clusters: Tensor, positions: Tensor,
                            window: int, backend: str = "torch") -> Tensor:
    """Queries q [B, R, T, D] at positions [B, T] (each row's own) over a cache's storage keys, values
    [B, R, L, D] and clusters [B, R, L]: each attends to its routed_key_positions. backend: torch
    finds them by a top-k and gathers them; cpu finds them by a scan back from each query
    (kernels/decode_cpu.py's routed_keys: the same keys) and reads them in place (its
    listed_attention, each key a block of one), the same result up to rounding."""
    if backend == "cpu":  # the keys found by a scan back from each query, read in place
        picked = routed_keys(clusters, positions, min(window + 1, clusters.shape[2]))  # [B, R, T, K]
        no_bias = torch.zeros(picked.shape, device=q.device)  # a start of -1 lies outside the storage: hidden
        return listed_attention(q, keys, values, picked, no_bias, 1, positions)
    picked = routed_key_positions(clusters, positions, window)  # [B, R, T, K]
    index = picked.clamp(min=0)
    chosen_keys, chosen_values = select_rows(keys, index), select_rows(values, index)  # [B, R, T, K, D]
    scores = torch.einsum("brtd,brtkd->brtk", q, chosen_keys.to(q.dtype)).float() / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(picked < 0, float("-inf")), dim=-1).to(q.dtype)
    return torch.einsum("brtk,brtkd->brtd", probs, chosen_values.to(q.dtype))


def local_heads_of_layer(n_local_heads: int | tuple[int, ...], layer_index: int) -> int:
    """The seeds' `n_local_attn_heads`: one int for every layer, or one value per layer."""
    if isinstance(n_local_heads, int):
        return n_local_heads
    if layer_index >= len(n_local_heads):
        raise ValueError(f"n_local_heads has {len(n_local_heads)} values; layer {layer_index} needs one")
    return n_local_heads[layer_index]


# ----------------------------------------------------------------------------------------------
# Cache and module


class RoutingCache(KVCache):
    """Keys, values (per query head) and routed-head clusters of every fed position, [B, H, L, D] and
    [B, R, L]. Keeping every position (rather than only the last window of each cluster) makes any
    rollback exact, and costs no more than the per-cluster windows would with the default
    n_clusters = max_seq_len / window (C windows of W hold max_seq_len tokens)."""

    def __init__(self, lengths: Tensor, max_len: int, n_heads: int, n_routed: int, dim_head: int, dtype) -> None:
        super().__init__(lengths, max_len)
        batch, device = lengths.shape[0], lengths.device
        self.keys = torch.zeros(batch, n_heads, max_len, dim_head, device=device, dtype=dtype)
        self.values = torch.zeros_like(self.keys)
        self.clusters = torch.zeros(batch, n_routed, max_len, device=device, dtype=torch.long)

    def append(self, k: Tensor, v: Tensor, clusters: Tensor, positions: Tensor) -> None:
        """Store k, v [B, H, T, D] and clusters [B, R, T] at positions [B, T]."""
        for store, new in ((self.keys, k), (self.values, v), (self.clusters, clusters)):
            write_rows(store, new, positions)


@ATTENTION.register("routing")
class RoutingAttention(Attention):
    """L local heads (sliding window) then R = H - L routed heads, as configured for this layer."""

    config_class = RoutingAttentionConfig
    legacy_keys = {f"{name}.weight": f"heads.{name}.weight" for name in ("to_q", "to_k", "to_v", "to_out")}

    @staticmethod
    def keys_per_query(config: RoutingAttentionConfig, seq_len: int, n_heads: int, layer_index: int) -> float:
        """Local heads their window, routed heads itself and the last window of its cluster."""
        n_local = local_heads_of_layer(config.n_local_heads, layer_index)
        local_keys, routed_keys = min(config.window_size, seq_len), min(config.window_size + 1, seq_len)
        return (n_local * local_keys + (n_heads - n_local) * routed_keys) / n_heads

    def __init__(self, spec: AttentionSpec, config: RoutingAttentionConfig) -> None:
        super().__init__(spec, config)
        check_backend("routing", config.backend, OFFERED)
        self.n_local = local_heads_of_layer(config.n_local_heads, spec.layer_index)
        if not 0 <= self.n_local <= spec.n_heads:
            raise ValueError(f"n_local_heads={self.n_local} must be between 0 and heads={spec.n_heads}")
        self.n_routed = spec.n_heads - self.n_local
        self.n_clusters = config.n_clusters or max(1, spec.max_seq_len // config.window_size)
        centroids = F.normalize(torch.randn(self.n_routed, self.n_clusters, spec.dim_head), dim=-1)
        self.register_buffer("centroids", centroids)  # [R, C, D], unit norm
        # statistics of this optimiser step's forwards, consumed by after_optimizer_step()
        self.register_buffer("centroid_sums", torch.zeros_like(centroids), persistent=False)
        self.register_buffer("centroid_counts", torch.zeros(self.n_routed, self.n_clusters), persistent=False)
        self.record_statistics = False  # routing_stats() turns this on to read `last_clusters`
        self.last_clusters: Tensor | None = None
        if config.backend == "flex" and spec.dropout > 0:
            raise ConfigError("attention.routing.backend=flex has no attention dropout; set model.attention.dropout=0")

    def forward(self, x: Tensor, cache: RoutingCache | None = None) -> Tensor:
        spec, window = self.spec, self.config.window_size
        dropout = spec.dropout if self.training else 0.0
        q, k, v = self.heads.project(x)  # q [B, H, T, D], k v [B, G, T, D]
        k, v = expand_kv(k, spec.n_heads), expand_kv(v, spec.n_heads)  # [B, H, T, D]
        clusters = self._route(k[:, self.n_local :])  # [B, R, T]
        positions = 0 if cache is None else cache.positions(x.shape[1])  # [B, T] through a cache
        q, k = self.heads.rotate(q, k, positions)
        local, routed = slice(None, self.n_local), slice(self.n_local, None)
        if cache is not None:
            cache.append(k, v, clusters, positions)
            if not cache.prefill:  # a chunk after earlier tokens: read them from the storage
                backend = choose_cached(self.config.backend, OFFERED, q, cache.keys, dropout)
                parts = [cached_window_attention(q[:, local], cache.keys[:, local], cache.values[:, local], positions,
                                                 window, backend)] if self.n_local else []
                if self.n_routed:
                    parts.append(cached_routed_attention(q[:, routed], cache.keys[:, routed], cache.values[:, routed],
                                                         cache.clusters, positions, window, backend))
                return self.heads.merge(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
        parts = []  # a whole sequence (training, or a prefill into an empty cache)
        if self.n_local:
            parts.append(local_attention(q[:, local], k[:, local], v[:, local], window, dropout))
        if self.n_routed:
            parts.append(self._routed(q[:, routed], k[:, routed], v[:, routed], clusters, dropout))
        y = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [B, H, T, D]
        return self.heads.merge(y)

    def _route(self, keys: Tensor) -> Tensor:
        """Routed heads' keys [B, R, T, D] before rotary -> their clusters [B, R, T]; in training also
        the commitment loss and this step's centroid statistics."""
        with torch.no_grad():  # the gradient reaches the keys through the commitment loss only
            # routed in float32 whatever the model's dtype (a model cast to bfloat16 for decoding)
            routing = F.normalize(keys.float(), dim=-1)  # [B, R, T, D]
            similarity, clusters = nearest_centroids(routing, self.centroids.float())  # [B, R, T]
        self.aux_losses = {}
        if self.training and self.n_routed:
            loss = commitment_loss(keys.float(), self.centroids.float(), clusters, similarity)
            self.aux_losses = {"commitment": self.config.commitment_weight * loss}
            if not is_recomputing():  # a recomputed forward must not count twice
                with torch.no_grad():
                    sums, counts = cluster_statistics(routing, clusters, self.n_clusters)
                    self.centroid_sums += sums
                    self.centroid_counts += counts
        if self.record_statistics:
            self.last_clusters = clusters
        return clusters

    def _routed(self, q, k, v, clusters, dropout: float) -> Tensor:
        """Routed heads of a whole sequence q, k, v [B, R, T, D] -> [B, R, T, D] on the chosen back-end."""
        backend = choose(self.config.backend, OFFERED, q, True, dropout)
        if backend == "cpu":
            return routed_attention_cpu(q, k, v, clusters, self.config.window_size)[0]
        if backend == "flex":
            return flex_routed_attention(q, k, v, clusters, self.config.window_size)
        return routed_attention(q, k, v, clusters, self.config.window_size, dropout)

    @torch.no_grad()
    def update_centroids(self) -> None:
        """One EMA step from the statistics accumulated since the last call (then cleared)."""
        if not self.n_routed:
            return
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(self.centroid_sums)  # every rank moves centroids alike
            torch.distributed.all_reduce(self.centroid_counts)
        self.centroids.copy_(
            ema_centroids(self.centroids, self.centroid_sums, self.centroid_counts, self.config.ema_decay)
        )
        self.centroid_sums.zero_()
        self.centroid_counts.zero_()

    def after_optimizer_step(self) -> None:
        """Called once per optimiser step by the training loop (train/loop.py)."""
        self.update_centroids()

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None,
                  lengths: Tensor | None = None) -> RoutingCache:
        lengths = new_lengths(batch, device) if lengths is None else lengths
        self.heads.reserve(max_len, lengths.device)
        return RoutingCache(lengths, max_len, self.spec.n_heads, self.n_routed, self.spec.dim_head, dtype)


# ----------------------------------------------------------------------------------------------
# Evaluation statistics


@torch.no_grad()
def routing_stats(model: nn.Module, tokens: Tensor) -> dict[str, float | list[float]]:
    """Run `model` on tokens [B, T] in eval mode and report, over every routed head of every layer:
    `no_routed_key_fraction` (tokens that see no routed key; 0 by construction, since a token
    sees itself), `only_itself_fraction` (tokens with no earlier token in their cluster),
    `cluster_occupancy` (share of tokens per cluster, averaged over heads, sorted
    descending), `clusters_used_fraction` and `largest_cluster_share`."""
    layers = [module for module in model.modules() if isinstance(module, RoutingAttention) and module.n_routed]
    if not layers:
        return {}
    was_training = model.training
    model.eval()
    for layer in layers:
        layer.record_statistics = True
    try:
        model(tokens)
    finally:
        for layer in layers:
            layer.record_statistics = False
        model.train(was_training)
    shares, n_without_key, n_alone, n_routed_tokens = [], 0, 0, 0
    for layer in layers:
        clusters = layer.last_clusters  # [B, R, T]
        layer.last_clusters = None
        one_hot = F.one_hot(clusters, layer.n_clusters)  # [B, R, T, C]
        earlier = (one_hot.cumsum(dim=2) * one_hot).sum(-1) - 1  # same-cluster tokens before each
        n_keys = 1 + earlier.clamp(max=layer.config.window_size)  # itself + up to W earlier
        n_without_key += int((n_keys == 0).sum())
        n_alone += int((earlier == 0).sum())
        n_routed_tokens += clusters.numel()
        counts = one_hot.sum(dim=2).float()  # [B, R, C]
        share = counts / counts.sum(-1, keepdim=True)
        shares.append(share.sort(dim=-1, descending=True).values.mean(dim=(0, 1)))  # [C]
    width = max(share.shape[0] for share in shares)
    occupancy = torch.stack([F.pad(share, (0, width - share.shape[0])) for share in shares]).mean(0)
    return {
        "no_routed_key_fraction": n_without_key / max(n_routed_tokens, 1),
        "only_itself_fraction": n_alone / max(n_routed_tokens, 1),
        "cluster_occupancy": occupancy.tolist(),
        "clusters_used_fraction": float((occupancy > 0).float().mean()),
        "largest_cluster_share": float(occupancy[0]),
    }

