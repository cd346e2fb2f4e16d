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
  forwards that recompute a reversible layer accumulate nothing.
- With grouped key/value heads, keys and values are shared as usual; each query head routes on its
  group's key with its own centroids.

How it runs in O(T * window) memory: per routed head, tokens are sorted stably by cluster, so each
cluster is one contiguous run in time order, and every cluster is padded to whole blocks of W
slots. Each block then attends to itself and the block before it, exactly like local attention
(one fused SDPA call over all blocks, band mask). A token's place in its block and the places of
its W predecessors depend only on its rank within its cluster, so its row of scores has the same
layout whatever the later tokens are: that is what makes causality exact to the bit. Padding costs
at most one block per cluster (T + C W slots). Decoding gathers each query's W + 1 slots instead.

Legend: B batch, T queries, S keys (cached + new), H query heads, R routed heads, L local heads,
G key/value heads, D head width, C clusters, W window, K = W + 1 key slots (itself + W earlier),
P slots of the block layout, N = P / W blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from attnlab.attention.base import AttentionSpec, KVCache, expand_kv
from attnlab.attention.gathered import gathered_attention
from attnlab.attention.local import local_attention
from attnlab.config import RoutingAttentionConfig
from attnlab.model.reversible import is_recomputing
from attnlab.registry import ATTENTION

# ----------------------------------------------------------------------------------------------
# Pure functions


def assign_clusters(routing: Tensor, centroids: Tensor) -> Tensor:
    """Nearest centroid by cosine similarity. routing [B, R, T, D] (unit norm), centroids [R, C, D]
    (unit norm) -> cluster ids [B, R, T] (long)."""
    similarity = torch.einsum("brtd,rcd->brtc", routing, centroids)  # [B, R, T, C]
    return similarity.argmax(dim=-1)


def commitment_loss(routing: Tensor, centroids: Tensor, clusters: Tensor) -> Tensor:
    """Mean squared distance of each routing vector to its (fixed) centroid, section 4.1."""
    heads = torch.arange(centroids.shape[0], device=routing.device)[:, None]  # [R, 1]
    chosen = centroids.detach()[heads, clusters]  # [B, R, T, D]
    return (routing - chosen).pow(2).sum(-1).mean()


def cluster_statistics(routing: Tensor, clusters: Tensor, n_clusters: int) -> tuple[Tensor, Tensor]:
    """Per-centroid sum of the assigned routing vectors [R, C, D] and their count [R, C]."""
    one_hot = F.one_hot(clusters, n_clusters).to(routing.dtype)  # [B, R, T, C]
    return torch.einsum("brtc,brtd->rcd", one_hot, routing), one_hot.sum(dim=(0, 2))


def ema_centroids(centroids: Tensor, sums: Tensor, counts: Tensor, decay: float) -> Tensor:
    """Eq. 10: centroids move toward the mean of their assigned vectors, then back to the sphere.
    Centroids that received no vector stay where they are."""
    means = sums / counts.clamp(min=1)[..., None]
    moved = F.normalize(decay * centroids + (1 - decay) * means, dim=-1)
    return torch.where(counts[..., None] > 0, moved, centroids)


def cluster_block_layout(clusters: Tensor, window: int) -> tuple[Tensor, Tensor, Tensor]:
    """The cluster-aligned block layout that routed attention is computed on.

    clusters [B, R, T] -> destination [B, R, T] (the slot of each token), source [B, R, P] (the
    token in each slot; padding slots hold token 0, never visible to a real token) and
    opens_cluster bool [B, R, N] (the block is its cluster's first), with P = N W slots.

    Tokens are grouped by cluster in time order (a stable sort); each cluster starts on a block
    boundary and is padded to whole blocks of W slots. So a token's slot within its block, and the
    slots of its W predecessors, depend only on its rank within its cluster (how many earlier tokens
    share it), a causal quantity: its row of scores has the same layout whatever the later tokens
    are, which is what keeps the layer causal to the bit although blocks are computed together.
    """
    n_tokens, device = clusters.shape[-1], clusters.device
    n_clusters = int(clusters.max()) + 1
    counts = torch.zeros(*clusters.shape[:-1], n_clusters, dtype=torch.long, device=device)
    counts.scatter_add_(-1, clusters, torch.ones_like(clusters))  # [B, R, C]
    starts = counts.cumsum(-1) - counts  # first sorted row of each cluster
    padded = (counts + window - 1) // window * window  # whole blocks per cluster
    padded_starts = padded.cumsum(-1) - padded  # first slot of each cluster, a block boundary
    order = torch.sort(clusters, dim=-1, stable=True).indices  # [B, R, T]; stable: time order kept
    sorted_clusters = clusters.gather(-1, order)
    rank = torch.arange(n_tokens, device=device) - starts.gather(-1, sorted_clusters)  # within the cluster
    sorted_destination = padded_starts.gather(-1, sorted_clusters) + rank
    destination = torch.empty_like(order).scatter_(-1, order, sorted_destination)  # [B, R, T]
    n_blocks = int(padded.sum(-1).max()) // window
    source = torch.zeros(*clusters.shape[:-1], n_blocks * window, dtype=torch.long, device=device)
    source.scatter_(-1, sorted_destination, order)  # [B, R, P]
    opens_cluster = torch.zeros(*clusters.shape[:-1], n_blocks + 1, dtype=torch.bool, device=device)
    opens_cluster.scatter_(-1, padded_starts // window, True)  # an empty cluster marks the next start
    return destination, source, opens_cluster[..., :n_blocks]


def routed_attention(q: Tensor, k: Tensor, v: Tensor, clusters: Tensor, window: int, dropout: float = 0.0) -> Tensor:
    """Parallel routed attention over a whole sequence. q, k, v [B, R, T, D], clusters [B, R, T]
    -> [B, R, T, D]; token t sees itself and the last `window` earlier tokens of its cluster.

    Computed like local attention, on the cluster-aligned layout of `cluster_block_layout`: each
    block of W slots attends to itself and the block before it through a band mask (slot i sees
    itself and the W slots before it), the previous block hidden when the block opens its cluster.
    Padding slots come after every real token of their cluster, so the band hides them from real
    tokens. Memory O(T W) per head, and only O(T D) is kept for the backward (attention/gathered.py).
    """
    batch, n_heads = q.shape[:2]
    destination, source, opens_cluster = cluster_block_layout(clusters, window)
    n_blocks = opens_cluster.shape[-1]
    blocks = source.view(batch, n_heads, n_blocks, window)  # [B, R, N, W]: the token in each slot
    previous = torch.cat((blocks[:, :, :1], blocks[:, :, :-1]), dim=2)  # block 0 opens a cluster: hidden
    key_index = torch.cat((previous, blocks), dim=-1)  # [B, R, N, 2W]: the block before, then its own

    def make_mask(chunk: slice) -> Tensor:  # [B, R, n, W, 2W] for the blocks in chunk
        slot = torch.arange(window, device=q.device)[:, None]  # query slot i is key column W + i
        column = torch.arange(2 * window, device=q.device)[None, :]
        band = (column >= slot) & (column <= slot + window)  # [W, 2W]: itself and the W slots before
        return band & ~(opens_cluster[:, :, chunk, None, None] & (column < window))

    return gathered_attention(q, k, v, blocks, key_index, destination, make_mask, dropout=dropout)  # [B, R, T, D]


def routed_attention_cached(
    q: Tensor, k: Tensor, v: Tensor, clusters: Tensor, window: int, block: int = 256
) -> Tensor:
    """Routed attention for the last T of S tokens, keys gathered per query (decoding, no grad).
    q [B, R, T, D], k v [B, R, S, D], clusters [B, R, S] -> [B, R, T, D]. Same slots as above."""
    n_queries, n_keys, dim_head = q.shape[2], k.shape[2], q.shape[3]
    order = torch.sort(clusters, dim=-1, stable=True).indices  # [B, R, S]
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n_keys, device=q.device).expand_as(order))
    sorted_clusters = clusters.gather(-1, order)
    outputs = []
    for start in range(0, n_queries, block):  # bounded memory for long chunks: block * K * D
        end = min(start + block, n_queries)
        rows = rank[..., n_keys - n_queries + start : n_keys - n_queries + end]  # [B, R, t]
        slots = rows[..., None] - torch.arange(window + 1, device=q.device)  # [B, R, t, K]
        safe = slots.clamp(min=0).flatten(-2)  # [B, R, t K]
        own = clusters[..., n_keys - n_queries + start : n_keys - n_queries + end, None]
        allowed = (slots >= 0) & (sorted_clusters.gather(-1, safe).view_as(slots) == own)
        positions = order.gather(-1, safe)[..., None].expand(-1, -1, -1, dim_head)
        keys = k.gather(2, positions).unflatten(2, slots.shape[2:])  # [B, R, t, K, D]
        values = v.gather(2, positions).unflatten(2, slots.shape[2:])
        scores = torch.einsum("brtd,brtkd->brtk", q[:, :, start:end], keys).float() / math.sqrt(dim_head)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).to(values.dtype)
        outputs.append(torch.einsum("brtk,brtkd->brtd", probs, values))
    return torch.cat(outputs, dim=2)


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
    """Keys, values (per query head) and routed-head clusters of every fed position, preallocated.

    Deliberate choice: keeping every position (rather than only the last window of each cluster)
    makes truncate() exact for any length, and costs no more than the per-cluster windows would
    with the default n_clusters = max_seq_len / window (C windows of W hold max_seq_len tokens).
    """

    def __init__(self, batch: int, n_heads: int, n_routed: int, dim_head: int, max_len: int, device, dtype) -> None:
        self.keys = torch.zeros(batch, n_heads, max_len, dim_head, device=device, dtype=dtype)
        self.values = torch.zeros_like(self.keys)
        self.clusters = torch.zeros(batch, n_routed, max_len, device=device, dtype=torch.long)
        self.length = 0

    def append(self, k: Tensor, v: Tensor, clusters: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store k, v [B, H, T, D], clusters [B, R, T]; return everything so far (length S)."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"cache holds {self.keys.shape[2]} tokens; {end} were fed")
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        self.clusters[:, :, start:end] = clusters
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end], self.clusters[:, :, :end]

    def truncate(self, length: int) -> None:
        self._check_truncate(length)
        self.length = length  # later slots are overwritten by the next append


@ATTENTION.register("routing")
class RoutingAttention(nn.Module):
    """L local heads (sliding window) then R = H - L routed heads, as configured for this layer."""

    config_class = RoutingAttentionConfig

    def __init__(self, spec: AttentionSpec, config: RoutingAttentionConfig) -> None:
        super().__init__()
        self.spec, self.config = spec, config
        self.n_local = local_heads_of_layer(config.n_local_heads, spec.layer_index)
        if not 0 <= self.n_local <= spec.n_heads:
            raise ValueError(f"n_local_heads={self.n_local} must be between 0 and heads={spec.n_heads}")
        self.n_routed = spec.n_heads - self.n_local
        self.n_clusters = config.n_clusters or max(1, spec.max_seq_len // config.window_size)
        inner_q, inner_kv = spec.n_heads * spec.dim_head, spec.n_kv_heads * spec.dim_head
        self.to_q = nn.Linear(spec.dim, inner_q, bias=False)
        self.to_k = nn.Linear(spec.dim, inner_kv, bias=False)
        self.to_v = nn.Linear(spec.dim, inner_kv, bias=False)
        self.to_out = nn.Linear(inner_q, spec.dim, bias=False)
        centroids = F.normalize(torch.randn(self.n_routed, self.n_clusters, spec.dim_head), dim=-1)
        self.register_buffer("centroids", centroids)  # [R, C, D], unit norm
        # statistics of this optimiser step's forwards, consumed by after_optimizer_step()
        self.register_buffer("centroid_sums", torch.zeros_like(centroids), persistent=False)
        self.register_buffer("centroid_counts", torch.zeros(self.n_routed, self.n_clusters), persistent=False)
        self.aux_losses: dict[str, Tensor] = {}
        self.record_statistics = False  # routing_stats() turns this on to read `last_clusters`
        self.last_clusters: Tensor | None = None

    def forward(self, x: Tensor, cache: RoutingCache | None = None) -> Tensor:
        spec, window = self.spec, self.config.window_size
        dropout = spec.dropout if self.training else 0.0
        offset = 0 if cache is None else cache.length
        q = rearrange(self.to_q(x), "b t (h d) -> b h t d", d=spec.dim_head)  # [B, H, T, D]
        k = expand_kv(rearrange(self.to_k(x), "b t (g d) -> b g t d", d=spec.dim_head), spec.n_heads)
        v = expand_kv(rearrange(self.to_v(x), "b t (g d) -> b g t d", d=spec.dim_head), spec.n_heads)
        # route on keys before rotary positions: content, not position, picks the cluster
        routing = F.normalize(k[:, self.n_local :].float(), dim=-1)  # [B, R, T, D]
        clusters = assign_clusters(routing, self.centroids)  # [B, R, T]
        self.aux_losses = {}
        if self.training and self.n_routed:
            weight = self.config.commitment_weight
            self.aux_losses = {"commitment": weight * commitment_loss(routing, self.centroids, clusters)}
            if not is_recomputing():  # a reversible layer's recomputation must not count twice
                with torch.no_grad():
                    sums, counts = cluster_statistics(routing, clusters, self.n_clusters)
                    self.centroid_sums += sums
                    self.centroid_counts += counts
        if self.record_statistics:
            self.last_clusters = clusters
        if spec.rotary is not None:
            q, k = spec.rotary(q, offset), spec.rotary(k, offset)
        if cache is not None:
            k, v, clusters = cache.append(k, v, clusters)  # [B, H, S, D], clusters [B, R, S]
            k, v = k.to(q.dtype), v.to(q.dtype)
        local, routed = self.n_local, slice(self.n_local, None)
        parts = []
        if self.n_local:
            parts.append(local_attention(q[:, :local], k[:, :local], v[:, :local], window, dropout))
        if self.n_routed:
            if cache is None:
                parts.append(routed_attention(q[:, routed], k[:, routed], v[:, routed], clusters, window, dropout))
            else:
                parts.append(routed_attention_cached(q[:, routed], k[:, routed], v[:, routed], clusters, window))
        y = torch.cat(parts, dim=1)  # [B, H, T, D]
        return self.to_out(rearrange(y, "b h t d -> b t (h d)"))

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

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> RoutingCache:
        spec = self.spec
        return RoutingCache(batch, spec.n_heads, self.n_routed, spec.dim_head, max_len, device, dtype)


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

