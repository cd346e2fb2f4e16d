"""Block-listed attention on the CPU (nsa_cpu.cpp) for native sparse attention's three branches
(attention/nsa.py): each query token lists n key blocks and is attended by the R query heads of
its key/value head; it sees their keys from lo to its own position (lo = position - window + 1
with a window, else 0), each block's probabilities optionally scaled by a gate. The compressed
branch's pass also makes the block selection (`compressed_selection`).

Forward and backward each take one pass over the queries, reading the keys and values of the
listed blocks in place (after one transposed copy per call): no T x n x block x D gather, no
index_add scatter. The backward keeps q, k, v, the block lists, the output and one log-sum-exp per
query head. Compiled with the other CPU kernels (kernels/cpu.py).

Legend: B batch, G key/value heads, R query heads per key/value head, T queries, S keys, D head
width, n blocks per query.
"""

from __future__ import annotations

import ctypes

import torch
from einops import rearrange
from torch import Tensor

from attnlab.attention.kernels.cpu import library, usable
from attnlab.config import NSAAttentionConfig

MAX_BLOCKS = 64  # blocks per query (nsa_cpu.cpp's Visible)
MAX_HEADS = 64  # query heads per key/value head (nsa_cpu.cpp's MAX_HEADS)
LANES = 16  # keys scored together (one vector)


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


def _pointer(x: Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(0 if x is None else x.data_ptr())


def _forward(q, k, v, blocks, gates, positions, block, window, select=None):
    """-> output, log-sum-exp and, with select = (settings [4], positions [T]), the chosen blocks
    and their selection scores (else None, None)."""
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:-1])
    settings, select_positions = select if select is not None else (None, None)
    chosen = scores = None
    if select is not None:
        chosen = torch.empty(*q.shape[:3], int(settings[3]), dtype=torch.int64)
        scores = q.new_empty(chosen.shape)
    shape = _shape(q, k, blocks, block, window)
    library().nsa_block_attention_forward(
        *map(_pointer, (q, k, v, blocks, gates, positions, out, lse, settings, select_positions, chosen, scores,
                        shape)),
        ctypes.c_float(q.shape[-1] ** -0.5),
    )
    return out, lse, chosen, scores


class _BlockAttention(torch.autograd.Function):
    """Outputs: the attention output; with select also the chosen blocks (no gradient) and their
    selection scores, whose gradient (straight-through top-k) flows back through the compressed
    probabilities."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, gates, positions, block: int, window: int, select):  # noqa: D102
        out, lse, chosen, scores = _forward(q, k, v, blocks, gates, positions, block, window, select)
        ctx.save_for_backward(q, k, v, blocks, gates, positions, out, lse, chosen)
        ctx.block, ctx.window, ctx.settings = block, window, None if select is None else select[0]
        ctx.library = library()  # the backward runs on the library the forward ran on, whatever the settings then
        if chosen is None:
            return out
        ctx.mark_non_differentiable(chosen)
        return out, chosen, scores

    @staticmethod
    def backward(ctx, grad_out, _grad_chosen=None, grad_scores=None):  # noqa: D102
        q, k, v, blocks, gates, positions, out, lse, chosen = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        grad_gates = None if gates is None else torch.empty_like(gates)
        settings = None
        if grad_scores is not None:  # straight-through: the selection scores have a gradient
            settings, grad_scores = ctx.settings, grad_scores.contiguous()
        shape = _shape(q, k, blocks, ctx.block, ctx.window)
        ctx.library.nsa_block_attention_backward(
            *map(_pointer, (q, k, v, blocks, gates, positions, out, lse, grad_out, grad_q, grad_k, grad_v,
                            grad_gates, settings, None if settings is None else chosen, grad_scores, shape)),
            ctypes.c_float(q.shape[-1] ** -0.5),
        )
        return grad_q, grad_k, grad_v, None, grad_gates, None, None, None, None


def fits(n_blocks: int, n_heads: int) -> bool:
    """Whether the kernel takes n_blocks per query and n_heads query heads per key/value head."""
    return n_blocks <= MAX_BLOCKS and n_heads <= MAX_HEADS


def _prepare(q, k, v, n_blocks: int):
    if not usable(q, k, v):
        raise RuntimeError("the NSA CPU kernel needs float32 CPU tensors and the compiled kernel")
    if q.shape[3] > MAX_HEADS:
        raise ValueError(f"the NSA CPU kernel takes at most {MAX_HEADS} query heads per key/value head")
    if n_blocks > MAX_BLOCKS:
        raise ValueError(f"the NSA CPU kernel takes at most {MAX_BLOCKS} blocks per query, got {n_blocks}")
    return q.contiguous(), k.contiguous(), v.contiguous()


def _run(q, k, v, blocks, gates, positions, block, window, select=None):
    blocks = blocks.to(torch.int64).contiguous()
    positions = positions.to(torch.int64).contiguous()
    gates = None if gates is None else gates.to(q.dtype).contiguous()
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, gates)):
        return _BlockAttention.apply(q, k, v, blocks, gates, positions, block, window, select)
    out, _, chosen, scores = _forward(q, k, v, blocks, gates, positions, block, window, select)
    return out if chosen is None else (out, chosen, scores)


def block_attention(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, positions: Tensor, block: int,
                    window: int = 0, gates: Tensor | None = None) -> Tensor:
    """q [B, G, T, R, D] at positions [T]; k, v [B, G, S, D]; blocks [B, G, T, n] (int, -1: an
    empty slot); gates [B, G, T, n] or None -> [B, G, T, R, D]. A query head that sees no key gets
    zeros. float32 CPU tensors; the kernel must be built (`usable`)."""
    q, k, v = _prepare(q, k, v, blocks.shape[-1])
    return _run(q, k, v, blocks, gates, positions, block, window)


def _grouped(q: Tensor, n_groups: int) -> Tensor:
    """[B, H, T, D] -> the kernel's [B, G, T, R, D]."""
    return rearrange(q, "b (g r) t d -> b g t r d", g=n_groups)


def _merged(out: Tensor) -> Tensor:
    """The kernel's [B, G, T, R, D] -> [B, H, T, D] (a view)."""
    return rearrange(out, "b g t r d -> b (g r) t d")


def selected_attention(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, positions: Tensor, block: int,
                       gates: Tensor | None = None) -> Tensor:
    """NSA's selected branch: q [B, H, T, D] at positions [T], each query's blocks [B, G, T, n] (-1:
    empty) of k, v [B, G, S, D], causally; gates [B, G, T, n] or None -> [B, H, T, D]."""
    return _merged(block_attention(_grouped(q, k.shape[1]), k, v, blocks, positions, block, 0, gates))


def sliding_attention(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    """NSA's sliding branch for a whole sequence: q [B, H, T, D], k, v [B, G, T, D], each query seeing
    the last `window` tokens -> [B, H, T, D]. Blocks of 16 keys, wider for long windows so that a
    window spans at most MAX_BLOCKS of them."""
    block = LANES * -(-window // (LANES * (MAX_BLOCKS - 1)))
    positions = torch.arange(q.shape[2])
    blocks = window_blocks(positions, window, block).expand(*k.shape[:2], -1, -1)
    return _merged(block_attention(_grouped(q, k.shape[1]), k, v, blocks, positions, block, window))


def compressed_selection(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor,
                         config: NSAAttentionConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Native sparse attention's compressed branch and block selection for queries at positions
    [T] (attention/nsa.py: compressed_attention_chunk).

    q [B, H, T, D] (no rotary); keys, values [B, G, 1 + N, D]: the memory slot, then the compressed
    blocks; a query sees the memory slot and the blocks complete at its position.
    -> the branch output [B, H, T, D], the selected blocks [B, G, T, num_selected] (ascending,
    -1 for empty slots; `choose_blocks` in nsa_cpu.cpp) and their selection scores [B, G, T,
    num_selected] (0 for empty slots), which carry a gradient back to q, keys and values when one
    flows to them (straight-through top-k)."""
    n_keys = keys.shape[2]
    block = LANES * -(-n_keys // (LANES * MAX_BLOCKS))  # key blocks of the kernel: at most MAX_BLOCKS per query
    n_blocks = -(-n_keys // block)
    positions = positions.to(torch.int64).contiguous()
    # the last key each query sees: key 0 is the memory slot, key i + 1 compressed block i, complete
    # once its last token is at or before the query; the query lists kernel blocks 0 .. last // block
    last = torch.clamp((positions + 1 - config.compress_block_size) // config.compress_stride + 1, min=0)
    grouped, keys, values = _prepare(_grouped(q, keys.shape[1]), keys, values, n_blocks)
    settings = torch.tensor([config.compress_block_size, config.compress_stride, config.selection_block_size,
                             config.num_selected], dtype=torch.int64)
    prefixes = torch.empty(0, n_blocks, dtype=torch.int64)
    out, chosen, scores = _run(grouped, keys, values, prefixes, None, last, block, 0, (settings, positions))
    return _merged(out), chosen, scores
