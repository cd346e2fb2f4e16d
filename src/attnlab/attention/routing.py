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
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from attnlab.attention.base import AttentionSpec, KVCache, expand_kv
from attnlab.attention.gathered import additive_mask, autocast_inputs, block_chunks, pick_rows
from attnlab.attention.kernels.flex_routing import flex_routed_attention
from attnlab.attention.local import local_attention
from attnlab.config import RoutingAttentionConfig
from attnlab.errors import ConfigError
from attnlab.model.reversible import is_recomputing
from attnlab.registry import ATTENTION

# ----------------------------------------------------------------------------------------------
# Pure functions


def assign_clusters(routing: Tensor, centroids: Tensor) -> Tensor:
    """Nearest centroid by cosine similarity. routing [B, R, T, D] (unit norm), centroids [R, C, D]
    (unit norm) -> cluster ids [B, R, T] (long)."""
    similarity = torch.einsum("brtd,rcd->brtc", routing, centroids)  # [B, R, T, C]
    return similarity.argmax(dim=-1)


class _Commitment(torch.autograd.Function):
    """Section 4.1's commitment loss, mean ||k / |k| - c||^2, keeping only the keys for the backward
    (autograd would also keep the normalised keys and their difference to the centroids)."""

    @staticmethod
    def forward(ctx, keys, centroids, clusters):
        routing = F.normalize(keys, dim=-1)  # [B, R, T, D]
        heads = torch.arange(centroids.shape[0], device=keys.device)[:, None]  # [R, 1]
        loss = (routing - centroids[heads, clusters]).pow(2).sum(-1).mean()
        ctx.save_for_backward(keys, centroids, clusters)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        keys, centroids, clusters = ctx.saved_tensors
        norm = keys.norm(dim=-1, keepdim=True).clamp(min=1e-12)  # as F.normalize
        routing = keys / norm
        heads = torch.arange(centroids.shape[0], device=keys.device)[:, None]
        grad_routing = (routing - centroids[heads, clusters]) * (2 * grad_loss / clusters.numel())
        # through k / |k|: the part of the gradient along the routing vector vanishes
        grad_keys = (grad_routing - (grad_routing * routing).sum(-1, keepdim=True) * routing) / norm
        return grad_keys, None, None


def commitment_loss(keys: Tensor, centroids: Tensor, clusters: Tensor) -> Tensor:
    """Mean squared distance of each routing vector (the normalised key [B, R, T, D]) to its fixed
    centroid (centroids [R, C, D], clusters [B, R, T]), section 4.1."""
    return _Commitment.apply(keys, centroids.detach().clone(), clusters)


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


CHUNK_SLOTS = 1024  # query slots per head computed at once: bounds the transient mask and gathers


def _band_masks(window: int, dtype: torch.dtype, device) -> tuple[Tensor, Tensor]:
    """Additive masks [W, 2W] of a block's queries over the block before it and its own: slot i sees
    itself and the W slots before it; in a block that opens its cluster, none of the block before."""
    slot = torch.arange(window, device=device)[:, None]  # query slot i is key column W + i
    column = torch.arange(2 * window, device=device)[None, :]
    band = (column >= slot) & (column <= slot + window)  # [W, 2W]
    opening = band & (column >= window)

    return additive_mask(band, dtype), additive_mask(opening, dtype)


def _chunks(n_blocks: int, window: int) -> list[slice]:
    return block_chunks(n_blocks, window, CHUNK_SLOTS)


def _windows(x: Tensor, window: int) -> Tensor:
    """Keys of every block, each its previous block then its own: an overlapping view
    [B R, n, 2W, D] of x [B R, (n+1) W, D], no copy."""
    return x.unfold(1, 2 * window, window).transpose(-1, -2)


class _BandedRoutedAttention(torch.autograd.Function):
    """Forward on the fused kernel; keeps only q, k, v, y and the log-sum-exp (what torch keeps for
    full attention), and gathers the layout again in the backward. Both run a few blocks at a time
    (`CHUNK_SLOTS`), writing straight to time order, so the transient copies stay small. Keys come
    in before their rotary positions (`rotary`: keys -> rotated keys, or None) and are rotated here,
    so that the one copy kept serves the commitment loss too."""

    @staticmethod
    def forward(ctx, q, k, v, slot_source, destination, opens_cluster, window, rotary):
        batch, n_heads, n_tokens, dim_head = q.shape
        rotated = k if rotary is None else rotary(k)
        slots = slot_source[..., window:]  # [B, R, P]: the token in each slot
        real = destination.gather(-1, slots) == torch.arange(slots.shape[-1], device=q.device)  # not padding
        band, opening = _band_masks(window, q.dtype, q.device)
        opens = opens_cluster.flatten(0, 1)[..., None, None]  # [B R, N, 1, 1]
        # y laid out [B, T, R, D] as torch's fused attention lays out its output: merging the heads for
        # the output projection is then a view (autograd keeps one copy); row T takes padding slots
        y = q.new_empty(batch, n_tokens + 1, n_heads, dim_head).transpose(1, 2)  # [B, R, T+1, D]
        logsumexps = []
        for chunk in _chunks(opens_cluster.shape[-1], window):
            queries, keys, values, query_index = _chunk_tensors(q, rotated, v, slot_source, chunk, window)
            out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                queries, keys, values, 0.0, False, attn_mask=torch.where(opens[:, chunk], opening, band),
            )
            target = query_index.masked_fill(~real[..., chunk.start * window : chunk.stop * window], n_tokens)
            y.scatter_(2, target[..., None].expand(-1, -1, -1, dim_head), out.reshape(batch, n_heads, -1, dim_head))
            logsumexps.append(logsumexp)
        y = y[:, :, :n_tokens]  # [B, R, T, D]
        ctx.save_for_backward(q, k, v, slot_source, real, opens_cluster, y, torch.cat(logsumexps, dim=1))
        ctx.window, ctx.rotary = window, rotary
        return y

    @staticmethod
    def backward(ctx, grad_y):
        q, k, v, slot_source, real, opens_cluster, y, logsumexp = ctx.saved_tensors
        window, rotary = ctx.window, ctx.rotary
        batch, n_heads, n_tokens, dim_head = q.shape
        with torch.enable_grad():  # rotate the keys again, to carry their gradient back through it
            unrotated = k.detach().requires_grad_(rotary is not None)
            rotated = unrotated if rotary is None else rotary(unrotated)
        band, opening = _band_masks(window, q.dtype, q.device)
        opens = opens_cluster.flatten(0, 1)[..., None, None]
        grad_q, grad_rotated, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

        def add(grad: Tensor, index: Tensor, part: Tensor) -> None:  # scatter-add a chunk into time order
            part = part.reshape(batch, n_heads, -1, dim_head)
            grad.scatter_add_(2, index[..., None].expand(-1, -1, -1, dim_head), part)

        for chunk in _chunks(opens_cluster.shape[-1], window):
            queries, keys, values, query_index = _chunk_tensors(q, rotated.detach(), v, slot_source, chunk, window)
            shape = queries.shape  # [B R, n, W, D]
            padding = ~real[..., chunk.start * window : chunk.stop * window, None]
            # padding slots get zero output gradient, so they add exactly nothing to any gradient
            grad_out = pick_rows(grad_y, query_index).masked_fill_(padding, 0.0).view(shape)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, queries, keys, values, pick_rows(y, query_index).view(shape), logsumexp[:, chunk], 0.0, False,
                attn_mask=torch.where(opens[:, chunk], opening, band),
            )
            add(grad_q, query_index, dq)
            # key column j < W of block n is slot (n-1) W + j, column W + j is slot n W + j; each token
            # gets exactly two such terms, and their sum does not depend on which chunk adds first
            as_previous = slot_source[..., chunk.start * window : chunk.stop * window]
            as_own = slot_source[..., (chunk.start + 1) * window : (chunk.stop + 1) * window]
            for grad, windows in ((grad_rotated, dk), (grad_v, dv)):
                add(grad, as_previous, windows[:, :, :window])
                add(grad, as_own, windows[:, :, window:])
        grad_k = grad_rotated
        if rotary is not None:
            (grad_k,) = torch.autograd.grad(rotated, unrotated, grad_rotated)
        return grad_q, grad_k, grad_v, None, None, None, None, None


def _chunk_tensors(q: Tensor, k: Tensor, v: Tensor, slot_source: Tensor, chunk: slice, window: int):
    """The blocks in chunk: queries [B R, n, W, D], keys and values [B R, n, 2W, D] (each block's
    previous block then its own: an overlapping view, no copy per block), and the token of each
    query slot [B, R, n W]."""
    batch, n_heads = q.shape[:2]
    query_index = slot_source[..., (chunk.start + 1) * window : (chunk.stop + 1) * window]  # [B, R, n W]
    key_index = slot_source[..., chunk.start * window : (chunk.stop + 1) * window]  # [B, R, (n+1) W]
    queries = pick_rows(q, query_index).view(batch * n_heads, -1, window, q.shape[-1])
    keys = pick_rows(k, key_index).flatten(0, 1)  # [B R, (n+1) W, D]
    values = pick_rows(v, key_index).flatten(0, 1)
    return queries, _windows(keys, window), _windows(values, window), query_index


def routed_attention(
    q: Tensor, k: Tensor, v: Tensor, clusters: Tensor, window: int, dropout: float = 0.0,
    rotary: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Parallel routed attention over a whole sequence. q, k, v [B, R, T, D], clusters [B, R, T]
    -> [B, R, T, D]; token t sees itself and the last `window` earlier tokens of its cluster.
    rotary: applied to k first (None: k is used as given).

    Computed like local attention, on the cluster-aligned layout of `cluster_block_layout`: each
    block of W slots attends to the block before it and itself through a band mask (slot i sees
    itself and the W slots before it), the block before hidden when the block opens its cluster.
    Padding slots come after every real token of their cluster, so the band hides them from real
    tokens. Keys are an overlapping view of the layout (no copy per block). Training on the CPU
    keeps only q, k, v, y and the log-sum-exp for the backward, as torch's full attention does.
    """
    batch, n_heads, _, dim_head = q.shape
    destination, source, opens_cluster = cluster_block_layout(clusters, window)
    slot_source = F.pad(source, (window, 0))  # [B, R, (N+1) W]: one hidden block in front
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if needs_grad and dropout == 0.0 and q.device.type == "cpu":
        q, k, v = autocast_inputs(q, k, v)
        return _BandedRoutedAttention.apply(q, k, v, slot_source, destination, opens_cluster, window, rotary)
    k = k if rotary is None else rotary(k)
    # inference, dropout, other devices: the same layout through torch's attention (and autograd)
    every_block = slice(0, slot_source.shape[-1] // window - 1)  # the blocks after the hidden one in front
    queries, keys, values, _ = _chunk_tensors(q, k, v, slot_source, every_block, window)
    band, opening = _band_masks(window, queries.dtype, queries.device)
    mask = torch.where(opens_cluster.flatten(0, 1)[..., None, None], opening, band)  # [B R, N, W, 2W]
    out = F.scaled_dot_product_attention(
        queries, keys, values,
        attn_mask=mask, dropout_p=dropout,
    )
    return pick_rows(out.reshape(batch, n_heads, -1, dim_head), destination)  # time order, [B, R, T, D]


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

    @staticmethod
    def keys_per_query(config: RoutingAttentionConfig, seq_len: int, n_heads: int, layer_index: int) -> float:
        """Keys a query is scored against, for the FLOP count (flops.py), averaged over the layer's
        heads: local heads their window, routed heads itself and the last window of its cluster."""
        n_local = local_heads_of_layer(config.n_local_heads, layer_index)
        local_keys, routed_keys = min(config.window_size, seq_len), min(config.window_size + 1, seq_len)
        return (n_local * local_keys + (n_heads - n_local) * routed_keys) / n_heads

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
        if config.backend == "flex" and spec.dropout > 0:
            raise ConfigError("attention.routing.backend=flex has no attention dropout; set model.attention.dropout=0")
        self.last_clusters: Tensor | None = None

    def forward(self, x: Tensor, cache: RoutingCache | None = None) -> Tensor:
        spec, window = self.spec, self.config.window_size
        dropout = spec.dropout if self.training else 0.0
        offset = 0 if cache is None else cache.length
        q = rearrange(self.to_q(x), "b t (h d) -> b h t d", d=spec.dim_head)  # [B, H, T, D]
        k = expand_kv(rearrange(self.to_k(x), "b t (g d) -> b g t d", d=spec.dim_head), spec.n_heads)
        v = expand_kv(rearrange(self.to_v(x), "b t (g d) -> b g t d", d=spec.dim_head), spec.n_heads)
        # route on keys before rotary positions: content, not position, picks the cluster
        with torch.no_grad():  # the gradient reaches the keys through the commitment loss only
            routing = F.normalize(k[:, self.n_local :].float(), dim=-1)  # [B, R, T, D]
            clusters = assign_clusters(routing, self.centroids)  # [B, R, T]
        self.aux_losses = {}
        if self.training and self.n_routed:
            weight = self.config.commitment_weight
            loss = commitment_loss(k[:, self.n_local :].float(), self.centroids, clusters)
            self.aux_losses = {"commitment": weight * loss}
            if not is_recomputing():  # a reversible layer's recomputation must not count twice
                with torch.no_grad():
                    sums, counts = cluster_statistics(routing, clusters, self.n_clusters)
                    self.centroid_sums += sums
                    self.centroid_counts += counts
        if self.record_statistics:
            self.last_clusters = clusters
        unrotated_k = k
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
            if cache is None and self.config.backend == "flex":  # kernels/flex_routing.py
                parts.append(flex_routed_attention(q[:, routed], k[:, routed], v[:, routed], clusters, window))
            elif cache is None:
                # keys before rotary go in: the copy autograd keeps is the commitment loss's too
                rotary = None if spec.rotary is None else partial(spec.rotary, offset=offset)
                parts.append(routed_attention(q[:, routed], unrotated_k[:, routed], v[:, routed], clusters, window,
                                              dropout, rotary))
            else:
                parts.append(routed_attention_cached(q[:, routed], k[:, routed], v[:, routed], clusters, window))
        y = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [B, H, T, D]
        return self.to_out(rearrange(y, "b h t d -> b t (h d)"))  # a view when y is laid out [B, T, H, D]

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

