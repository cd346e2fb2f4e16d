"""Causal sorted-bucket Sinkhorn attention: each token attends to its own bucket (causally) and to
the `n_sortcut` past buckets that a learned sorting matches to its bucket.

"Sparse Sinkhorn Attention" (Tay, Bahri, Yang, Metzler, Juan, arXiv 2002.11296). The sequence is cut
into buckets of `bucket_size`; a sorting matrix between buckets (section 3.2: bucket summaries,
Sinkhorn balancing eq. 5-6, Gumbel noise and a temperature in training, SortCut section 3.4) picks,
for every bucket, the past buckets its tokens attend to. Deliberate departures, each for exact
causality and prefix consistency:

- Row n of the sorting matrix (bucket n's choice) is built only from finished buckets: its query
  summary is the mean query of bucket n - 1, its candidates are buckets 0..n-1 (mean keys). The
  paper's causal variant uses cumulative sums that let a bucket's early tokens see its later ones.
- Sinkhorn's column step runs over rows 0..n only (a log-cumulative-sum down the rows), so row n
  never depends on later buckets, and it caps a bucket's cumulative mass at 1 rather than
  setting it to 1 (which would always give a column's first claimant, bucket j + 1, weight 1).
  Rows are normalised as in the paper.
- The sorting network is the dot product of the layer's own (learned) query and key projections,
  as in the public implementation; no extra parameters.
- The chosen buckets enter the softmax with their log sorting weight added to the scores, which
  keeps the sorting differentiable with a hard top-n_sortcut choice.
- A sequence that is not a multiple of the bucket size is padded on the right only; padding is
  never visible to a real token, so logits do not depend on the length.

Memory: the reference path (`bucket_attention`) scores each bucket's queries against its chosen
buckets and itself, T * (n_sortcut + 1) * bucket_size scores per head; the sorting matrix is
(T / bucket_size)^2 per head (the paper's cost; linear in T while bucket_size >= sqrt(T)).

Back-ends (kernels/__init__.py), for whole sequences: `cpu`, the listed-key C++ kernel
(kernels/listed_cpu.py: one unit per bucket lists its chosen buckets' tokens, then its own, with
the log sorting weight as a per-key bias that gets its gradient directly, and no scores kept for
the backward); `flex`, a FlexAttention bucket mask (kernels/flex_sinkhorn.py). Decoding through the
cache keeps every bucket's choice (SinkhornCache.sort): a bucket's choice is fixed once its
predecessor is finished, so the sorting runs when a token opens a bucket (one in bucket_size), not
at every step; `cached_bucket_attention` then reads each query's keys from the static storage, the
same shapes at every step: on the CPU in place by the `cpu` back-end (kernels/decode_cpu.py's
listed_attention), elsewhere gathered by torch.

Legend: B batch, T tokens, H query heads, G key/value heads, D head width, N buckets, M buckets
holding queries, b bucket size, S n_sortcut, L local heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from attnlab.attention.base import (
    Attention,
    AttentionSpec,
    KVCache,
    branch_free,
    compiled_branch,
    computation_dtype,
    expand_kv,
    new_lengths,
    select_rows,
    write_rows,
)
from attnlab.attention.kernels import check_backend, choose, choose_cached
from attnlab.attention.kernels.decode_cpu import listed_attention
from attnlab.attention.kernels.flex_sinkhorn import flex_bucket_attention
from attnlab.attention.kernels.listed_cpu import bucket_attention_cpu
from attnlab.attention.local import cached_window_attention, local_attention
from attnlab.config import SinkhornAttentionConfig
from attnlab.errors import ConfigError
from attnlab.registry import ATTENTION

OFFERED = ("torch", "cpu", "flex")
QUERY_CHUNK = 256  # queries whose gathered keys live at once in the reference path
MASKED = -1e4  # finite "minus infinity" for the sorting matrix: keeps Sinkhorn's gradients finite

# ----------------------------------------------------------------------------------------------
# Pure functions


def bucket_means(x: Tensor, bucket_size: int) -> Tensor:
    """x [B, H, T, D] -> per-bucket mean [B, H, ceil(T/b), D]; a partial last bucket's mean is
    never used (only finished buckets are sorted)."""
    pad = -x.shape[2] % bucket_size
    x = F.pad(x, (0, 0, 0, pad))
    return rearrange(x, "b h (n s) d -> b h n s d", s=bucket_size).mean(dim=3)


def causal_sinkhorn(log_p: Tensor, valid: Tensor, n_iter: int) -> Tensor:
    """Log-domain Sinkhorn balancing (eq. 5-6) whose row n depends on rows 0..n only.
    log_p [B, H, N, N], valid bool [N, N] -> balanced log_p (MASKED where not valid)."""
    # re-masking after every step keeps rows with no candidate (bucket 0) at MASKED, so they add
    # nothing to the column sums (and nothing that depends on how many buckets there are)
    for _ in range(n_iter):
        log_p = (log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)).masked_fill(~valid, MASKED)  # rows
        # columns: a bucket's mass claimed by rows 0..n is capped at 1 (the exact column
        # normalisation over rows 0..n would always hand a column's first claimant weight 1)
        column_mass = torch.logcumsumexp(log_p, dim=-2).clamp(min=0)
        log_p = (log_p - column_mass).masked_fill(~valid, MASKED)
    return log_p


def sort_buckets(
    query_means: Tensor, key_means: Tensor, n_sortcut: int, n_iter: int, temperature: float, gumbel: bool
) -> tuple[Tensor, Tensor]:
    """Choose, for every bucket n, up to S past buckets j < n.

    query_means, key_means [B, H, N, D] (before rotary positions). Returns the chosen bucket
    indices [B, H, N, S] and their log sorting weights [B, H, N, S] (-inf: no such bucket).
    """
    n_buckets, dim_head = key_means.shape[2], key_means.shape[3]
    previous = F.pad(query_means[:, :, :-1], (0, 0, 1, 0))  # bucket n asks with bucket n-1's summary
    logits = torch.einsum("bhnd,bhjd->bhnj", previous.float(), key_means.float()) / math.sqrt(dim_head)
    if gumbel:  # section 3.2: Gumbel noise makes the sorting stochastic in training
        logits = logits - torch.log(-torch.log(torch.rand_like(logits).clamp(1e-9, 1 - 1e-9)))
    row = torch.arange(n_buckets, device=logits.device)
    valid = row[None, :] < row[:, None]  # [N, N]: strictly past buckets only
    log_p = causal_sinkhorn((logits / temperature).masked_fill(~valid, MASKED), valid, n_iter)
    n_choices = min(n_sortcut, n_buckets)
    weights, chosen = log_p.topk(n_choices, dim=-1)  # [B, H, N, S]
    chosen_valid = chosen < row[:, None]  # bucket n has only n candidates
    if n_choices < n_sortcut:  # fewer buckets than slots: pad with invalid choices
        pad = n_sortcut - n_choices
        chosen, weights = F.pad(chosen, (0, pad)), F.pad(weights, (0, pad))
        chosen_valid = F.pad(chosen_valid, (0, pad), value=False)
    return chosen, weights.masked_fill(~chosen_valid, float("-inf"))


def bucket_attention(q: Tensor, keys: Tensor, values: Tensor, chosen: Tensor, chosen_weights: Tensor,
                     bucket_size: int, dropout: float = 0.0) -> Tensor:
    """The reference path of a whole sequence: q, keys, values [B, H, T, D]; chosen, chosen_weights
    [B, H, N, S'] -> [B, H, T, D]. A query sees the earlier slots of its own bucket and itself, and
    every slot of its bucket's chosen buckets, those scores raised by the bucket's log sorting weight
    (-inf: no such bucket, hidden). Queries run in chunks of QUERY_CHUNK, each gathering its
    (S' + 1) b keys; checkpointed when a gradient is needed."""
    positions = torch.arange(q.shape[2], device=q.device).expand(q.shape[0], -1)  # [B, T]
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, keys, values, chosen_weights))
    outputs = []
    for start in range(0, q.shape[2], QUERY_CHUNK):
        args = (q[:, :, start : start + QUERY_CHUNK], keys, values, chosen, chosen_weights,
                positions[:, start : start + QUERY_CHUNK], bucket_size, dropout)
        outputs.append(checkpoint(cached_bucket_attention, *args, use_reentrant=False) if needs_grad
                       else cached_bucket_attention(*args))
    return torch.cat(outputs, dim=2)


def cached_bucket_attention(q: Tensor, keys: Tensor, values: Tensor, chosen: Tensor, chosen_weights: Tensor,
                            positions: Tensor, size: int, dropout: float = 0.0, backend: str = "torch") -> Tensor:
    """Queries q [B, H, t, D] at positions [B, t] (each row's own) over keys, values [B, H, L, D]
    (a whole sequence, or a cache's storage), with every bucket's choice chosen, chosen_weights
    [B, H, N, S'] (see bucket_attention): each query reads its (S' + 1) b keys, fixed shapes
    whatever the position (positions past a row's length lie after its queries: masked). backend:
    torch gathers them; cpu reads them in place (kernels/decode_cpu.py's listed_attention, the
    buckets as blocks of b, no dropout), the same result up to rounding."""
    batch, n_heads = q.shape[:2]
    slot = torch.arange(size, device=q.device)
    bucket = positions // size  # [B, t]
    row = bucket[:, None, :, None].expand(batch, n_heads, -1, chosen.shape[-1])  # [B, H, t, S']
    picked, weights = chosen.gather(2, row), chosen_weights.gather(2, row)  # each query's bucket's choice
    valid = weights.isfinite()  # [B, H, t, S']: a bucket with fewer past buckets has holes
    if backend == "cpu":  # the chosen buckets (their log weights the biases), then its own (no weight)
        own_start = (bucket * size)[:, None, :, None].expand(batch, n_heads, -1, 1)  # [B, H, t, 1]
        starts = torch.cat((picked * size, own_start), dim=-1)  # [B, H, t, S' + 1]
        biases = torch.cat((weights.float(), torch.zeros(own_start.shape, device=q.device)), dim=-1)
        return listed_attention(q, keys, values, starts, biases, size, positions)
    own = (bucket[..., None] * size + slot)[:, None].expand(batch, n_heads, -1, -1)  # [B, H, t, b]
    key_positions = torch.cat(((picked[..., None] * size + slot).flatten(-2), own), dim=-1)  # [B, H, t, (S'+1) b]
    # a key slot past the keys (or a row's own length) lies after the query: its own-bucket mask hides it
    visible = torch.cat((valid.repeat_interleave(size, dim=-1), own <= positions[:, None, :, None]), dim=-1)
    bias = torch.cat((torch.where(valid, weights, 0.0).repeat_interleave(size, dim=-1),
                      weights.new_zeros(own.shape)), dim=-1).to(q.dtype)  # own bucket: no weight
    index = key_positions.clamp(max=keys.shape[2] - 1)
    chunk_keys, chunk_values = select_rows(keys, index), select_rows(values, index)  # [B, H, t, (S'+1) b, D]
    scores = torch.einsum("bhtd,bhtkd->bhtk", q, chunk_keys.to(q.dtype)) / math.sqrt(q.shape[-1]) + bias
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    probs = F.dropout(probs, dropout) if dropout else probs
    return torch.einsum("bhtk,bhtkd->bhtd", probs, chunk_values.to(q.dtype))


# ----------------------------------------------------------------------------------------------
# Cache and module


class SinkhornCache(KVCache):
    """Per position: rotated keys and values (in the cache's dtype), and the unrotated queries and
    keys that bucket summaries are made of (in the wider of it and the model's), [B, H, L, D] (L:
    max_len in whole buckets); and the summary of every
    bucket, [B, H, N, D]. A forward summarises again each bucket its new tokens fall in (from the
    storage, after writing them), so a finished bucket's summary is always of its row's own tokens;
    an unfinished bucket's is never read (bucket n sorts on buckets before n only). And every
    bucket's choice, [B, H, N, S] indices and log weights, made when a token opens a bucket (sort)."""

    def __init__(self, lengths: Tensor, max_len: int, n_heads: int, dim_head: int, bucket_size: int, n_sortcut: int,
                 dtype, summary_dtype) -> None:
        super().__init__(lengths, max_len)
        n_buckets = math.ceil(max_len / bucket_size)
        shape = (lengths.shape[0], n_heads, n_buckets * bucket_size, dim_head)
        self.keys = torch.zeros(shape, device=lengths.device, dtype=dtype)  # rotated, for attention
        self.values = torch.zeros_like(self.keys)
        # before rotary, for bucket summaries: in summary_dtype, as they feed the buckets' choice (a
        # bfloat16 cache beside float32 weights would round them, and a near tie could choose otherwise)
        self.raw_queries = torch.zeros(shape, device=lengths.device, dtype=summary_dtype)
        self.raw_keys = torch.zeros_like(self.raw_queries)
        self.query_means = torch.zeros(*shape[:2], n_buckets, shape[-1], device=lengths.device, dtype=summary_dtype)
        self.key_means = torch.zeros_like(self.query_means)
        # every bucket's choice (sort_buckets' output) for all heads (local heads leave theirs unused)
        self.chosen = torch.zeros(*shape[:2], n_buckets, n_sortcut, device=lengths.device, dtype=torch.int64)
        self.choice_weights = torch.full(self.chosen.shape, float("-inf"), device=lengths.device)
        self.bucket_size = bucket_size

    def append(self, k: Tensor, v: Tensor, raw_q: Tensor, raw_k: Tensor, positions: Tensor) -> None:
        """Store the new tokens [B, H, T, D] at positions [B, T]; summarise their buckets again."""
        for store, new in ((self.keys, k), (self.values, v), (self.raw_queries, raw_q), (self.raw_keys, raw_k)):
            write_rows(store, new, positions)
        bucket = positions // self.bucket_size  # [B, T]
        rows = bucket[..., None] * self.bucket_size + torch.arange(self.bucket_size, device=bucket.device)  # [B, T, b]
        rows = rows[:, None].expand(-1, k.shape[1], -1, -1)  # [B, H, T, b]
        for means, raw in ((self.query_means, self.raw_queries), (self.key_means, self.raw_keys)):
            write_rows(means, select_rows(raw, rows).mean(dim=3), bucket)  # [B, H, T, D] at each bucket

    def sort(self, heads: slice, positions: Tensor, sort) -> None:
        """Every bucket's choice for these heads, made again (`sort(query_means, key_means)`, as
        sort_buckets) when a token at positions [B, T] opens a bucket. Bucket n's choice depends on
        buckets 0..n-1 only (causal Sinkhorn), which are finished once its first token is fed: so a
        kept choice stays exact until a rollback past that token, after which feeding the token
        again makes it anew. A prefill starts at position 0, which opens bucket 0."""
        opens = (positions % self.bucket_size == 0).any()

        def sorted_again(query_means: Tensor, key_means: Tensor) -> tuple[Tensor, Tensor]:
            return sort(query_means, key_means)

        def kept(query_means: Tensor, key_means: Tensor) -> tuple[Tensor, Tensor]:
            return self.chosen[:, heads].clone(), self.choice_weights[:, heads].clone()

        means = (self.query_means[:, heads], self.key_means[:, heads])
        if torch.compiler.is_compiling() and branch_free(self.chosen):  # both sides, one kept (CUDA graphs)
            both = zip(sorted_again(*means), kept(*means), strict=True)
            chosen, weights = (torch.where(opens, new, old) for new, old in both)
        elif torch.compiler.is_compiling():
            shapes = (self.chosen[:, heads].shape, self.choice_weights[:, heads].shape)
            chosen, weights = compiled_branch(opens, sorted_again, kept, means, shapes)
        elif bool(opens):
            chosen, weights = sorted_again(*means)
        else:
            return
        self.chosen[:, heads] = chosen
        self.choice_weights[:, heads] = weights


@ATTENTION.register("sinkhorn")
class SinkhornAttention(Attention):
    """L local heads (window of bucket_size) then H - L sorted-bucket heads."""

    config_class = SinkhornAttentionConfig
    legacy_keys = {f"{name}.weight": f"heads.{name}.weight" for name in ("to_q", "to_k", "to_v", "to_out")}

    @staticmethod
    def keys_per_query(config: SinkhornAttentionConfig, seq_len: int, n_heads: int, layer_index: int) -> float:
        """Local heads a bucket, sorted heads their own bucket and the n_sortcut chosen ones."""
        bucket = min(config.bucket_size, seq_len)
        sorted_keys = min(bucket * (1 + config.n_sortcut), seq_len)
        return (config.n_local_heads * bucket + (n_heads - config.n_local_heads) * sorted_keys) / n_heads

    def __init__(self, spec: AttentionSpec, config: SinkhornAttentionConfig) -> None:
        super().__init__(spec, config)
        check_backend("sinkhorn", config.backend, OFFERED)
        if not 0 <= config.n_local_heads <= spec.n_heads:
            raise ValueError(f"n_local_heads={config.n_local_heads} must be between 0 and heads={spec.n_heads}")
        self.n_local = config.n_local_heads
        if config.backend == "flex" and spec.dropout > 0:
            raise ConfigError("attention.sinkhorn.backend=flex has no attention dropout; set model.attention.dropout=0")

    def forward(self, x: Tensor, cache: SinkhornCache | None = None) -> Tensor:
        spec, local, size = self.spec, self.n_local, self.config.bucket_size
        dropout = spec.dropout if self.training else 0.0
        raw_q, raw_k, v = self.heads.project(x)  # [B, H, T, D], [B, G, T, D] x 2
        raw_k, v = expand_kv(raw_k, spec.n_heads), expand_kv(v, spec.n_heads)
        positions = 0 if cache is None else cache.positions(x.shape[1])  # [B, T] through a cache
        q, k = self.heads.rotate(raw_q, raw_k, positions)
        if cache is not None:
            cache.append(k, v, raw_q, raw_k, positions)
            if local < spec.n_heads:
                cache.sort(slice(local, None), positions, self._sort_cached)
            if not cache.prefill:  # a chunk after earlier tokens: read them from the storage
                return self.heads.merge(self._cached(q, cache, positions))
        parts = []  # a whole sequence (training, or a prefill into an empty cache)
        if local:
            parts.append(local_attention(q[:, :local], k[:, :local], v[:, :local], size, dropout))
        if local < spec.n_heads:
            query_means, key_means = bucket_means(raw_q[:, local:], size), bucket_means(raw_k[:, local:], size)
            parts.append(self._sorted(q[:, local:], k[:, local:], v[:, local:], query_means, key_means, dropout))
        return self.heads.merge(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])  # [B, H, T, D] merged

    def _cached(self, q: Tensor, cache: SinkhornCache, positions: Tensor) -> Tensor:
        """Queries q [B, H, T, D] at positions [B, T] over the cache's storage -> [B, H, T, D]."""
        local, size = self.n_local, self.config.bucket_size
        backend = choose_cached(self.config.backend, OFFERED, q, cache.keys)
        parts = []
        if local:
            parts.append(cached_window_attention(q[:, :local], cache.keys[:, :local], cache.values[:, :local],
                                                 positions, size, backend))
        if local < self.spec.n_heads:
            parts.append(cached_bucket_attention(q[:, local:], cache.keys[:, local:], cache.values[:, local:],
                                                 cache.chosen[:, local:], cache.choice_weights[:, local:], positions,
                                                 size, backend=backend))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def _sort_cached(self, query_means: Tensor, key_means: Tensor) -> tuple[Tensor, Tensor]:
        """Every bucket's choice from a cache's summaries [B, H', N, D] (as in evaluation: no noise)."""
        config = self.config
        return sort_buckets(query_means, key_means, config.n_sortcut, config.sinkhorn_iter, config.temperature,
                            gumbel=False)

    def _sorted(self, q, k, v, query_means, key_means, dropout) -> Tensor:
        """Sorted heads of a whole sequence q, k, v [B, H', T, D] -> [B, H', T, D], on the chosen back-end."""
        config, size = self.config, self.config.bucket_size
        chosen, weights = sort_buckets(
            query_means, key_means, config.n_sortcut, config.sinkhorn_iter, config.temperature,
            gumbel=self.training,
        )
        backend = choose(config.backend, OFFERED, q, whole=True, dropout=dropout)
        if backend == "cpu":
            return bucket_attention_cpu(q, k, v, chosen, weights, size)[0]
        if backend == "flex":
            return flex_bucket_attention(q, k, v, chosen, weights, size)
        return bucket_attention(q, k, v, chosen, weights, size, dropout)

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None,
                  lengths: Tensor | None = None) -> SinkhornCache:
        lengths = new_lengths(batch, device) if lengths is None else lengths
        self.heads.reserve(max_len, lengths.device)
        model_dtype = computation_dtype(self)
        summary_dtype = model_dtype if dtype is None else torch.promote_types(dtype, model_dtype)
        return SinkhornCache(lengths, max_len, self.spec.n_heads, self.spec.dim_head, self.config.bucket_size,
                             self.config.n_sortcut, dtype, summary_dtype)
