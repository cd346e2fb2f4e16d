"""Native sparse attention (NSA): compressed, selected and sliding branches under per-head gates.

"Native Sparse Attention: Hardware-Aligned and Natively Trainable Sparse Attention" (Yuan et al.,
DeepSeek, arXiv 2502.11089). For every query (eq. 5):

    o = g_cmp * Attn(q, compressed K/V) + g_slc * Attn(q, selected K/V) + g_win * Attn(q, last w K/V)

- Compressed (eq. 7): blocks of `compress_block_size` (l) keys starting every `compress_stride` (d)
  tokens, each turned into one key and one value by a learned network that sees intra-block
  positions (MLP by default; mean-pool, a strided convolution and attention-pool as options).
  A query sees a compressed block once the block is complete (its last token is at or before the
  query), plus one learned memory key/value that every query sees, so the softmax is never empty.
- Selected (eq. 8-11): the compressed attention probabilities, summed over the query heads of a
  key/value group (eq. 10) and spread over the blocks of `selection_block_size` (l') they overlap
  (eq. 9), score the selection blocks; each query attends, causally, to the tokens of its top
  `num_selected` blocks. The initial block and the query's own block are always among them (as in
  the paper's "1 initial block and local blocks").
- Sliding: the last `sliding_window_size` tokens (attention/local.py).
- Gates: a sigmoid of a linear map of the input, one per head and branch.

Deliberate departures, each for exact causality or for memory:
- The compressed branch's query and compressed keys carry no rotary positions (positions enter the
  compression network as learned intra-block embeddings); the selected and sliding branches use
  rotated queries and keys, like every other attention in attnlab.
- Eq. 9's overlap sum is computed per stride unit: a compressed block's probability counts for
  every stride-long unit it covers, a selection block sums its units. This needs `compress_stride`
  to divide both block sizes (checked).
- `use_diff_topk` multiplies each selected block's values by 1 + s - stop_gradient(s), s its
  selection score: exactly 1 in the forward pass, while s receives a gradient (straight-through).

Memory (the torch path): queries run in chunks of `query_chunk_size`. The selected branch gathers the
chunk's chosen blocks from a block view of the keys (index_select) and its custom backward
recomputes them and scatters gradients with index_add, saving only q, k, v, the indices, the output
and the log-sum-exp: O(T * n * l' * D) transient, O(T * D) saved. The compressed branch's
T x (T / d) probabilities live one chunk at a time: its custom backward recomputes them from the
saved log-sum-exp (with straight-through top-k, whose selection scores need a gradient, each
chunk is checkpointed instead). No T x T tensor, no T x blocks x block x D tensor.

Back-ends (`backend`): torch (here), flex and triton (attention/kernels/), one semantics.

The CPU kernel (attention/kernels/nsa_cpu.py): on the CPU in float32, for whole sequences (training
and prefill; cached decoding keeps the torch path), the torch back-end runs all three branches on a
compiled kernel: each query lists its key blocks (the compressed blocks it sees, its selected
blocks, the blocks of its window) and reads their keys in place; the compressed pass also makes the
selection and returns the chosen blocks' scores (differentiable, for straight-through top-k).
Without a C++ compiler, or with ATTNLAB_CPU_KERNELS=0, the torch path above runs.

Legend: B batch, T queries, S keys (cached + new), H query heads, G key/value heads, R = H / G query
heads per group, D head width, C chunk of queries, N compressed blocks, M selection blocks,
n selected blocks per query, l compress block, d stride, l' selection block (`block`), U stride units.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from attnlab.attention.base import AttentionSpec, KVCache, RowLengths, overlapping_windows, write_rows
from attnlab.attention.gathered import additive_mask
from attnlab.attention.kernels import nsa_cpu, nsa_flex, nsa_triton
from attnlab.attention.kernels.flex import worth_flex
from attnlab.attention.kernels.flex_local import flex_local_attention
from attnlab.attention.local import local_attention
from attnlab.config import NSAAttentionConfig
from attnlab.errors import ConfigError
from attnlab.model.linear import Linear
from attnlab.registry import ATTENTION

# ----------------------------------------------------------------------------------------------
# Pure functions


def n_complete_blocks(n_tokens: int, block: int, stride: int) -> int:
    """How many compressed blocks (starts 0, d, 2d, ...; length l) lie within the first n tokens."""
    return 0 if n_tokens < block else (n_tokens - block) // stride + 1


def per_group(mask: Tensor) -> Tensor:
    """A mask over queries built from positions [C] ([C, X]) or per-row positions [B, C]
    ([B, C, X]), made to broadcast against [B, G, C, X]."""
    return mask if mask.dim() == 2 else mask[:, None]


def compressed_visibility(positions: Tensor, n_blocks: int, config: NSAAttentionConfig) -> Tensor:
    """[C, 1 + N] ([B, C, 1 + N] for per-row positions [B, C]): the memory slot, then the
    compressed blocks complete at each query position."""
    block_end = torch.arange(n_blocks, device=positions.device) * config.compress_stride
    block_end = block_end + config.compress_block_size - 1  # last token of each block
    visible = block_end <= positions[..., None]  # [(B,) C, N]
    return F.pad(visible, (1, 0), value=True)  # the memory slot is always visible


def compressed_scores(q_grouped: Tensor, keys: Tensor, visible: Tensor) -> Tensor:
    """q_grouped [B, G, R, C, D], keys [B, G, 1 + N, D], visible [C, 1 + N] or [B, C, 1 + N] ->
    scaled scores [B, G, R, C, 1 + N], -inf where a block is not visible (eq. 7)."""
    scores = torch.matmul(q_grouped, keys[:, :, None].transpose(-1, -2)) / math.sqrt(q_grouped.shape[-1])
    return scores.masked_fill_(~(visible if visible.dim() == 2 else visible[:, None, None]), float("-inf"))


def compressed_probabilities(q: Tensor, keys: Tensor, visible: Tensor) -> Tensor:
    """q [B, H, C, D], keys [B, G, 1 + N, D], visible [C, 1 + N] -> probabilities [B, G, R, C, 1 + N] (eq. 7-8)."""
    q = rearrange(q, "b (g r) c d -> b g r c d", g=keys.shape[1])
    return torch.softmax(compressed_scores(q, keys, visible), dim=-1)


def block_importance(probs: Tensor, config: NSAAttentionConfig, n_selection_blocks: int) -> Tensor:
    """Probabilities of compressed blocks [B, G, R, C, N] -> importance of selection blocks [B, G, C, M].

    Eq. 10: summed over the group's query heads. Eq. 9: a compressed block counts for every
    stride-long unit it covers (block i covers units i .. i + l/d - 1); a selection block sums its units.
    """
    importance = probs.sum(dim=2)  # [B, G, C, N]
    batch, n_groups, n_queries, n_blocks = importance.shape
    stride = config.compress_stride
    units_per_compress, units_per_select = config.compress_block_size // stride, config.selection_block_size // stride
    n_units = n_selection_blocks * units_per_select
    importance = F.pad(importance, (0, max(0, n_units - n_blocks)))[..., :n_units]  # [B, G, C, U]
    per_unit = importance
    for shift in range(1, units_per_compress):
        per_unit = per_unit + F.pad(importance, (shift, 0))[..., :n_units]
    return per_unit.view(batch, n_groups, n_queries, n_selection_blocks, units_per_select).sum(-1)


def choose_blocks(
    importance: Tensor, positions: Tensor, config: NSAAttentionConfig
) -> tuple[Tensor, Tensor]:
    """Top `num_selected` causal selection blocks per query and group, the initial and the query's
    own block forced in. importance [B, G, C, M], positions [C] or per row [B, C] -> indices,
    valid [B, G, C, n]: valid blocks ascending first, then invalid padding (fewer than n blocks
    exist yet)."""
    n_selection_blocks = importance.shape[-1]
    selection_block = torch.arange(n_selection_blocks, device=importance.device)
    current = positions // config.selection_block_size
    causal = per_group(selection_block * config.selection_block_size <= positions[..., None])  # [(B, 1,) C, M]
    forced = per_group((selection_block == 0) | (selection_block == current[..., None]))
    ranking = importance.detach().masked_fill(~causal, float("-inf")).masked_fill(forced, float("inf"))
    n_take = min(config.num_selected, n_selection_blocks)
    top_scores, indices = ranking.topk(n_take, dim=-1, sorted=False)  # [B, G, C, n]
    valid = top_scores > float("-inf")
    if n_take < config.num_selected:  # fewer blocks than n exist: pad with invalid slots
        pad = config.num_selected - n_take
        indices, valid = F.pad(indices, (0, pad)), F.pad(valid, (0, pad), value=False)
    # canonical order: valid blocks ascending, then the invalid ones
    indices = torch.where(valid, indices, indices + n_selection_blocks).sort(dim=-1).values
    valid = indices < n_selection_blocks
    return torch.where(valid, indices, indices - n_selection_blocks), valid


def compressed_attention_chunk(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    positions: Tensor,
    config: NSAAttentionConfig,
    n_selection_blocks: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Compressed branch and block selection for a chunk of queries, differentiable end to end
    (the straight-through path needs the selection scores' gradient).

    q [B, H, C, D] (no rotary) at absolute `positions` [C]; keys, values [B, G, 1 + N, D], the
    memory slot first, then compressed blocks 0..N-1. Returns the branch output [B, H, C, D], the
    selected block indices [B, G, C, n] (ascending, valid ones first), their validity [B, G, C, n] and
    their selection scores [B, G, C, n] (differentiable; used by the straight-through gates).
    """
    visible = compressed_visibility(positions, keys.shape[2] - 1, config)
    probs = compressed_probabilities(q, keys, visible)  # [B, G, R, C, 1+N]
    output = torch.matmul(probs, values[:, :, None])  # [B, G, R, C, D]
    importance = block_importance(probs[..., 1:], config, n_selection_blocks)  # [B, G, C, M]
    indices, valid = choose_blocks(importance, positions, config)
    selected_scores = importance.gather(-1, indices)  # [B, G, C, n]
    return rearrange(output, "b g r c d -> b (g r) c d"), indices, valid, selected_scores


class CompressedChunkAttention(torch.autograd.Function):
    """Compressed branch and selection of one chunk of queries, without straight-through scores.

    q [B, H, C, D] (no rotary) at `positions` [C]; keys, values [B, G, 1 + N, D]. -> output
    [B, H, C, D], indices, valid [B, G, C, n]. The probabilities serve both the output and the
    selection; backward recomputes them from the saved log-sum-exp (flash-attention style), so a
    chunk keeps O(C * D) for backward and never its C x (1 + N) scores or mask.
    """

    @staticmethod
    def forward(ctx, q, keys, values, positions, config: NSAAttentionConfig, n_selection_blocks: int):  # noqa: D102
        visible = compressed_visibility(positions, keys.shape[2] - 1, config)  # [C, 1 + N]
        q_grouped = rearrange(q, "b (g r) c d -> b g r c d", g=keys.shape[1])
        scores = compressed_scores(q_grouped, keys, visible)  # [B, G, R, C, 1 + N]
        log_sum = torch.logsumexp(scores, dim=-1, keepdim=True)  # the memory slot: never empty
        probs = scores.sub_(log_sum).exp_()  # eq. 7-8
        output = torch.matmul(probs, values[:, :, None])  # [B, G, R, C, D]
        importance = block_importance(probs[..., 1:], config, n_selection_blocks)  # [B, G, C, M]
        indices, valid = choose_blocks(importance, positions, config)
        ctx.save_for_backward(q_grouped, keys, values, visible, output, log_sum)
        ctx.mark_non_differentiable(indices, valid)
        return rearrange(output, "b g r c d -> b (g r) c d"), indices, valid

    @staticmethod
    def backward(ctx, grad_output, _grad_indices, _grad_valid):  # noqa: D102
        q_grouped, keys, values, visible, output, log_sum = ctx.saved_tensors
        scale = 1 / math.sqrt(q_grouped.shape[-1])
        probs = compressed_scores(q_grouped, keys, visible).sub_(log_sum).exp_()  # [B, G, R, C, 1 + N], recomputed
        grad_output = rearrange(grad_output, "b (g r) c d -> b g r c d", g=keys.shape[1])
        grad_values = torch.matmul(probs.transpose(-1, -2), grad_output).sum(dim=2)  # [B, G, 1 + N, D]
        grad_probs = torch.matmul(grad_output, values[:, :, None].transpose(-1, -2))
        delta = (grad_output * output).sum(dim=-1, keepdim=True)  # [B, G, R, C, 1]
        grad_scores = grad_probs.sub_(delta).mul_(probs).mul_(scale)
        grad_q = rearrange(torch.matmul(grad_scores, keys[:, :, None]), "b g r c d -> b (g r) c d")
        grad_keys = torch.matmul(grad_scores.transpose(-1, -2), q_grouped).sum(dim=2)
        return grad_q, grad_keys, grad_values, None, None, None


def compressed_attention_fast(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    positions: Tensor,
    config: NSAAttentionConfig,
    n_selection_blocks: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """As compressed_attention_chunk without selection scores (no straight-through), by
    CompressedChunkAttention in q's dtype. -> output [B, H, C, D], indices, valid [B, G, C, n]."""
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        return CompressedChunkAttention.apply(q, keys, values, positions, config, n_selection_blocks)


def compressed_branch(
    q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, first_max: int, config: NSAAttentionConfig,
    straight_through: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The compressed branch and the block selection of queries at `positions`: [T], consecutive,
    or [B, T], each row's own (a cache whose rows differ in length); first_max is the largest
    first position (of any row), known on the host.

    q [B, H, T, D] (no rotary); keys, values [B, G, 1 + N, D]: the memory slot, then the compressed
    blocks complete by the last query. -> output [B, H, T, D], indices, valid [B, G, T, n] and, with
    straight_through, the selection scores [B, G, T, n] (differentiable; else None).

    A whole sequence on the CPU runs on the kernel (kernels/nsa_cpu.py: one pass, the selection
    included); otherwise chunks of `query_chunk_size` queries, each seeing only the blocks complete
    by its last query, with a custom backward (checkpointed under straight-through top-k).
    """
    n_groups, n_queries = keys.shape[1], q.shape[2]
    whole = positions.dim() == 1 and first_max == 0
    if whole and nsa_cpu.fits(0, q.shape[1] // n_groups) and nsa_cpu.usable(q, keys, values):
        out, blocks, score = nsa_cpu.compressed_selection(q, keys, values, positions, config)
        return out, blocks.clamp(min=0), blocks >= 0, score if straight_through else None
    block, stride, chunk = config.compress_block_size, config.compress_stride, config.query_chunk_size
    outputs, indices, valid, scores = [], [], [], []
    for start in range(0, n_queries, chunk):
        part = slice(start, start + chunk)
        last = first_max + min(n_queries, start + chunk) - 1  # the chunk's last position, in any row
        n_visible = n_complete_blocks(last + 1, block, stride)  # causal skipping of later blocks
        n_selection = last // config.selection_block_size + 1
        args = (q[:, :, part], keys[:, :, : 1 + n_visible], values[:, :, : 1 + n_visible], positions[..., part],
                config, n_selection)
        if straight_through:
            result = checkpoint(compressed_attention_chunk, *args, use_reentrant=False)
        else:
            result = (*compressed_attention_fast(*args), None)
        for collected, value in zip((outputs, indices, valid, scores), result, strict=True):
            collected.append(value)
    score = torch.cat(scores, dim=2) if straight_through else None
    return torch.cat(outputs, dim=2), torch.cat(indices, dim=2), torch.cat(valid, dim=2), score


def _block_rows(blocked: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    """blocked [B, G, M, l', D] as rows [B G M, l' D] (a view), and indices [B, G, C, n] as row numbers [B G C n]."""
    batch, n_groups, n_blocks, block, dim_head = blocked.shape
    base = (torch.arange(batch * n_groups, device=indices.device) * n_blocks).view(batch, n_groups, 1, 1)
    return blocked.view(batch * n_groups * n_blocks, block * dim_head), (indices + base).reshape(-1)


def _gather_blocks(blocked: Tensor, indices: Tensor) -> Tensor:
    """blocked [B, G, M, l', D] (contiguous), indices [B, G, C, n] -> [B, G, C, n * l', D] (index_select)."""
    batch, n_groups, _, block, dim_head = blocked.shape
    rows, flat = _block_rows(blocked, indices)
    return rows.index_select(0, flat).view(batch, n_groups, indices.shape[2], indices.shape[3] * block, dim_head)


def _scatter_blocks(grad_blocked: Tensor, indices: Tensor, grad_rows: Tensor) -> None:
    """Add grad_rows [B, G, C, n * l', D] into grad_blocked [B, G, M, l', D] at indices (index_add)."""
    rows, flat = _block_rows(grad_blocked, indices)
    rows.index_add_(0, flat, grad_rows.reshape(-1, rows.shape[1]))


def _blocked(tensor: Tensor, block: int) -> Tensor:
    """[B, G, S, D] -> contiguous [B, G, M, l', D], zero-padded to whole blocks."""
    padded = F.pad(tensor, (0, 0, 0, -tensor.shape[2] % block))
    return rearrange(padded, "b g (m s) d -> b g m s d", s=block).contiguous()


def _block_probs(q, k_blocked, v_blocked, indices, valid, positions, block, log_sum=None):
    """Gathered keys and values [B, G, C, n l', D] of a chunk of queries' blocks, and the
    probabilities over them, normalised by log_sum [B, G, C, R, 1] when given, else by their own
    log-sum-exp (returned; -inf for a query with no visible key, whose probabilities are 0).

    q [B, G, C, R, D] (query-major, so every product is a plain batched matmul over B G C);
    indices, valid [B, G, C, n]; positions [C] or per row [B, C]."""
    keys = _gather_blocks(k_blocked, indices)  # [B, G, C, n l', D]
    values = _gather_blocks(v_blocked, indices)
    key_position = (indices[..., None] * block + torch.arange(block, device=q.device)).flatten(-2)
    allowed = valid.repeat_interleave(block, dim=-1) & (key_position <= per_group(positions[..., None]))
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(1 / math.sqrt(q.shape[-1]))  # [B, G, C, R, n l']
    scores.masked_fill_(~allowed[:, :, :, None], float("-inf"))
    if log_sum is None:
        log_sum = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = scores.sub_(torch.where(log_sum.isfinite(), log_sum, 0.0)).exp_()
    return keys, values, probs, log_sum


def _selected_chunk(q, k_blocked, v_blocked, indices, valid, gates, positions, block):
    """Gathered keys/values, probabilities, gate, log-sum-exp and output of one chunk of queries
    (`_block_probs`; never an empty row: the own block is always selected); gates [B, G, C, n] or None."""
    keys, values, probs, log_sum = _block_probs(q, k_blocked, v_blocked, indices, valid, positions, block)
    gate = None if gates is None else gates.repeat_interleave(block, dim=-1)[:, :, :, None]  # [B, G, C, 1, nl']
    weighted = probs if gate is None else probs * gate
    output = torch.matmul(weighted, values)  # [B, G, C, R, D]
    return keys, values, probs, gate, log_sum, output


def _outer_sum(a: Tensor, b: Tensor) -> Tensor:
    """a [.., R, K], b [.., R, D] -> sum over r of a[r] outer b[r], [.., K, D]. The same as
    a^T @ b, but R (query heads per group) is tiny and batched matmuls with an inner dimension of
    2-4 are many times slower on CPU than R fused multiply-adds."""
    total = a[..., 0, :, None] * b[..., 0, None, :]
    for head in range(1, a.shape[-2]):
        total.addcmul_(a[..., head, :, None], b[..., head, None, :])
    return total


class SelectedBlockAttention(torch.autograd.Function):
    """Attention of each query to the tokens (at or before it) of its selected blocks.

    q [B, G, T, R, D] (query heads grouped, query-major) at absolute `positions` [T] (or [B, T], each
    row's own); k, v [B, G, S, D];
    indices, valid [B, G, T, n]; gates [B, G, T, n] or None (multiply each block's values).
    -> [B, G, T, R, D]. Forward and backward run over query chunks; the backward recomputes the
    gathered keys/values and scatters their gradients (flash-attention style, with the saved
    log-sum-exp), so only q, k, v, the indices, the output and the log-sum-exp are kept.
    """

    @staticmethod
    def forward(ctx, q, k, v, indices, valid, gates, positions, block: int, chunk: int):  # noqa: D102
        k_blocked, v_blocked = _blocked(k, block), _blocked(v, block)  # [B, G, M, l', D]
        output = torch.empty_like(q)
        log_sum = q.new_empty(*q.shape[:-1], 1)  # [B, G, T, R, 1]
        for start in range(0, q.shape[2], chunk):
            part = slice(start, start + chunk)
            *_, log_sum[:, :, part], output[:, :, part] = _selected_chunk(
                q[:, :, part], k_blocked, v_blocked, indices[:, :, part], valid[:, :, part],
                None if gates is None else gates[:, :, part], positions[..., part], block,
            )
        ctx.save_for_backward(q, k, v, indices, valid, gates, positions, output, log_sum)
        ctx.block, ctx.chunk = block, chunk
        return output

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        q, k, v, indices, valid, gates, positions, output, log_sum = ctx.saved_tensors
        block, chunk = ctx.block, ctx.chunk
        n_keys, dim_head = k.shape[2], k.shape[3]
        k_blocked, v_blocked = _blocked(k, block), _blocked(v, block)
        grad_q = torch.empty_like(q)
        grad_k_blocked, grad_v_blocked = torch.zeros_like(k_blocked), torch.zeros_like(v_blocked)
        grad_gates = None if gates is None else torch.empty_like(gates)
        scale = 1 / math.sqrt(dim_head)
        for start in range(0, q.shape[2], chunk):
            part = slice(start, start + chunk)
            q_part, grad_part = q[:, :, part], grad_output[:, :, part]
            keys, values, probs, gate, _, _ = _selected_chunk(
                q_part, k_blocked, v_blocked, indices[:, :, part], valid[:, :, part],
                None if gates is None else gates[:, :, part], positions[..., part], block,
            )
            # flash-attention backward with the probabilities recomputed exactly
            weighted = probs if gate is None else probs * gate
            grad_values = _outer_sum(weighted, grad_part)  # [B, G, C, n l', D]
            _scatter_blocks(grad_v_blocked, indices[:, :, part], grad_values)
            grad_weighted = torch.matmul(grad_part, values.transpose(-1, -2))  # dL/d(probs * gate) [B,G,C,R,nl']
            grad_probs = grad_weighted if gate is None else grad_weighted * gate
            if grad_gates is not None:
                per_key = (grad_weighted * probs).sum(dim=3)  # [B, G, C, n l']
                grad_gates[:, :, part] = per_key.unflatten(-1, (-1, block)).sum(-1)
            delta = (grad_part * output[:, :, part]).sum(dim=-1, keepdim=True)  # [B, G, C, R, 1]
            grad_scores = grad_probs.sub_(delta).mul_(probs).mul_(scale)
            grad_q[:, :, part] = torch.matmul(grad_scores, keys)
            grad_keys = _outer_sum(grad_scores, q_part)  # [B, G, C, n l', D]
            _scatter_blocks(grad_k_blocked, indices[:, :, part], grad_keys)
        grad_k = rearrange(grad_k_blocked, "b g m s d -> b g (m s) d")[:, :, :n_keys]
        grad_v = rearrange(grad_v_blocked, "b g m s d -> b g (m s) d")[:, :, :n_keys]
        return grad_q, grad_k, grad_v, None, None, grad_gates, None, None, None


def _forced_tiles(k_blocked: Tensor, n_tiles: int) -> Tensor:
    """Keys of every query tile for the forced blocks: block 0 then the tile's own block,
    [B G, M, 2 l', D] from k_blocked [B, G, >= M, l', D]."""
    batch, n_groups, _, block, dim_head = k_blocked.shape
    first = k_blocked[:, :, :1].expand(-1, -1, n_tiles, -1, -1)
    return torch.cat((first, k_blocked[:, :, :n_tiles]), dim=3).view(batch * n_groups, n_tiles, 2 * block, dim_head)


def _forced_mask(n_tiles: int, block: int, n_heads: int, dtype: torch.dtype, device) -> Tensor:
    """Additive mask [1, M, l' R, 2 l'] of a tile's query rows (position-major, R heads each) over
    block 0 and its own block: block 0 whole (tile 0: hidden, its own block is block 0), its own
    block causally."""
    row = torch.arange(block, device=device).repeat_interleave(n_heads)[:, None]  # position in the block
    column = torch.arange(2 * block, device=device)[None, :]
    own = (column >= block) & (column - block <= row)  # [l' R, 2 l']
    visible = (own | (column < block)).expand(n_tiles, -1, -1).clone()
    visible[0] = own
    return additive_mask(visible, dtype)[None]


class ForcedSplitSelectedAttention(torch.autograd.Function):
    """SelectedBlockAttention for whole sequences whose selection always holds block 0 and each
    query's own block (`choose_blocks` with num_selected >= 2), without gates, on the CPU.

    The forced blocks are the same for the l' queries of a selection block, so they run densely,
    a tile of l' queries (all R heads of a group) against block 0 and their own block, on torch's
    fused kernel; only the other n - 2 blocks are gathered per query. The two parts are merged by
    their log-sum-exps. The backward hands each part the merged output and log-sum-exp, which gives
    each part its exact share of the gradients.

    q [B, G, T, R, D] (query-major) at positions 0..T-1, k, v [B, G, T, D], indices, valid
    [B, G, T, n] -> [B, G, T, R, D].
    """

    @staticmethod
    def forward(ctx, q, k, v, indices, valid, block: int, chunk: int):  # noqa: D102
        batch, n_groups, n_tokens, n_heads, dim_head = q.shape
        positions = torch.arange(n_tokens, device=q.device)
        n_tiles = -(-n_tokens // block)
        k_blocked, v_blocked = _blocked(k, block), _blocked(v, block)  # [B, G, M, l', D]
        pad = n_tiles * block - n_tokens
        tiles = F.pad(q, (0, 0, 0, 0, 0, pad)).view(batch * n_groups, n_tiles, block * n_heads, dim_head)
        mask = _forced_mask(n_tiles, block, n_heads, q.dtype, q.device)
        forced_out, forced_log_sum = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            tiles, _forced_tiles(k_blocked, n_tiles), _forced_tiles(v_blocked, n_tiles), 0.0, False, attn_mask=mask,
        )
        forced_out = forced_out.reshape(batch, n_groups, n_tiles * block, n_heads, dim_head)[:, :, :n_tokens]
        forced_log_sum = forced_log_sum.reshape(batch, n_groups, n_tiles * block, n_heads, 1)[:, :, :n_tokens]
        free, free_valid = _free_blocks(indices, valid, positions, block)
        output = torch.empty_like(q)
        log_sum = forced_log_sum.new_empty(*q.shape[:-1], 1)  # [B, G, T, R, 1]
        for start in range(0, n_tokens, chunk):
            part = slice(start, start + chunk)
            _, values, probs, free_log_sum = _block_probs(
                q[:, :, part], k_blocked, v_blocked, free[:, :, part], free_valid[:, :, part], positions[part], block,
            )
            merged = torch.logaddexp(forced_log_sum[:, :, part], free_log_sum.to(forced_log_sum.dtype))
            log_sum[:, :, part] = merged
            output[:, :, part] = (forced_out[:, :, part] * (forced_log_sum[:, :, part] - merged).exp().to(q.dtype)
                                  + torch.matmul(probs, values) * (free_log_sum - merged).exp().to(q.dtype))
        ctx.save_for_backward(q, k, v, free, free_valid, output, log_sum)
        ctx.block, ctx.chunk = block, chunk
        return output

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        q, k, v, free, free_valid, output, log_sum = ctx.saved_tensors
        block, chunk = ctx.block, ctx.chunk
        batch, n_groups, n_tokens, n_heads, dim_head = q.shape
        positions = torch.arange(n_tokens, device=q.device)
        n_tiles = -(-n_tokens // block)
        pad = n_tiles * block - n_tokens
        k_blocked, v_blocked = _blocked(k, block), _blocked(v, block)
        grad_output = grad_output.contiguous()

        def as_tiles(x: Tensor, value: float = 0.0) -> Tensor:  # [B, G, T, R, X] -> [B G, M, l' R, X]
            return F.pad(x, (0, 0, 0, 0, 0, pad), value=value).view(batch * n_groups, n_tiles, block * n_heads, -1)

        # padded rows: zero output gradient and an infinite log-sum-exp (probability 0): they add nothing
        grad_tiles, forced_dk, forced_dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            as_tiles(grad_output), as_tiles(q), _forced_tiles(k_blocked, n_tiles), _forced_tiles(v_blocked, n_tiles),
            as_tiles(output), as_tiles(log_sum, float("inf"))[..., 0], 0.0, False,
            attn_mask=_forced_mask(n_tiles, block, n_heads, q.dtype, q.device),
        )
        grad_q = grad_tiles.reshape(batch, n_groups, n_tiles * block, n_heads, dim_head)[:, :, :n_tokens].contiguous()
        grad_k_blocked, grad_v_blocked = torch.zeros_like(k_blocked), torch.zeros_like(v_blocked)
        for grad, forced in ((grad_k_blocked, forced_dk), (grad_v_blocked, forced_dv)):
            forced = forced.view(batch, n_groups, n_tiles, 2 * block, dim_head)
            grad[:, :, :n_tiles] += forced[:, :, :, block:]  # own blocks
            grad[:, :, 0] += forced[:, :, :, :block].sum(dim=2)  # block 0, from every tile
        scale = 1 / math.sqrt(dim_head)
        for start in range(0, n_tokens, chunk):
            part = slice(start, start + chunk)
            q_part, grad_part = q[:, :, part], grad_output[:, :, part]
            keys, values, probs, _ = _block_probs(
                q_part, k_blocked, v_blocked, free[:, :, part], free_valid[:, :, part], positions[part], block,
                log_sum[:, :, part].to(q.dtype),
            )
            _scatter_blocks(grad_v_blocked, free[:, :, part], _outer_sum(probs, grad_part))
            delta = (grad_part * output[:, :, part]).sum(dim=-1, keepdim=True)  # [B, G, C, R, 1]
            grad_scores = torch.matmul(grad_part, values.transpose(-1, -2)).sub_(delta).mul_(probs).mul_(scale)
            grad_q[:, :, part] += torch.matmul(grad_scores, keys)
            _scatter_blocks(grad_k_blocked, free[:, :, part], _outer_sum(grad_scores, q_part))
        grad_k = rearrange(grad_k_blocked, "b g m s d -> b g (m s) d")[:, :, :n_tokens]
        grad_v = rearrange(grad_v_blocked, "b g m s d -> b g (m s) d")[:, :, :n_tokens]
        return grad_q, grad_k, grad_v, None, None, None, None


def _free_blocks(indices: Tensor, valid: Tensor, positions: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """The selected blocks other than block 0 and the query's own block: with choose_blocks' order
    (valid blocks ascending: block 0 first, the own block last), slots 1 .. n - 2, less the own
    block where fewer than n blocks exist yet. -> indices, valid [B, G, T, n - 2]."""
    n_slots = indices.shape[-1]
    free = indices[..., 1 : n_slots - 1]
    own = (positions // block)[:, None]  # [T, 1]
    return free, valid[..., 1 : n_slots - 1] & (free != own) & (free != 0)


def selected_attention(q, k, v, indices, valid, gates, positions, block: int, chunk: int,
                       forced: bool = False) -> Tensor:
    """See SelectedBlockAttention; here q [B, H, T, D] -> [B, H, T, D]. Runs in q's dtype (autocast
    off inside). forced: the selection always holds block 0 and each query's own block (as
    `choose_blocks` makes it with num_selected >= 2); a whole sequence on the CPU without gates
    then runs those two blocks densely (ForcedSplitSelectedAttention)."""
    n_groups = k.shape[1]
    k, v = k.to(q.dtype), v.to(q.dtype)
    gates = None if gates is None else gates.to(q.dtype)
    grouped = rearrange(q, "b (g r) t d -> b g t r d", g=n_groups).contiguous()
    split = (forced and gates is None and q.device.type == "cpu" and k.shape[2] == q.shape[2]
             and positions.dim() == 1 and int(positions[0]) == 0)
    with torch.autocast(q.device.type, enabled=False):
        if split:
            output = ForcedSplitSelectedAttention.apply(grouped, k, v, indices, valid, block, chunk)
        else:
            output = SelectedBlockAttention.apply(grouped, k, v, indices, valid, gates, positions, block, chunk)
    return rearrange(output, "b g t r d -> b (g r) t d")


# ----------------------------------------------------------------------------------------------
# Compression networks: a block of l keys (or values) [.., l, D] -> one [.., D]


class BlockCompressor(nn.Module):
    """One compressor per kind, weights per key/value head. blocks [B, G, N, l, D] -> [B, G, N, D]."""

    def __init__(self, kind: str, n_groups: int, block: int, dim_head: int, mlp_mult: float) -> None:
        super().__init__()
        self.kind = kind
        flat = block * dim_head

        def weight(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape) * shape[-2] ** -0.5)

        if kind != "mean":  # intra-block positions (section 3.3.1)
            self.positions = nn.Parameter(torch.zeros(n_groups, block, dim_head))
        if kind == "mlp":
            hidden = max(1, int(flat * mlp_mult))
            self.w1, self.b1 = weight(n_groups, flat, hidden), nn.Parameter(torch.zeros(n_groups, hidden))
            self.w2, self.b2 = weight(n_groups, hidden, dim_head), nn.Parameter(torch.zeros(n_groups, dim_head))
        elif kind == "conv":  # a convolution with kernel l and stride d is one linear map per block
            self.w1, self.b1 = weight(n_groups, flat, dim_head), nn.Parameter(torch.zeros(n_groups, dim_head))
        elif kind == "attention":  # attention pooling: a learned score per token, softmax over the block
            self.score = nn.Parameter(torch.randn(n_groups, dim_head) * dim_head**-0.5)

    def forward(self, blocks: Tensor) -> Tensor:
        if self.kind == "mean":
            return blocks.mean(dim=-2)
        blocks = blocks + self.positions[:, None]  # [B, G, N, l, D]
        if self.kind == "attention":
            weights = torch.softmax(torch.einsum("bgnld,gd->bgnl", blocks, self.score), dim=-1)
            return torch.einsum("bgnl,bgnld->bgnd", weights, blocks)
        flat = blocks.flatten(-2)  # [B, G, N, l D]
        hidden = torch.einsum("bgnx,gxh->bgnh", flat, self.w1) + self.b1[:, None]
        if self.kind == "conv":
            return hidden
        hidden = F.relu(hidden)
        return torch.einsum("bgnh,ghd->bgnd", hidden, self.w2) + self.b2[:, None]


def compress(keys: Tensor, first: int, count: int, block: int, stride: int, network: BlockCompressor) -> Tensor:
    """Compressed blocks first..first+count-1 of keys [B, G, S, D] -> [B, G, count, D]."""
    start = first * stride
    span = keys[:, :, start : start + (count - 1) * stride + block]
    blocks = overlapping_windows(span, block, stride)  # [B, G, count, l, D]
    return network(blocks)


# ----------------------------------------------------------------------------------------------
# State and module


BRANCHES = ("compressed", "selected", "sliding")


class NSACache(KVCache):
    """Keys and values of every fed token (selection may pick any block), unrotated keys for the
    compression network, and the compressed keys/values of the blocks completed so far.

    Rows may have lengths of their own (truncate_rows): row b's tokens sit at positions
    0..rows.lengths[b]-1, and whatever lies past them (rejected draft tokens) stays until
    overwritten, unseen: the compressed branch, the selection and the window look only at or
    before each query's own position. While rows differ, a forward compresses again, for every
    row, each block that a new token of any row falls in (`first_block_written`): a block's
    compressed key is then always made of the tokens a row holds by the time one of its queries
    sees the block."""

    per_row_rollback = True

    def __init__(self, names: list[str], shape: tuple[int, int, int, int], max_blocks: int, config, device, dtype):
        batch, n_groups, max_len, dim_head = shape
        self.tensors = {name: torch.zeros(shape, device=device, dtype=dtype) for name in names}
        self.compressed_keys = torch.zeros(batch, n_groups, max(1, max_blocks), dim_head, device=device, dtype=dtype)
        self.compressed_values = torch.zeros_like(self.compressed_keys)
        self.config = config
        self.length = 0
        self.n_compressed = 0
        self.kv_tokens_loaded: int | None = None  # keys/values one query read in the last single-token step

    def append(self, new: dict[str, Tensor]) -> dict[str, Tensor]:
        """Store new [B, G, T, D] per name (each row at its own positions while rows differ);
        return everything so far, [B, G, S, D] per name (S = the longest row's length)."""
        n_new = next(iter(new.values())).shape[2]
        start, end = self.length, self.length + n_new
        max_len = next(iter(self.tensors.values())).shape[2]
        if end > max_len:
            raise ValueError(f"cache holds {max_len} tokens; {end} were fed")
        if self.rows is None:
            for name, value in new.items():
                self.tensors[name][:, :, start:end] = value
        else:
            self.rows, positions = self.rows.advance(n_new)  # shared by the layers
            for name, value in new.items():
                write_rows(self.tensors[name], value, positions)
        self.length = end
        return {name: tensor[:, :, :end] for name, tensor in self.tensors.items()}

    def first_block_written(self, rows: RowLengths) -> int:
        """The first compressed block a forward from per-row lengths `rows` writes a token into,
        in any row: the first whose last token lies at or after the shortest row's length."""
        first_end = rows.shortest - (self.config.compress_block_size - 1)  # a block's last token >= shortest
        return max(0, -(-first_end // self.config.compress_stride))

    def truncate(self, length: int) -> None:
        self._check_truncate(length)
        self._level_rows(length)  # every block complete within `length` is then every row's own
        self.length = length
        self.n_compressed = min(
            self.n_compressed,
            n_complete_blocks(length, self.config.compress_block_size, self.config.compress_stride),
        )

    def truncate_rows(self, rows: RowLengths) -> None:
        self._adopt_rows(rows)


@ATTENTION.register("nsa")
class NativeSparseAttention(nn.Module):
    config_class = NSAAttentionConfig

    @staticmethod
    def keys_per_query(config: NSAAttentionConfig, seq_len: int, n_heads: int, layer_index: int) -> float:
        """Keys a query is scored against, for the FLOP count (flops.py): compressed blocks, the
        selected blocks' tokens and the sliding window."""
        selected = min(config.num_selected * config.selection_block_size, seq_len)
        return seq_len / config.compress_stride + selected + min(config.sliding_window_size, seq_len)

    def __init__(self, spec: AttentionSpec, config: NSAAttentionConfig) -> None:
        super().__init__()
        check_config(config, spec)
        if config.backend == "triton":
            nsa_triton.check_installed()
        self.spec, self.config = spec, config
        heads, groups, dim_head = spec.n_heads, spec.n_kv_heads, spec.dim_head
        n_kv_sets = 3 if config.separate_branch_kv else 1
        self.to_q = Linear(spec.dim, heads * dim_head, bias=False)
        self.to_kv = Linear(spec.dim, 2 * n_kv_sets * groups * dim_head, bias=False)
        self.to_gates = Linear(spec.dim, 3 * heads)  # eq. 5: g_c in [0, 1] per head and branch
        self.to_out = Linear(heads * dim_head, spec.dim, bias=False)
        args = (config.compressor, groups, config.compress_block_size, dim_head, config.compress_mlp_mult)
        self.compress_keys, self.compress_values = BlockCompressor(*args), BlockCompressor(*args)
        self.memory = nn.Parameter(torch.randn(2, groups, dim_head) * 0.02)  # always-visible compressed key, value
        self.aux_losses: dict[str, Tensor] = {}

    # -- projections

    def _project(
        self, x: Tensor, offset: int | Tensor, end: int | None = None
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """x [B, T, dim] at positions offset.. (an int, or [B] per row with `end` their bound) ->
        query without and with rotary [B, H, T, D], per-branch keys/values [B, G, T, D]."""
        dim_head = self.spec.dim_head
        q = rearrange(self.to_q(x), "b t (h d) -> b h t d", d=dim_head)
        kv = rearrange(self.to_kv(x), "b t (n g d) -> n b g t d", d=dim_head, g=self.spec.n_kv_heads)
        rotary = self.spec.rotary
        rotate = (lambda tensor: rotary(tensor, offset, end)) if rotary is not None else (lambda tensor: tensor)
        if self.config.separate_branch_kv:
            k_cmp, v_cmp, k_slc, v_slc, k_win, v_win = kv
            new = {"k_cmp": k_cmp, "v_cmp": v_cmp, "k_slc": rotate(k_slc), "v_slc": v_slc,
                   "k_win": rotate(k_win), "v_win": v_win}
        else:
            k, v = kv
            new = {"k_cmp": k, "v": v, "k": rotate(k)}
        return q, rotate(q), new

    @staticmethod
    def _branch(tensors: dict[str, Tensor], branch: str) -> tuple[Tensor, Tensor]:
        if "k" in tensors:  # shared keys/values
            return (tensors["k_cmp"] if branch == "cmp" else tensors["k"]), tensors["v"]
        return tensors[f"k_{branch}"], tensors[f"v_{branch}"]

    # -- forward

    def forward(self, x: Tensor, cache: NSACache | None = None) -> Tensor:
        config = self.config
        rows = None if cache is None else cache.rows  # lengths of their own per row, or None (level)
        offset = 0 if cache is None else cache.length  # the longest row's, when rows differ
        n_queries = x.shape[1]
        n_keys = offset + n_queries
        if rows is None:
            positions = torch.arange(offset, n_keys, device=x.device)  # [T]
        else:
            _, positions = rows.advance(n_queries)  # [B, T]: each row's own
        q_plain, q, new = self._project(x, offset if rows is None else rows.lengths, n_keys)
        tensors = new if cache is None else cache.append(new)  # [B, G, S, D] each

        # compressed keys/values of all blocks complete by the last query
        block, stride = config.compress_block_size, config.compress_stride
        k_cmp, v_cmp = self._branch(tensors, "cmp")
        n_blocks = n_complete_blocks(n_keys, block, stride)
        if cache is None:
            compressed_k = compress(k_cmp, 0, n_blocks, block, stride, self.compress_keys) if n_blocks else None
            compressed_v = compress(v_cmp, 0, n_blocks, block, stride, self.compress_values) if n_blocks else None
        else:
            # blocks not compressed yet; while rows differ, also every block a new token fell in
            first = cache.n_compressed if rows is None else min(cache.n_compressed, cache.first_block_written(rows))
            if n_blocks > first:
                count = n_blocks - first
                new_k = compress(k_cmp, first, count, block, stride, self.compress_keys)
                new_v = compress(v_cmp, first, count, block, stride, self.compress_values)
                cache.compressed_keys[:, :, first:n_blocks] = new_k
                cache.compressed_values[:, :, first:n_blocks] = new_v
                cache.n_compressed = n_blocks
            compressed_k = cache.compressed_keys[:, :, :n_blocks]
            compressed_v = cache.compressed_values[:, :, :n_blocks]
        batch = x.shape[0]
        memory_k = self.memory[0].to(q.dtype).expand(batch, -1, -1)[:, :, None]  # [B, G, 1, D]
        memory_v = self.memory[1].to(q.dtype).expand(batch, -1, -1)[:, :, None]
        if n_blocks:
            all_k = torch.cat((memory_k, compressed_k.to(q.dtype)), dim=2)  # [B, G, 1 + N, D]
            all_v = torch.cat((memory_v, compressed_v.to(q.dtype)), dim=2)
        else:
            all_k, all_v = memory_k, memory_v

        # compressed branch and selection
        # the selection scores need a gradient only for straight-through top-k in training
        straight_through = config.use_diff_topk and torch.is_grad_enabled() and q_plain.requires_grad
        # (offset is the largest first position: the longest row's length when rows differ)
        out_cmp, indices, valid, score = compressed_branch(q_plain, all_k, all_v, positions, offset, config,
                                                           straight_through)
        gates = None
        if straight_through:
            gates = (1 + score - score.detach()).to(q.dtype)  # straight-through: exactly 1 forward

        # selected branch
        k_slc, v_slc = self._branch(tensors, "slc")
        out_slc = self._selected(q, k_slc, v_slc, indices, valid, gates, positions)

        # sliding branch: keys of the last window - 1 + T tokens (of the shortest row's, when rows differ)
        k_win, v_win = self._branch(tensors, "win")
        window = config.sliding_window_size
        first = max(0, (offset if rows is None else rows.shortest) - (window - 1))
        window_positions = None if rows is None else positions - first  # [B, T] key indices in the slice
        out_win = self._sliding(q, k_win[:, :, first:], v_win[:, :, first:], window_positions)

        if cache is not None and n_queries == 1:  # row 0's count, kept while rows are level
            cache.kv_tokens_loaded = (None if rows is not None else
                                      kv_tokens_loaded(config, offset, n_blocks, indices[0, 0, 0], valid[0, 0, 0]))

        gate = rearrange(torch.sigmoid(self.to_gates(x)), "b t (h c) -> c b h t 1", c=3)  # [3, B, H, T, 1]
        y = gate[0] * out_cmp + gate[1] * out_slc + gate[2] * out_win
        return self.to_out(rearrange(y, "b h t d -> b t (h d)"))

    # -- back-ends: one semantics, tested against the torch path (tests/test_nsa_kernels.py)

    def _selected(self, q, k, v, indices, valid, gates, positions) -> Tensor:
        """positions [T], or [B, T] per row (the torch path: rows of a cache that differ in length)."""
        backend, block = self.config.backend, self.config.selection_block_size
        shared = positions.dim() == 1
        if backend == "triton" and shared:
            return nsa_triton.selected_attention(q, k, v, indices, valid, gates, positions, block)
        # flex has no per-block value gates (straight-through uses torch); short chunks use torch (flex.py)
        if backend == "flex" and shared and gates is None and worth_flex(q.shape[2], q.device.type):
            self._check_flex(q)
            return nsa_flex.selected_attention(q, k, v, indices, valid, positions, block)
        heads_per_group = q.shape[1] // k.shape[1]
        whole = shared and k.shape[2] == q.shape[2]
        if whole and nsa_cpu.fits(indices.shape[-1], heads_per_group) and nsa_cpu.usable(q, k, v):
            blocks = torch.where(valid, indices, -1)  # a whole sequence: the CPU kernel
            return nsa_cpu.selected_attention(q, k, v, blocks, positions, block, gates)
        # check_config holds num_selected >= 2, so choose_blocks always selects block 0 and the own block
        return selected_attention(q, k, v, indices, valid, gates, positions, block, self.config.query_chunk_size,
                                  forced=True)

    def _sliding(self, q, k, v, positions: Tensor | None = None) -> Tensor:
        """positions [B, T]: each row's query key indices (rows that differ in length), else the
        queries are the last T keys."""
        window = self.config.sliding_window_size
        if positions is not None:
            return local_attention(q, k, v, window, positions=positions)
        if self.config.backend == "flex" and worth_flex(q.shape[2], q.device.type):
            self._check_flex(q)
            return flex_local_attention(q, k, v, window)
        if k.shape[2] == q.shape[2] and nsa_cpu.fits(0, q.shape[1] // k.shape[1]) and nsa_cpu.usable(q, k, v):
            return nsa_cpu.sliding_attention(q, k, v, window)  # a whole sequence
        return local_attention(q, k, v, window)

    @staticmethod
    def _check_flex(q: Tensor) -> None:
        if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
            raise ConfigError("nsa backend=flex has no backward on CPU; train with backend=torch (flex: inference)")

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None) -> NSACache:
        names = (["k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win"] if self.config.separate_branch_kv
                 else ["k_cmp", "k", "v"])
        if dtype is None:
            dtype = self.memory.dtype  # a float parameter, also when the projections are int8 (model/quantize.py)
        shape = (batch, self.spec.n_kv_heads, max_len, self.spec.dim_head)
        max_blocks = n_complete_blocks(max_len, self.config.compress_block_size, self.config.compress_stride)
        return NSACache(names, shape, max_blocks, self.config, device, dtype)


def kv_tokens_loaded(config: NSAAttentionConfig, position: int, n_blocks: int, indices: Tensor, valid: Tensor) -> int:
    """Keys/values one query at `position` reads (the paper's Table 4 quantity): the compressed
    blocks and memory slot, the tokens at or before it in its selected blocks, and its window.
    Tokens read by two branches are counted twice, as a kernel would load them twice."""
    block = config.selection_block_size
    starts = indices[valid] * block
    selected = int(torch.clamp(position + 1 - starts, min=0, max=block).sum())
    return 1 + n_blocks + selected + min(config.sliding_window_size, position + 1)


def check_config(config: NSAAttentionConfig, spec: AttentionSpec) -> None:
    """Reject option combinations the layer cannot honour, with the reason."""
    stride = config.compress_stride
    if min(config.compress_block_size, stride, config.selection_block_size, config.sliding_window_size) < 1:
        raise ConfigError("nsa: block sizes, stride and window must be >= 1")
    if config.compress_block_size % stride or config.selection_block_size % stride:
        raise ConfigError(
            f"nsa: compress_stride ({stride}) must divide compress_block_size ({config.compress_block_size}) "
            f"and selection_block_size ({config.selection_block_size})"
        )
    if config.num_selected < 2:
        raise ConfigError("nsa: num_selected must be >= 2 (the initial and the current block are always selected)")
    if config.query_chunk_size < 1:
        raise ConfigError("nsa: query_chunk_size must be >= 1")
    if spec.dropout:
        raise ConfigError("nsa: attention dropout is not supported; use model.dropout (residual dropout)")
