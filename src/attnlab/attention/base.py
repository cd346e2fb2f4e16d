"""What every attention variant shares: the interface the model relies on (`Attention`), its
construction spec, the cache interface, the head projections, rotary positions and the naive
masked attention that tests use as the oracle.

The contract (docs/attention.md), for every registered variant:

    forward(x, cache=None) -> y     cache None: the whole sequence in parallel (training);
                                    cache given: x holds the next T >= 1 tokens, cache updated in place
    new_cache(batch, max_len, device, dtype) -> KVCache
    KVCache.length, KVCache.truncate(n)   exact rollback (speculative decoding)
    KVCache.truncate_rows(RowLengths)   optional (per_row_rollback): a length per row
    aux_losses: dict[str, Tensor]   named auxiliary losses of the last training forward
    after_optimizer_step()          explicit per-step state updates (routing centroids)
    keys_per_query(config, ...)     keys a query is scored against, for the FLOP count

Dimension legend: B batch, T new tokens, S keys, H query heads, G key/value heads, D head width.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from einops import repeat
from torch import Tensor, nn


@dataclass(kw_only=True)
class AttentionSpec:
    """The shape of one attention layer, common to all variants."""

    dim: int  # model width
    n_heads: int  # query heads H
    dim_head: int  # head width D
    n_kv_heads: int  # key/value heads G (H must be a multiple)
    dropout: float  # attention-probability dropout, training only
    max_seq_len: int
    layer_index: int  # 0-based, for per-layer options
    n_layers: int
    rotary: RotaryEmbedding | None  # shared positions module, None when positions are not rotary

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"heads ({self.n_heads}) must be a multiple of kv_heads ({self.n_kv_heads})")


class KVCache:
    """One layer's decoding state, static: storage preallocated to `max_len` tokens and read through
    masks and gathers, and the tokens fed counted per row in `lengths` ([B], one tensor shared by
    every layer of a model's cache and advanced by ModelCache after each forward). So a decode step
    has the same shapes every time, whatever the position: it compiles once. Rolling back
    (speculative decoding) only changes `lengths`, for all rows or row by row: whatever lies past a
    row's length is never read, and its next tokens overwrite it.

    `prefill` is True during a forward while every row is empty (ModelCache sets it): the layer may
    then compute the chunk as a whole sequence, on its fastest back-end, and fill its storage from it.
    """

    def __init__(self, lengths: Tensor, max_len: int) -> None:
        self.lengths = lengths  # [B] tokens fed per row
        self.max_len = max_len
        self.prefill = False

    def positions(self, n_new: int) -> Tensor:
        """[B, T]: the positions of each row's next n_new tokens."""
        return self.lengths[:, None] + torch.arange(n_new, device=self.lengths.device)

    def advance(self, n_new: int) -> None:
        """Count n_new more tokens in every row: ModelCache does it once for all its layers; a layer's
        cache used on its own needs it after each forward."""
        self.lengths += n_new


def new_lengths(batch: int, device=None) -> Tensor:
    """The per-row token counts [B] of an empty cache."""
    return torch.zeros(batch, dtype=torch.long, device=device)


def computation_dtype(module: nn.Module) -> torch.dtype:
    """The floating dtype a module computes in: that of its first floating-point parameter or buffer
    (an int8 projection's scale, where its weight is int8); float32 if it has none."""
    tensors = (*module.parameters(), *module.buffers())
    return next((tensor.dtype for tensor in tensors if tensor.is_floating_point()), torch.float32)


def branch_free(tensor: Tensor) -> bool:
    """Whether a compiled decode step on tensor's device computes both sides of a data-dependent
    choice and keeps one (torch.where) rather than branching (torch.cond): on CUDA, where the step
    replays as a CUDA graph, which cannot hold a torch.cond (inductor would skip graphs for the whole
    step). Elsewhere the branch skips work most steps do not need."""
    return tensor.is_cuda


def compiled_branch(predicate: Tensor, if_true, if_false, operands: tuple, shapes: tuple) -> tuple[Tensor, ...]:
    """torch.cond(predicate, if_true, if_false, operands) for a compiled step, whose sides return
    tensors of the given shapes. torch.cond requires both sides' outputs in one stride order, and a
    tensor's stride along a size-1 dimension (batch 1) is whatever made it, so the two sides of a
    batch-1 step could differ (and `contiguous()` changes nothing there): each side returns its
    tensors flat, one dimension, and they are viewed in their shapes after the branch. The sides must
    not return views of their operands or of tensors they read (torch.cond's rule): clone those."""

    def flat(function):
        def run(*arguments):
            return tuple(tensor.reshape(-1) for tensor in function(*arguments))
        return run

    outputs = torch.cond(predicate, flat(if_true), flat(if_false), operands)
    return tuple(output.view(shape) for output, shape in zip(outputs, shapes, strict=True))


def window_positions(positions: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """The positions of each query's sliding window, itself last: positions [B, T] -> (index [B, T, W]
    clamped at 0, valid [B, T, W])."""
    index = positions[..., None] - torch.arange(window - 1, -1, -1, device=positions.device)
    return index.clamp(min=0), index >= 0


def write_rows(store: Tensor, new: Tensor, positions: Tensor) -> None:
    """store [B, H, L, ...] at each row's own positions [B, T] <- new [B, H, T, ...], in place. Indexes
    the storage itself, not a view of it: a compiled step then writes the few rows in place rather
    than copying the whole storage."""
    rows = torch.arange(new.shape[0], device=new.device)[:, None, None]  # [B, 1, 1]
    heads = torch.arange(new.shape[1], device=new.device)[None, :, None]  # [1, H, 1]
    store.index_put_((rows, heads, positions[:, None, :]), new.to(store.dtype))  # [B, H, T] places


def select_rows(x: Tensor, index: Tensor) -> Tensor:
    """x [B, H, S, D] at positions index [B, H, *] -> [B, H, *, D]. Whole rows of D numbers move
    (index_select, whose backward is index_add): several times faster than a gather with the index
    expanded over D."""
    batch, n_heads, length, width = x.shape
    base = torch.arange(batch * n_heads, device=x.device).view(batch, n_heads, *[1] * (index.dim() - 2)) * length
    return x.reshape(-1, width).index_select(0, (index + base).flatten()).view(*index.shape, width)


class RotaryEmbedding(nn.Module):
    """Rotary positions (Su et al., RoFormer, arXiv 2104.09864), rotate-half layout.

    The cos/sin table is built once for a power-of-two length and sliced by absolute position,
    so the same position always gets bit-identical factors, whatever the chunking.
    """

    def __init__(self, dim_head: int, theta: float = 10000.0, max_seq_len: int = 2048) -> None:
        super().__init__()
        if dim_head % 2:
            raise ValueError("rotary positions need an even head width")
        self.dim_head = dim_head
        self.theta = theta
        self._build(max_seq_len)

    def _build(self, length: int, device: torch.device | None = None) -> None:
        """The tables for positions < length rounded up to a power of two. Built outside inference
        mode even when a cache made under it asks (decoding grows them): an inference tensor could
        not be saved by a later training step's backward."""
        length = 1 << max(0, math.ceil(math.log2(max(length, 1))))
        with torch.inference_mode(False):
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.dim_head, 2, dtype=torch.float64) / self.dim_head))
            angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)  # [L, D/2]
            self.register_buffer("cos", angles.cos().float().to(device), persistent=False)
            self.register_buffer("sin", angles.sin().float().to(device), persistent=False)

    def forward(self, x: Tensor, positions: int | Tensor) -> Tensor:
        """x [B, H, T, D] at positions positions.. (an int: the first of T consecutive ones) or at
        positions [B, T] (each row's own; the table must hold them: `reserve`) -> rotated x."""
        cos, sin = self._factors(x, positions)
        return self._rotate(x, cos, sin)

    def rotate_pair(self, q: Tensor, k: Tensor, positions: int | Tensor) -> tuple[Tensor, Tensor]:
        """forward(q), forward(k) for queries [B, H, T, D] and keys [B, G, T, D] at the same
        positions, rotated together: the same values, half the operations."""
        cos, sin = self._factors(q, positions)
        rotated = self._rotate(torch.cat((q, k), dim=1), cos, sin)
        return rotated.split((q.shape[1], k.shape[1]), dim=1)

    @staticmethod
    def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _factors(self, x: Tensor, positions: int | Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [T, D/2] (or [B, 1, T, D/2] for per-row positions) in x's dtype."""
        if isinstance(positions, Tensor):  # [B, T]; a cache reserved the table for its max_len
            return self.cos[positions].to(x.dtype)[:, None], self.sin[positions].to(x.dtype)[:, None]
        length = x.shape[-2]
        self.reserve(positions + length, x.device)
        cos, sin = self.cos[positions : positions + length], self.sin[positions : positions + length]  # [T, D/2]
        return cos.to(x.dtype), sin.to(x.dtype)

    def reserve(self, end: int, device: torch.device | None = None) -> None:
        """Grow the table to hold positions < end (outside any compiled step: caches do it when made)."""
        if end > self.cos.shape[0]:
            self._build(end, device or self.cos.device)


def expand_kv(x: Tensor, n_heads: int) -> Tensor:
    """[B, G, S, D] -> [B, H, S, D], each key/value head serving H/G query heads (GQA)."""
    groups = n_heads // x.shape[1]
    if groups == 1:
        return x
    return repeat(x, "b g s d -> b (g r) s d", r=groups)


def overlapping_windows(x: Tensor, size: int, step: int) -> Tensor:
    """Windows of `size` rows every `step` rows along dim 2: x [B, H, S, D] -> [B, H, N, size, D]
    with N = (S - size) // step + 1 (size a multiple of step). The same values as
    x.unfold(2, size, step).transpose(-1, -2), built from size / step shifted slices, whose backward
    is a few slice additions (unfold's backward is a slow general kernel)."""
    if size % step:
        raise ValueError(f"window size {size} must be a multiple of its step {step}")
    batch, n_heads, _, width = x.shape
    count = (x.shape[2] - size) // step + 1
    parts = [x[:, :, i * step : i * step + count * step].reshape(batch, n_heads, count, step, width)
             for i in range(size // step)]
    return torch.cat(parts, dim=-2)


def masked_attention(q: Tensor, keys: Tensor, values: Tensor, visible: Tensor) -> Tensor:
    """Attention of a few queries over a cache's whole storage: q [B, H, T, D], keys and values
    [B, G, L, D], visible bool [B, 1, T, L] -> [B, H, T, D]. torch's fused attention with the mask,
    each key/value head serving its group of query heads in place (no copy of the storage per step).
    Compiled, the fused call was faster at long contexts than products and a softmax written out
    (bench/static_cache_reference.py; docs/benchmarks.md "Compiled decoding")."""
    return F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=visible,
                                          enable_gqa=keys.shape[1] != q.shape[1])


def naive_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """The test oracle: softmax(q k^T / sqrt(D)) v over the keys `allowed` permits.

    q [B, H, T, D], k and v [B, G, S, D], allowed bool broadcastable to [B, H, T, S].
    Rows with no allowed key return zeros. Quadratic on purpose: clarity over speed.
    """
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhts,bhsd->bhtd", probs, v)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, dropout: float) -> Tensor:
    """torch's fused attention, with key/value heads expanded for GQA when needed.

    On CUDA, queries that are not the whole key sequence (decoding through a cache: one new key
    length per step) never use the cuDNN kernel, which builds a plan per shape; flash,
    memory-efficient or math kernels take them."""
    if k.shape[1] != q.shape[1]:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    if q.is_cuda and q.shape[2] != k.shape[2]:
        with _without_cudnn():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout)


def _without_cudnn():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


class HeadProjections(nn.Module):
    """Input -> per-head queries, keys and values; heads -> output. Every variant holds one as
    `heads`, so the weights of every attention type are named alike (`heads.to_q.weight`, ...)."""

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__()
        self.spec = spec
        inner_q, inner_kv = spec.n_heads * spec.dim_head, spec.n_kv_heads * spec.dim_head
        self.to_q = nn.Linear(spec.dim, inner_q, bias=False)
        self.to_k = nn.Linear(spec.dim, inner_kv, bias=False)
        self.to_v = nn.Linear(spec.dim, inner_kv, bias=False)
        self.to_out = nn.Linear(inner_q, spec.dim, bias=False)

    # Head split and merge are a view and a transpose rather than einops.rearrange: the same
    # layout, but rearrange's per-call parsing cost is paid 4 times per layer per decoded token.

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, dim] -> q [B, H, T, D], k and v [B, G, T, D], before rotary positions."""
        dim_head = self.spec.dim_head
        q = self.to_q(x).unflatten(-1, (-1, dim_head)).transpose(1, 2)  # b t (h d) -> b h t d
        k = self.to_k(x).unflatten(-1, (-1, dim_head)).transpose(1, 2)  # b t (g d) -> b g t d
        v = self.to_v(x).unflatten(-1, (-1, dim_head)).transpose(1, 2)  # b t (g d) -> b g t d
        return q, k, v

    def rotate(self, q: Tensor, k: Tensor, positions: int | Tensor) -> tuple[Tensor, Tensor]:
        """Rotary positions for q [B, H, T, D] and k [B, G or H, T, D] at `positions` (an int, the
        first of T, or [B, T]; RotaryEmbedding.forward); unchanged without rotary."""
        if self.spec.rotary is None:
            return q, k
        return self.spec.rotary.rotate_pair(q, k, positions)

    def split(self, x: Tensor, positions: int | Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, dim] at `positions` -> rotated q [B, H, T, D], k [B, G, T, D], and v."""
        q, k, v = self.project(x)
        q, k = self.rotate(q, k, positions)
        return q, k, v

    def reserve(self, max_len: int, device=None) -> None:
        """Rotary factors for positions < max_len (a cache of max_len tokens reads them by index)."""
        if self.spec.rotary is not None:
            self.spec.rotary.reserve(max_len, device)

    def merge(self, y: Tensor) -> Tensor:
        """y [B, H, T, D] -> [B, T, dim]."""
        return self.to_out(y.transpose(1, 2).flatten(2))  # b h t d -> b t (h d)


class Attention(nn.Module):
    """The interface every attention variant implements, and what the model relies on.

    A variant subclasses it, registers itself in `attnlab.registry.ATTENTION` under its kind, names
    its options dataclass in `config_class` (read from `model.attention.<kind>`), and implements
    `forward`, `new_cache` and `keys_per_query`. The hooks have defaults: no auxiliary losses and
    nothing to do after an optimiser step.

    `legacy_keys` maps weight names of earlier attnlab releases (relative to the layer) to today's,
    applied whenever a state dict is loaded, so old checkpoints keep loading.
    """

    config_class: ClassVar[type | None] = None
    legacy_keys: ClassVar[dict[str, str]] = {}

    def __init__(self, spec: AttentionSpec, config: Any) -> None:
        super().__init__()
        self.spec, self.config = spec, config
        self.heads = HeadProjections(spec)
        self.aux_losses: dict[str, Tensor] = {}  # named auxiliary losses of the last training forward
        self.register_load_state_dict_pre_hook(_rename_legacy_keys)

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        """x [B, T, dim] -> [B, T, dim]; with a cache, x holds the next T tokens (cache updated)."""
        raise NotImplementedError

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None, lengths: Tensor | None = None) -> KVCache:
        """Empty storage for `batch` rows of up to max_len tokens; lengths [B]: the model cache's
        shared counts (a new zero tensor when None). Reserves the rotary table to max_len."""
        raise NotImplementedError

    @staticmethod
    def keys_per_query(config: Any, seq_len: int, n_heads: int, layer_index: int) -> float:
        """Keys a query is scored against, averaged over the layer's heads (flops.py)."""
        raise NotImplementedError

    def after_optimizer_step(self) -> None:
        """Called once per optimiser step by the training loop; explicit state updates go here."""

    def migrate_state_dict(self, state_dict: dict[str, Tensor], prefix: str) -> None:
        """Rewrite this layer's weights of an earlier layout in place (default: rename legacy_keys)."""
        for old, new in self.legacy_keys.items():
            if prefix + old in state_dict and prefix + new not in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)


def _rename_legacy_keys(module: Attention, state_dict: dict[str, Tensor], prefix: str, *args) -> None:
    module.migrate_state_dict(state_dict, prefix)


# ----------------------------------------------------------------------------------------------
# Forwards that run again (reversible layers' backward, activation checkpointing) must not count
# per-step statistics twice. A module-level flag rather than a thread-local: the autograd engine
# may run the backward on another thread, and torch.compile can guard on a plain global.

_recomputing = False


def is_recomputing() -> bool:
    """True while a backward pass recomputes a forward (model/reversible.py sets it)."""
    return _recomputing


@contextmanager
def recomputing() -> Iterator[None]:
    global _recomputing
    previous, _recomputing = _recomputing, True
    try:
        yield
    finally:
        _recomputing = previous
