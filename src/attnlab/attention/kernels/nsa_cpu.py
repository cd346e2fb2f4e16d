"""The `cpu` back-end of native sparse attention (attention/nsa.py): block-listed attention
(nsa_cpu.cpp) for all three branches.

Each query token lists n key blocks and is attended by the R query heads of its key/value head; it
sees their keys from lo to its own position (lo = position - window + 1 with a window, else 0), each
block's probabilities optionally scaled by a gate. Forward and backward each take one pass over
the queries, reading the keys and values of the listed blocks in place (after one transposed copy
per call): no T x n x block x D gather, no index_add scatter. The compressed branch's pass also
makes the block selection (`compressed_selection`), so its T x N scores never exist in memory.

Two torch custom ops with fake and autograd registrations, so a model using them compiles whole:
`attnlab::nsa_block_attention_cpu` (selected and sliding branches) and
`attnlab::nsa_compressed_selection_cpu` (compressed branch and selection, whose selection scores
carry a gradient for straight-through top-k). Compiled with the other CPU kernels (kernels/cpu.py).

Legend: B batch, G key/value heads, R query heads per key/value head, T queries, S keys, D head
width, n blocks per query, N compressed keys (the memory slot included).
"""

from __future__ import annotations

import ctypes

import torch
from einops import rearrange
from torch import Tensor

from attnlab.attention.kernels.cpu import library, pointer, require

MAX_BLOCKS = 64  # blocks per query (nsa_cpu.cpp's Visible)
MAX_HEADS = 64  # query heads per key/value head (nsa_cpu.cpp's MAX_HEADS)
KEY_BLOCK = 16  # key blocks are multiples of 16: whole vectors of nsa_cpu.cpp (16 floats with AVX-512, else 8)


def fits(n_blocks: int, heads_per_group: int) -> bool:
    """Whether the kernel takes n_blocks per query and heads_per_group query heads per key/value head."""
    return n_blocks <= MAX_BLOCKS and heads_per_group <= MAX_HEADS


def window_blocks(positions: Tensor, window: int, block: int) -> Tensor:
    """[T, ceil((window - 1) / block) + 1]: the blocks that hold positions p - window + 1 .. p, in
    ascending order, -1 for blocks before the sequence start."""
    n_blocks = (window - 1 + block - 1) // block + 1
    last = positions // block
    blocks = last[:, None] - torch.arange(n_blocks - 1, -1, -1, device=positions.device)
    return torch.where(blocks >= 0, blocks, -1)


def _shape(q: Tensor, k: Tensor, blocks: Tensor, block: int, window: int) -> Tensor:
    """The kernel's Shape. blocks [B, G, T, n], or an empty [0, n]: every query lists blocks
    0 .. position // block (the compressed branch's prefixes, never materialised)."""
    batch, n_groups, n_queries, n_heads, dim = q.shape
    prefix = int(blocks.numel() == 0)
    return torch.tensor([batch * n_groups, n_queries, n_heads, dim, k.shape[2], blocks.shape[-1], block, window,
                         prefix], dtype=torch.int64)


def _forward(q, k, v, blocks, gates, positions, block, window, settings=None, select_positions=None):
    """-> output, log-sum-exp and, with settings (compress block, stride, selection block,
    n_selected) and the queries' token positions, the chosen blocks and their selection scores."""
    require(q, k, v)
    if q.shape[3] > MAX_HEADS:
        raise ValueError(f"the NSA CPU kernel takes at most {MAX_HEADS} query heads per key/value head")
    if blocks.shape[-1] > MAX_BLOCKS:
        raise ValueError(f"the NSA CPU kernel takes at most {MAX_BLOCKS} blocks per query, got {blocks.shape[-1]}")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:-1])
    chosen = scores = None
    if settings is not None:
        chosen = torch.empty(*q.shape[:3], int(settings[3]), dtype=torch.int64)
        scores = q.new_empty(chosen.shape)
    shape = _shape(q, k, blocks, block, window)
    library().nsa_block_attention_forward(
        *map(pointer, (q, k, v, blocks, gates, positions, out, lse, settings, select_positions, chosen, scores,
                       shape)),
        ctypes.c_float(q.shape[-1] ** -0.5),
    )
    return out, lse, chosen, scores


def _backward(grad_out, q, k, v, blocks, gates, positions, out, lse, block, window,
              settings=None, chosen=None, grad_scores=None):
    # every tensor whose pointer the kernel reads is bound to a name here: a temporary made inside
    # the call's argument list could be freed before the kernel runs
    q, k, v, grad_out = q.contiguous(), k.contiguous(), v.contiguous(), grad_out.contiguous()
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    grad_gates = torch.empty_like(gates)
    shape = _shape(q, k, blocks, block, window)
    library().nsa_block_attention_backward(
        *map(pointer, (q, k, v, blocks, gates, positions, out, lse, grad_out, grad_q, grad_k, grad_v,
                       grad_gates, settings, chosen, grad_scores, shape)),
        ctypes.c_float(q.shape[-1] ** -0.5),
    )
    return grad_q, grad_k, grad_v, grad_gates


# ----------------------------------------------------------------------------------------------
# attnlab::nsa_block_attention_cpu: the selected and sliding branches


@torch.library.custom_op("attnlab::nsa_block_attention_cpu", mutates_args=())
def block_attention(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, gates: Tensor, positions: Tensor, block: int,
                    window: int) -> tuple[Tensor, Tensor]:
    """q [B, G, T, R, D] at positions [T] (int64); k, v [B, G, S, D]; blocks [B, G, T, n] (int64, -1:
    an empty slot); gates [B, G, T, n], or empty [0] for none -> (output [B, G, T, R, D], log-sum-exp
    [B, G, T, R]). A query head that sees no key gets zeros."""
    out, lse, _, _ = _forward(q, k, v, blocks.contiguous(), gates.contiguous(), positions.contiguous(), block, window)
    return out, lse


@block_attention.register_fake
def _(q, k, v, blocks, gates, positions, block, window):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1])


@torch.library.custom_op("attnlab::nsa_block_attention_cpu_backward", mutates_args=())
def block_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, gates: Tensor,
                             positions: Tensor, out: Tensor, lse: Tensor, block: int, window: int
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward(grad_out, q, k, v, blocks.contiguous(), gates.contiguous(), positions.contiguous(), out, lse,
                     block, window)


@block_attention_backward.register_fake
def _(grad_out, q, k, v, blocks, gates, positions, out, lse, block, window):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), gates.new_empty(gates.shape)


def _block_setup(ctx, inputs, output) -> None:
    q, k, v, blocks, gates, positions, block, window = inputs
    ctx.save_for_backward(q, k, v, blocks, gates, positions, *output)
    ctx.block, ctx.window = block, window


def _block_backward(ctx, grad_out, _grad_lse):
    q, k, v, blocks, gates, positions, out, lse = ctx.saved_tensors
    grad_q, grad_k, grad_v, grad_gates = block_attention_backward(
        grad_out, q, k, v, blocks, gates, positions, out, lse, ctx.block, ctx.window)
    return grad_q, grad_k, grad_v, None, grad_gates, None, None, None


block_attention.register_autograd(_block_backward, setup_context=_block_setup)


# ----------------------------------------------------------------------------------------------
# attnlab::nsa_compressed_selection_cpu: the compressed branch and the block selection


def _compressed_layout(n_keys: int, positions: Tensor, compress_block: int, stride: int) -> tuple[int, Tensor]:
    """The kernel blocks of the compressed keys (at most MAX_BLOCKS per query) and the last kernel
    key each query sees: key 0 is the memory slot, key i + 1 compressed block i, complete once its
    last token is at or before the query."""
    block = KEY_BLOCK * -(-n_keys // (KEY_BLOCK * MAX_BLOCKS))
    last = torch.clamp((positions + 1 - compress_block) // stride + 1, min=0)
    return block, last


@torch.library.custom_op("attnlab::nsa_compressed_selection_cpu", mutates_args=())
def compressed_selection(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, compress_block: int,
                         stride: int, selection_block: int, n_selected: int, straight_through: bool
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The compressed branch and block selection (attention/nsa.py: `compressed_attention` and
    `choose_blocks`) for queries q [B, G, T, R, D] (no rotary) at positions [T] (int64); keys,
    values [B, G, N, D]: the memory slot, then the compressed blocks. -> (output [B, G, T, R, D],
    the chosen blocks [B, G, T, n] (ascending, -1 for empty slots), their selection scores
    [B, G, T, n] (0 for empty slots), the log-sum-exp [B, G, T, R]). straight_through: the
    scores carry their gradient back to q, keys and values (straight-through top-k)."""
    settings = _settings(compress_block, stride, selection_block, n_selected)
    block, last = _compressed_layout(keys.shape[2], positions, compress_block, stride)
    prefixes = torch.empty(0, -(-keys.shape[2] // block), dtype=torch.int64)
    out, lse, chosen, scores = _forward(q, keys, values, prefixes, None, last, block, 0, settings,
                                        positions.contiguous())
    return out, chosen, scores, lse


def _settings(compress_block: int, stride: int, selection_block: int, n_selected: int) -> Tensor:
    return torch.tensor([compress_block, stride, selection_block, n_selected], dtype=torch.int64)


@compressed_selection.register_fake
def _(q, keys, values, positions, compress_block, stride, selection_block, n_selected, straight_through):
    chosen = q.new_empty(*q.shape[:3], n_selected, dtype=torch.int64)
    return q.new_empty(q.shape), chosen, q.new_empty(chosen.shape), q.new_empty(q.shape[:-1])


@torch.library.custom_op("attnlab::nsa_compressed_selection_cpu_backward", mutates_args=())
def compressed_selection_backward(grad_out: Tensor, grad_scores: Tensor, q: Tensor, keys: Tensor, values: Tensor,
                                  positions: Tensor, out: Tensor, chosen: Tensor, lse: Tensor, compress_block: int,
                                  stride: int, selection_block: int, n_selected: int, straight_through: bool
                                  ) -> tuple[Tensor, Tensor, Tensor]:
    block, last = _compressed_layout(keys.shape[2], positions, compress_block, stride)
    prefixes = torch.empty(0, -(-keys.shape[2] // block), dtype=torch.int64)
    selection = (_settings(compress_block, stride, selection_block, n_selected), chosen, grad_scores.contiguous())
    grad_q, grad_keys, grad_values, _ = _backward(
        grad_out, q, keys, values, prefixes, torch.empty(0), last, out, lse, block, 0,
        *(selection if straight_through else (None, None, None)),
    )
    return grad_q, grad_keys, grad_values


@compressed_selection_backward.register_fake
def _(grad_out, grad_scores, q, keys, values, positions, out, chosen, lse, compress_block, stride, selection_block,
      n_selected, straight_through):
    return q.new_empty(q.shape), keys.new_empty(keys.shape), values.new_empty(values.shape)


def _compressed_setup(ctx, inputs, output) -> None:
    q, keys, values, positions, *ctx.settings = inputs
    out, chosen, _, lse = output
    ctx.save_for_backward(q, keys, values, positions, out, chosen, lse)


def _compressed_backward(ctx, grad_out, _grad_chosen, grad_scores, _grad_lse):
    q, keys, values, positions, out, chosen, lse = ctx.saved_tensors
    *settings, straight_through = ctx.settings
    if grad_scores is None:  # the scores were not used
        grad_scores, straight_through = out.new_zeros(chosen.shape), False
    grad_q, grad_keys, grad_values = compressed_selection_backward(
        grad_out, grad_scores, q, keys, values, positions, out, chosen, lse, *settings, straight_through)
    return grad_q, grad_keys, grad_values, None, None, None, None, None, None


compressed_selection.register_autograd(_compressed_backward, setup_context=_compressed_setup)


# ----------------------------------------------------------------------------------------------
# The branches as attention/nsa.py calls them: [B, H, T, D] in and out


def _grouped(q: Tensor, n_groups: int) -> Tensor:
    """[B, H, T, D] -> the kernel's [B, G, T, R, D]."""
    return rearrange(q, "b (g r) t d -> b g t r d", g=n_groups)


def _merged(out: Tensor) -> Tensor:
    """The kernel's [B, G, T, R, D] -> [B, H, T, D] (a view)."""
    return rearrange(out, "b g t r d -> b (g r) t d")


def selected_attention(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, block: int,
                       gates: Tensor | None = None) -> Tensor:
    """NSA's selected branch for a whole sequence: q [B, H, T, D], each query's blocks [B, G, T, n]
    (-1: empty) of k, v [B, G, T, D], causally; gates [B, G, T, n] or None -> [B, H, T, D]."""
    positions = torch.arange(q.shape[2])
    gates = q.new_empty(0) if gates is None else gates
    out, _ = block_attention(_grouped(q, k.shape[1]), k, v, blocks, gates, positions, block, 0)
    return _merged(out)


def sliding_attention(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    """NSA's sliding branch for a whole sequence: q [B, H, T, D], k, v [B, G, T, D], each query seeing
    the last `window` tokens -> [B, H, T, D]. Blocks of 16 keys, wider for long windows so that a
    window spans at most MAX_BLOCKS of them."""
    block = KEY_BLOCK * -(-window // (KEY_BLOCK * (MAX_BLOCKS - 1)))
    positions = torch.arange(q.shape[2])
    blocks = window_blocks(positions, window, block).expand(*k.shape[:2], -1, -1)
    out, _ = block_attention(_grouped(q, k.shape[1]), k, v, blocks, q.new_empty(0), positions, block, window)
    return _merged(out)


def compressed_attention(q: Tensor, keys: Tensor, values: Tensor, compress_block: int, stride: int,
                         selection_block: int, n_selected: int, straight_through: bool
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """NSA's compressed branch and selection for a whole sequence: q [B, H, T, D] (no rotary);
    keys, values [B, G, 1 + N, D] -> (output [B, H, T, D], chosen blocks [B, G, T, n] (-1: empty),
    selection scores [B, G, T, n])."""
    positions = torch.arange(q.shape[2])
    out, chosen, scores, _ = compressed_selection(_grouped(q, keys.shape[1]), keys, values, positions, compress_block,
                                                  stride, selection_block, n_selected, straight_through)
    return _merged(out), chosen, scores
