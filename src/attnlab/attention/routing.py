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
cluster is one contiguous run in time order, and every cluster is padded to whole blocks of
W / m slots (m = BLOCKS_PER_WINDOW). A block attends to itself and to the (up to m) blocks before it
in its own cluster through a band mask, in one fused-kernel call per number of blocks it sees
(`_Plan`), so no key of another cluster is scored and no mask is built per block. A token's place
in its block and the places of its W predecessors depend only on its rank within its cluster, so
its row of scores has the same layout whatever the later tokens are: that is what makes causality
exact to the bit. Padding costs less than one block per cluster (T + C W / m slots). Tensors move
between time order and the blocks by whole rows (index_select), never element by element.
Decoding gathers each query's W + 1 slots instead.

On the CPU in float32 without dropout, a compiled kernel does the same attention without any
layout (kernels/listed_cpu.py, `cluster_units`): one unit per cluster lists its tokens in time
order, and a token of rank r attends to ranks r - W .. r of it, keys and values read in place. It
is causal to the bit too, and about 3x faster than the block layout at 4096 tokens (bench/listed_kernel.py,
docs/benchmarks.md), which serves every other case (GPU, bf16 autocast, dropout, no C++ compiler).

Legend: B batch, T queries, S keys (cached + new), H query heads, R routed heads, L local heads,
G key/value heads, D head width, C clusters, W window, K = W + 1 key slots (itself + W earlier),
P slots of the block layout, N blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from attnlab.attention.base import AttentionSpec, KVCache, RowLengths, expand_kv, write_rows
from attnlab.attention.gathered import additive_mask, autocast_inputs, row_numbers, rows_of
from attnlab.attention.kernels import listed_cpu
from attnlab.attention.kernels.flex import worth_flex
from attnlab.attention.kernels.flex_routing import flex_routed_attention
from attnlab.attention.local import local_attention
from attnlab.config import RoutingAttentionConfig
from attnlab.errors import ConfigError
from attnlab.model.linear import Linear
from attnlab.model.reversible import is_recomputing
from attnlab.registry import ATTENTION

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
    counts = torch.bincount(index, minlength=n_heads * n_clusters).to(routing.dtype)
    return sums.view(n_heads, n_clusters, width), counts.view(n_heads, n_clusters)


def ema_centroids(centroids: Tensor, sums: Tensor, counts: Tensor, decay: float) -> Tensor:
    """Eq. 10: centroids move toward the mean of their assigned vectors, then back to the sphere.
    Centroids that received no vector stay where they are."""
    means = sums / counts.clamp(min=1)[..., None]
    moved = F.normalize(decay * centroids + (1 - decay) * means, dim=-1)
    return torch.where(counts[..., None] > 0, moved, centroids)


def cluster_block_layout(clusters: Tensor, block: int) -> tuple[Tensor, Tensor, Tensor]:
    """The cluster-aligned block layout that routed attention is computed on.

    clusters [B, R, T] -> destination [B, R, T] (the slot of each token), source [B, R, P] (the
    token in each slot; padding slots hold token 0, never visible to a real token) and block_rank
    [B, R, N] (the block's place within its cluster, 0 for the block that opens it; blocks past
    the last cluster count on from a fresh 0), with P = N * block slots.

    Tokens are grouped by cluster in time order (a stable sort); each cluster starts on a block
    boundary and is padded to whole blocks. So a token's slot within its block, the rank of its
    block, and the slots of its predecessors, depend only on its rank within its cluster (how many
    earlier tokens share it), a causal quantity: its row of scores has the same layout whatever the
    later tokens are, which is what keeps the layer causal to the bit although blocks are computed
    together.
    """
    n_tokens, device = clusters.shape[-1], clusters.device
    n_clusters = int(clusters.max()) + 1
    counts = torch.zeros(*clusters.shape[:-1], n_clusters, dtype=torch.long, device=device)
    counts.scatter_add_(-1, clusters, torch.ones_like(clusters))  # [B, R, C]
    starts = counts.cumsum(-1) - counts  # first sorted row of each cluster
    padded = (counts + block - 1) // block * block  # whole blocks per cluster
    padded_starts = padded.cumsum(-1) - padded  # first slot of each cluster, a block boundary
    order = torch.sort(clusters, dim=-1, stable=True).indices  # [B, R, T]; stable: time order kept
    sorted_clusters = clusters.gather(-1, order)
    rank = torch.arange(n_tokens, device=device) - starts.gather(-1, sorted_clusters)  # within the cluster
    sorted_destination = padded_starts.gather(-1, sorted_clusters) + rank
    destination = torch.empty_like(order).scatter_(-1, order, sorted_destination)  # [B, R, T]
    totals = padded.sum(-1, keepdim=True) // block  # [B, R, 1] blocks in use
    n_blocks = int(totals.max())
    source = torch.zeros(*clusters.shape[:-1], n_blocks * block, dtype=torch.long, device=device)
    source.scatter_(-1, sorted_destination, order)  # [B, R, P]
    opens = torch.zeros(*clusters.shape[:-1], n_blocks + 1, dtype=torch.bool, device=device)
    opens.scatter_(-1, padded_starts // block, True).scatter_(-1, totals, True)  # and the unused blocks
    index = torch.arange(n_blocks, device=device)
    first = torch.where(opens[..., :n_blocks], index, 0).cummax(-1).values  # the opening block of each
    return destination, source, index - first


def cluster_units(clusters: Tensor, window: int) -> listed_cpu.Units:
    """The CPU kernel's units for routed attention (kernels/listed_cpu.py): one per (batch, head,
    cluster), listing the cluster's tokens in time order; the token of rank r in its cluster sees
    ranks max(0, r - window) .. r. clusters [B, R, T]."""
    n_tokens = clusters.shape[-1]
    flat = clusters.reshape(-1, n_tokens)  # [B R, T]
    n_rows, n_clusters = flat.shape[0], int(flat.max()) + 1
    order = torch.sort(flat, dim=-1, stable=True).indices  # time order within each cluster
    index = (flat + torch.arange(n_rows)[:, None] * n_clusters).flatten()
    counts = torch.bincount(index, minlength=n_rows * n_clusters)  # [B R C]
    starts = (counts.cumsum(0) - counts).view(n_rows, n_clusters) - torch.arange(n_rows)[:, None] * n_tokens
    rank = torch.arange(n_tokens) - starts.gather(-1, flat.gather(-1, order))  # [B R, T] in sorted order
    key_start = F.pad(counts.cumsum(0), (1, 0))
    tokens = order.flatten()
    return listed_cpu.Units(
        bh=torch.arange(n_rows).repeat_interleave(n_clusters), key_start=key_start, key_tokens=tokens,
        query_start=key_start, query_tokens=tokens, query_lo=(rank - window).clamp(min=0).flatten(),
        query_hi=rank.flatten(), group_start=torch.arange(n_rows * n_clusters + 1),
    )


BLOCKS_PER_WINDOW = 2  # routed blocks are window / this slots long, when that divides the window
CHUNK_SLOTS = 16384  # key slots gathered per kernel call: bounds the transient copies


class _Plan:
    """How one call of routed attention runs on the block layout of `cluster_block_layout`.

    Blocks are `block` = window / m slots long (m = BLOCKS_PER_WINDOW when it divides the window,
    else 1). A block of kind j = min(its rank in its cluster, m) sees itself and the j blocks before
    it in its cluster: (j + 1) blocks of keys, all of its own cluster, through one band mask per kind
    [block, (j + 1) block] (slot i, key column j block + i, sees the `window` key columns before its
    own). So no mask is built per block, and no key of another cluster is ever scored; shorter
    blocks also waste less on padding and on masked scores. Blocks of one kind go through the
    fused kernel together, a chunk at a time; blocks with no real token (past the last cluster) are
    skipped.

    Buffers are [n, block, D] over the live blocks in call order (by kind, then place).
    """

    def __init__(self, clusters: Tensor, window: int) -> None:
        m = BLOCKS_PER_WINDOW if window % BLOCKS_PER_WINDOW == 0 and window >= BLOCKS_PER_WINDOW else 1
        block = window // m
        destination, source, block_rank = cluster_block_layout(clusters, block)
        batch, n_heads, _ = clusters.shape
        device, n_blocks = clusters.device, block_rank.shape[-1]
        self.block = block
        real = destination.gather(-1, source) == torch.arange(source.shape[-1], device=device)  # [B, R, P]
        live = real.view(-1, block).any(-1)  # [B R N]
        kinds = block_rank.clamp(max=m).flatten()
        ids = live.nonzero().squeeze(1)
        by_kind = torch.sort(kinds[ids], stable=True)
        self.order = ids[by_kind.indices]  # [n]: live blocks in call order
        counts = torch.bincount(by_kind.values, minlength=m + 1).tolist()
        position = torch.full_like(kinds, -1)
        position[self.order] = torch.arange(self.order.numel(), device=device)
        self.tokens = source.view(-1, block)  # [B R N, block]: token in each slot
        self.heads = torch.arange(batch * n_heads, device=device).repeat_interleave(n_blocks)  # [B R N]
        self.padding = ~real.view(-1, block)[self.order]  # [n, block]
        global_block = row_numbers(destination // block, n_blocks)
        self.token_rows = position[global_block] * block + destination % block  # [B, R, T]: its row in call order
        self.position = position
        self.calls: list[tuple[int, int, int]] = []  # (kind, first, end) in call order
        first = 0
        for kind, count in enumerate(counts):
            size = max(1, CHUNK_SLOTS // ((kind + 1) * block))
            starts = range(first, first + count, size)
            self.calls += [(kind, start, min(start + size, first + count)) for start in starts]
            first += count
        slot = torch.arange(block, device=device)[:, None]
        column = torch.arange((m + 1) * block, device=device)[None, :]
        self.visible = [  # kind j: [block, (j + 1) block]
            ((column <= j * block + slot) & (column >= j * block + slot - window))[:, : (j + 1) * block]
            for j in range(m + 1)
        ]

    @property
    def n_live(self) -> int:
        return self.order.numel()

    def key_blocks(self, kind: int, first: int, end: int) -> Tensor:
        """Blocks whose slots are the keys of the call's blocks, [n, kind + 1] (global ids)."""
        return self.order[first:end, None] - kind + torch.arange(kind + 1, device=self.order.device)

    def queries(self, x: tuple[Tensor, Tensor, int], first: int, end: int, zero_padding: bool = False) -> Tensor:
        """The call's query slots of x = rows_of(...): [1, n, block, D]; zero_padding: padding slots
        read zeros rather than token 0."""
        blocks = self.order[first:end]
        out = self._select(x, blocks, self.tokens[blocks])
        if zero_padding:
            out.masked_fill_(self.padding[first:end, :, None], 0.0)
        return out[None]

    def keys(self, x: tuple[Tensor, Tensor, int], kind: int, first: int, end: int) -> Tensor:
        """The call's key slots: [1, n, (kind + 1) block, D]."""
        blocks = self.key_blocks(kind, first, end)
        return self._select(x, blocks[:, 0], self.tokens[blocks].flatten(1))[None]

    def _select(self, x: tuple[Tensor, Tensor, int], blocks: Tensor, tokens: Tensor) -> Tensor:
        rows, start, step = x
        index = start[self.heads[blocks]][:, None] + tokens * step  # [n, slots]
        return rows.index_select(0, index.flatten()).view(*index.shape, rows.shape[-1])

    def mask(self, kind: int, dtype: torch.dtype) -> Tensor:
        return additive_mask(self.visible[kind], dtype)[None, None]

    def to_time(self, buffer: Tensor, heads_inner: bool = False) -> Tensor:
        """buffer [n, block, D] in call order -> [B, R, T, D] in time order; heads_inner: laid out
        [B, T, R, D] (as torch's fused attention lays out its output: merging heads is a view)."""
        index = self.token_rows.transpose(1, 2) if heads_inner else self.token_rows
        out = buffer.view(-1, buffer.shape[-1]).index_select(0, index.flatten()).view(*index.shape, -1)
        return out.transpose(1, 2) if heads_inner else out


class _RoutedAttention(torch.autograd.Function):
    """Forward on the fused kernel; keeps only q, k, v, y and the log-sum-exp (what torch keeps for
    full attention), and gathers the blocks again in the backward. Keys come in before their
    rotary positions (`rotary`: keys -> rotated keys, or None) and are rotated here, so that the
    one copy kept serves the commitment loss too."""

    @staticmethod
    def forward(ctx, q, k, v, plan, rotary):
        rotated = k if rotary is None else rotary(k)
        q_rows, k_rows, v_rows = rows_of(q), rows_of(rotated), rows_of(v)
        out = q.new_empty(plan.n_live, plan.block, q.shape[-1])
        logsumexp = None  # [n, block], in the kernel's accumulation dtype
        for kind, first, end in plan.calls:
            part, part_logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                plan.queries(q_rows, first, end), plan.keys(k_rows, kind, first, end),
                plan.keys(v_rows, kind, first, end), 0.0, False, attn_mask=plan.mask(kind, q.dtype),
            )
            if logsumexp is None:
                logsumexp = part_logsumexp.new_empty(plan.n_live, plan.block)
            out[first:end], logsumexp[first:end] = part[0], part_logsumexp[0]
        y = plan.to_time(out, heads_inner=True)
        ctx.save_for_backward(q, k, v, y, logsumexp)
        ctx.plan, ctx.rotary = plan, rotary
        return y

    @staticmethod
    def backward(ctx, grad_y):
        q, k, v, y, logsumexp = ctx.saved_tensors
        plan, rotary = ctx.plan, ctx.rotary
        with torch.enable_grad():  # rotate the keys again, to carry their gradient back through it
            unrotated = k.detach().requires_grad_(rotary is not None)
            rotated = unrotated if rotary is None else rotary(unrotated)
        q_rows, k_rows, v_rows = rows_of(q), rows_of(rotated.detach()), rows_of(v)
        grad_rows, y_rows = rows_of(grad_y.to(y.dtype)), rows_of(y)
        shape = (plan.n_live, plan.block, q.shape[-1])
        grad_q, grad_k, grad_v = q.new_empty(shape), q.new_zeros(shape), q.new_zeros(shape)
        for kind, first, end in plan.calls:
            queries = plan.queries(q_rows, first, end)
            # padding slots get zero output gradient, so they add exactly nothing to any gradient
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                plan.queries(grad_rows, first, end, zero_padding=True), queries,
                plan.keys(k_rows, kind, first, end), plan.keys(v_rows, kind, first, end),
                plan.queries(y_rows, first, end), logsumexp[None, first:end], 0.0, False,
                attn_mask=plan.mask(kind, q.dtype),
            )
            grad_q[first:end] = dq[0]
            # key block s of a block is block `key_blocks[:, s]`; the terms a slot gets are added
            # in call order, which depends only on the layout, never on the later tokens' values.
            # The kernel's gradients [1, n, slots, D] lie in memory slots-major: read them so.
            blocks = plan.position[plan.key_blocks(kind, first, end)]  # [n, kind + 1]
            targets = (blocks[..., None] * plan.block + torch.arange(plan.block, device=q.device)).flatten(1)
            targets = targets.t().flatten()
            for grad, part in ((grad_k, dk), (grad_v, dv)):
                rows = part[0].transpose(0, 1).reshape(-1, part.shape[-1])
                grad.view(-1, grad.shape[-1]).index_add_(0, targets, rows)
        grad_q, grad_k, grad_v = (plan.to_time(grad) for grad in (grad_q, grad_k, grad_v))
        if rotary is not None:
            (grad_k,) = torch.autograd.grad(rotated, unrotated, grad_k)
        return grad_q, grad_k, grad_v, None, None


def routed_attention(
    q: Tensor, k: Tensor, v: Tensor, clusters: Tensor, window: int, dropout: float = 0.0,
    rotary: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Parallel routed attention over a whole sequence. q, k, v [B, R, T, D], clusters [B, R, T]
    -> [B, R, T, D]; token t sees itself and the last `window` earlier tokens of its cluster.
    rotary: applied to k first (None: k is used as given).

    Computed on the cluster-aligned block layout (`cluster_block_layout`, `_Plan`): every block
    attends to itself and the blocks before it in its cluster that its slots can reach, through a
    band mask. Padding slots come after every real token of their cluster, so the band hides them
    from real tokens. Training on the CPU keeps only q, k, v, y and the log-sum-exp for the
    backward, as torch's full attention does.
    """
    if listed_cpu.usable(q, k, v, dropout=dropout):  # the CPU kernel: no block layout at all
        return listed_cpu.listed_attention(q, k, v, cluster_units(clusters, window), rotary=rotary)
    plan = _Plan(clusters, window)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if needs_grad and dropout == 0.0 and q.device.type == "cpu":
        q, k, v = autocast_inputs(q, k, v)
        return _RoutedAttention.apply(q, k, v, plan, rotary)
    k = k if rotary is None else rotary(k)
    # inference, dropout, other devices: the same blocks through torch's attention (and autograd)

    def rows(x: Tensor) -> tuple[Tensor, Tensor, int]:  # a plain reshape, which autograd goes through
        return x.reshape(-1, x.shape[-1]), torch.arange(x.shape[0] * x.shape[1], device=x.device) * x.shape[2], 1

    q_rows, k_rows, v_rows = rows(q), rows(k), rows(v)
    outs = [
        F.scaled_dot_product_attention(
            plan.queries(q_rows, first, end), plan.keys(k_rows, kind, first, end), plan.keys(v_rows, kind, first, end),
            attn_mask=plan.mask(kind, q.dtype), dropout_p=dropout,
        )[0]
        for kind, first, end in plan.calls
    ]
    return plan.to_time(torch.cat(outs), heads_inner=True)  # [B, R, T, D]


def routed_attention_cached(
    q: Tensor, k: Tensor, v: Tensor, clusters: Tensor, window: int, block: int = 256,
    positions: Tensor | None = None,
) -> Tensor:
    """Routed attention for the last T of S tokens, keys gathered per query (decoding, no grad).
    q [B, R, T, D], k v [B, R, S, D], clusters [B, R, S] -> [B, R, T, D]. Same slots as above.
    positions [B, T]: the queries' own positions when rows differ in length (a per-row cache);
    whatever a row holds past its last query is a later position, so it is never among the W + 1
    slots before a query in its cluster's order."""
    n_queries, n_keys, dim_head = q.shape[2], k.shape[2], q.shape[3]
    if positions is None:
        positions = torch.arange(n_keys - n_queries, n_keys, device=q.device).expand(q.shape[0], -1)
    query_positions = positions[:, None, :].expand(-1, clusters.shape[1], -1)  # [B, R, T]
    if n_queries == 1:  # one decoded token: its keys are the last W + 1 positions of its cluster
        key_positions = torch.arange(n_keys, device=q.device)
        same = (clusters == clusters.gather(-1, query_positions)) & (key_positions <= query_positions)  # [B, R, S]
        candidates = torch.where(same, key_positions, -1)
        picked = candidates.topk(min(window + 1, n_keys), dim=-1).values  # [B, R, K], -1: none
        index = picked.clamp(min=0)[..., None].expand(-1, -1, -1, dim_head)
        keys, values = k.gather(2, index), v.gather(2, index)  # [B, R, K, D]
        scores = torch.einsum("brtd,brkd->brtk", q, keys).float() / math.sqrt(dim_head)
        probs = torch.softmax(scores.masked_fill(picked[:, :, None] < 0, float("-inf")), dim=-1).to(values.dtype)
        return torch.einsum("brtk,brkd->brtd", probs, values)
    order = torch.sort(clusters, dim=-1, stable=True).indices  # [B, R, S]
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n_keys, device=q.device).expand_as(order))
    sorted_clusters = clusters.gather(-1, order)
    outputs = []
    for start in range(0, n_queries, block):  # bounded memory for long chunks: block * K * D
        end = min(start + block, n_queries)
        rows = rank.gather(-1, query_positions[..., start:end])  # [B, R, t]
        slots = rows[..., None] - torch.arange(window + 1, device=q.device)  # [B, R, t, K]
        safe = slots.clamp(min=0).flatten(-2)  # [B, R, t K]
        own = clusters.gather(-1, query_positions[..., start:end])[..., None]
        allowed = (slots >= 0) & (sorted_clusters.gather(-1, safe).view_as(slots) == own)
        index = order.gather(-1, safe)[..., None].expand(-1, -1, -1, dim_head)
        keys = k.gather(2, index).unflatten(2, slots.shape[2:])  # [B, R, t, K, D]
        values = v.gather(2, index).unflatten(2, slots.shape[2:])
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
    Rows may have lengths of their own (truncate_rows), as in the full-attention cache: row b's
    tokens sit at positions 0..rows.lengths[b]-1, and what lies past them is never attended to.
    """

    per_row_rollback = True

    def __init__(self, batch: int, n_heads: int, n_routed: int, dim_head: int, max_len: int, device, dtype) -> None:
        self.keys = torch.zeros(batch, n_heads, max_len, dim_head, device=device, dtype=dtype)
        self.values = torch.zeros_like(self.keys)
        self.clusters = torch.zeros(batch, n_routed, max_len, device=device, dtype=torch.long)
        self.length = 0
        self.rows = None
        self.positions: Tensor | None = None  # [B, T] of the last append's tokens, while rows differ

    def append(self, k: Tensor, v: Tensor, clusters: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store k, v [B, H, T, D], clusters [B, R, T]; return everything so far (length S, the
        longest row's). While rows differ, `positions` holds each new token's own position."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"cache holds {self.keys.shape[2]} tokens; {end} were fed")
        if self.rows is None:
            self.keys[:, :, start:end] = k
            self.values[:, :, start:end] = v
            self.clusters[:, :, start:end] = clusters
        else:
            self.rows, self.positions = self.rows.advance(k.shape[2])  # shared by the layers
            for store, new in ((self.keys, k), (self.values, v), (self.clusters, clusters)):
                write_rows(store, new, self.positions)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end], self.clusters[:, :, :end]

    def truncate(self, length: int) -> None:
        self._check_truncate(length)
        if self._level_rows(length):
            self.positions = None
        self.length = length  # later slots are overwritten by the next append

    def truncate_rows(self, rows: RowLengths) -> None:
        self._adopt_rows(rows)


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
        self.to_q = Linear(spec.dim, inner_q, bias=False)
        self.to_k = Linear(spec.dim, inner_kv, bias=False)
        self.to_v = Linear(spec.dim, inner_kv, bias=False)
        self.to_out = Linear(inner_q, spec.dim, bias=False)
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
        offset = 0 if cache is None else cache.offset  # [B] per row after a per-row rollback
        q = rearrange(self.to_q(x), "b t (h d) -> b h t d", d=spec.dim_head)  # [B, H, T, D]
        k = expand_kv(rearrange(self.to_k(x), "b t (g d) -> b g t d", d=spec.dim_head), spec.n_heads)
        v = expand_kv(rearrange(self.to_v(x), "b t (g d) -> b g t d", d=spec.dim_head), spec.n_heads)
        # route on keys before rotary positions: content, not position, picks the cluster
        with torch.no_grad():  # the gradient reaches the keys through the commitment loss only
            routing = F.normalize(k[:, self.n_local :].float(), dim=-1)  # [B, R, T, D]
            similarity, clusters = nearest_centroids(routing, self.centroids)  # [B, R, T]
        self.aux_losses = {}
        if self.training and self.n_routed:
            weight = self.config.commitment_weight
            loss = commitment_loss(k[:, self.n_local :].float(), self.centroids, clusters, similarity)
            self.aux_losses = {"commitment": weight * loss}
            if not is_recomputing():  # a reversible layer's recomputation must not count twice
                with torch.no_grad():
                    sums, counts = cluster_statistics(routing, clusters, self.n_clusters)
                    self.centroid_sums += sums
                    self.centroid_counts += counts
        if self.record_statistics:
            self.last_clusters = clusters
        unrotated_k = k
        end = None if cache is None else cache.length + x.shape[1]  # per-row rotary offsets' bound
        if spec.rotary is not None:
            q, k = spec.rotary.rotate_pair(q, k, offset, end)
        positions = None  # [B, T] when rows differ in length
        if cache is not None:
            k, v, clusters = cache.append(k, v, clusters)  # [B, H, S, D], clusters [B, R, S]
            k, v = k.to(q.dtype), v.to(q.dtype)
            positions = cache.positions if cache.rows is not None else None
        local, routed = self.n_local, slice(self.n_local, None)
        parts = []
        if self.n_local:  # each row's own band of the last W tokens when rows differ
            parts.append(local_attention(q[:, :local], k[:, :local], v[:, :local], window, dropout, positions))
        if self.n_routed:
            # kernels/flex_routing.py for whole sequences, long enough on CUDA (flex.worth_flex)
            if cache is None and self.config.backend == "flex" and worth_flex(q.shape[2], q.device.type):
                parts.append(flex_routed_attention(q[:, routed], k[:, routed], v[:, routed], clusters, window))
            elif cache is None:
                # keys before rotary go in: the copy autograd keeps is the commitment loss's too
                rotary = None if spec.rotary is None else partial(spec.rotary, offset=offset)
                parts.append(routed_attention(q[:, routed], unrotated_k[:, routed], v[:, routed], clusters, window,
                                              dropout, rotary))
            else:
                parts.append(routed_attention_cached(q[:, routed], k[:, routed], v[:, routed], clusters, window,
                                                     positions=positions))
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

