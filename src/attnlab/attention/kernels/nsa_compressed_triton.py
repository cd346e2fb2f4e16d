"""The `triton` back-end of NSA's compressed branch and block selection (same semantics as
attention/nsa.py's reference `compressed_branch`, which the tests compare against), registered as
torch custom ops.

Forward (one program per query and key/value group): the group's R query heads are loaded together
and attend, with an online softmax, to the memory slot and the compressed blocks complete at the
query (eq. 7), skipping later blocks; the program writes the output and one log-sum-exp per head.
A second loop over the selection blocks the query may choose recomputes the probabilities from the
log-sum-exp, sums them over the group's heads (eq. 10) and spreads each compressed block over the
selection blocks it overlaps (eq. 9, per stride unit as the reference does), writing the importance
[B, G, T, M]. No T x N score or probability tensor is ever stored.

Selection (one program per query and group): the top `n_selected` causal selection blocks by
importance, the initial and the query's own block forced in, ties to the lower block; written in
ascending order, valid blocks first (the reference's canonical order).

Backward, flash-attention style, recomputing the probabilities from the log-sum-exp:
- query-centric (one program per query and group): dq, and each head's delta = sum_j P_j dP_j;
- key-centric (one program per tile of compressed keys, group and split of the query rows): walks
  the queries that see the tile (from the first one at which its first block is complete) and
  accumulates dK, dV in registers, no atomics; the splits' partial sums are added after.
The importance's gradient (from the straight-through gates, use_diff_topk) reaches a compressed
block's probability as the sum of dI over the selection blocks of its units (eq. 9 transposed).

Triton is imported lazily: attnlab imports without it. Runs on CUDA, or on CPU tensors under
TRITON_INTERPRET=1 (the tests), where it is slow and meant for small checks only.

Legend: B batch, G key/value heads, R query heads per group, T queries, J = 1 + N keys (the memory
slot, then N compressed blocks), D head width, M selection blocks, n selected blocks per query,
l compress block, d stride, l' selection block, c = l / d and s = l' / d stride units per block.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from attnlab.attention.kernels.nsa_triton import check_available, interpreting

KEY_TILE = 64  # compressed keys per loop step (forward) and per key-centric program (backward)
ROW_TILE = 64  # query rows (query x head) per step of the key-centric backward
# rows one key-centric program walks at most: long sequences split each key tile's rows over several
# programs (their partial dK, dV summed after), so the grid is more than one program per key tile
ROWS_PER_PROGRAM = 16384
SELECTION_UNITS = 64  # stride units covered by one step of the importance loop


def precision(dtype: torch.dtype) -> str | None:
    """fp32 scores in full precision (not tf32): the selection compares them, and the tests compare
    selections with the reference's; other dtypes take tl.dot's default."""
    return "ieee" if dtype == torch.float32 else None


def padded(size: int) -> int:
    """The power of two at or above size, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (size - 1).bit_length())


def power_of_two_below(size: int) -> int:
    return 1 << (max(1, size).bit_length() - 1)


@functools.cache
def _kernels(interpreted: bool) -> dict:
    """Defined on first use (so importing attnlab does not import triton), once per mode: kernels
    defined under TRITON_INTERPRET=1 are interpreted ones."""
    import triton
    import triton.language as tl

    @triton.jit
    def forward_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, importance_ptr,
        n_queries, n_keys, n_selection, scale, causal_shift,
        HEADS_PER_GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr, STRIDE: tl.constexpr,
        SELECTION_BLOCK: tl.constexpr, R_PAD: tl.constexpr, DIM_PAD: tl.constexpr, KEYS: tl.constexpr,
        SELECTIONS: tl.constexpr, COVER_PAD: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # program = (t, b g); q, out [B, G, T, R, D]; k, v [B, G, J, D]; lse [B, G, T, R]; importance [B, G, T, M]
        query = tl.program_id(0)
        batch_group = tl.program_id(1)
        heads = tl.arange(0, R_PAD)
        dims = tl.arange(0, DIM_PAD)
        head_ok = heads < HEADS_PER_GROUP
        row_mask = head_ok[:, None] & (dims < DIM)[None, :]
        row = (batch_group * n_queries + query) * HEADS_PER_GROUP
        q = tl.load(q_ptr + (row + heads)[:, None] * DIM + dims[None, :], mask=row_mask, other=0.0)  # [R, D]
        # the memory slot and the compressed blocks whose last token is at or before the query
        # (causal_shift is 0 except in the test that shows a broken causal bound is caught)
        seen = query + causal_shift + 1
        n_visible = tl.minimum(tl.where(seen >= BLOCK, (seen - BLOCK) // STRIDE + 1, 0) + 1, n_keys)
        running_max = tl.full((R_PAD,), float("-inf"), tl.float32)
        running_sum = tl.zeros((R_PAD,), tl.float32)
        accumulator = tl.zeros((R_PAD, DIM_PAD), tl.float32)
        key_base = batch_group * n_keys
        for start in range(0, n_visible, KEYS):  # eq. 7, with an online softmax
            keys = start + tl.arange(0, KEYS)
            key_ok = keys < n_visible
            key_mask = key_ok[:, None] & (dims < DIM)[None, :]
            k = tl.load(k_ptr + (key_base + keys)[:, None] * DIM + dims[None, :], mask=key_mask, other=0.0)
            v = tl.load(v_ptr + (key_base + keys)[:, None] * DIM + dims[None, :], mask=key_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [R, KEYS]
            scores = tl.where(key_ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))  # finite: the memory slot is in tile 0
            correction = tl.exp(running_max - new_max)
            probs = tl.exp(scores - new_max[:, None])
            running_sum = running_sum * correction + tl.sum(probs, axis=1)
            accumulator = accumulator * correction[:, None] + tl.dot(probs.to(v.dtype), v)
            running_max = new_max
        lse = running_max + tl.log(running_sum)
        tl.store(out_ptr + (row + heads)[:, None] * DIM + dims[None, :],
                 (accumulator / running_sum[:, None]).to(out_ptr.dtype.element_ty), mask=row_mask)
        tl.store(lse_ptr + row + heads, lse, mask=head_ok)
        # eq. 8-10: the importance of the selection blocks at or before the query's own
        units_per_block: tl.constexpr = BLOCK // STRIDE
        units_per_selection: tl.constexpr = SELECTION_BLOCK // STRIDE
        n_causal = tl.minimum(query // SELECTION_BLOCK + 1, n_selection)
        selection_row = (batch_group * n_queries + query) * n_selection
        for first in range(0, n_causal, SELECTIONS):
            selections = first + tl.arange(0, SELECTIONS)
            # the compressed blocks overlapping these selection blocks; block i covers units i .. i + c - 1
            blocks = first * units_per_selection - (units_per_block - 1) + tl.arange(0, COVER_PAD)
            keys = blocks + 1  # the memory slot comes first
            key_ok = (blocks >= 0) & (keys < n_visible) & (tl.arange(0, COVER_PAD) < SELECTIONS * units_per_selection
                                                           + units_per_block - 1)
            k = tl.load(k_ptr + (key_base + keys)[:, None] * DIM + dims[None, :],
                        mask=key_ok[:, None] & (dims < DIM)[None, :], other=0.0)  # [COVER, D]
            probs = tl.exp(tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale - lse[:, None])
            probs = tl.where(head_ok[:, None] & key_ok[None, :], probs, 0.0)
            per_block = tl.sum(probs, axis=0)  # eq. 10: summed over the group's heads [COVER]
            # eq. 9: a block counts once for every stride unit it shares with a selection block
            shared_first = tl.maximum(blocks[:, None], selections[None, :] * units_per_selection)
            shared_last = tl.minimum(blocks[:, None] + units_per_block - 1,
                                     selections[None, :] * units_per_selection + units_per_selection - 1)
            overlap = tl.maximum(shared_last - shared_first + 1, 0).to(tl.float32)  # [COVER, SELECTIONS]
            importance = tl.sum(per_block[:, None] * overlap, axis=0)
            tl.store(importance_ptr + selection_row + selections, importance, mask=selections < n_causal)

    @triton.jit
    def backward_query_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, grad_out_ptr, grad_importance_ptr, grad_q_ptr, delta_ptr,
        n_queries, n_keys, n_selection, scale,
        HEADS_PER_GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr, STRIDE: tl.constexpr,
        SELECTION_BLOCK: tl.constexpr, R_PAD: tl.constexpr, DIM_PAD: tl.constexpr, KEYS: tl.constexpr,
        HAS_IMPORTANCE: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # program = (t, b g): grad_q [B, G, T, R, D]; delta [B, G, T, R] for the key-centric kernel
        query = tl.program_id(0)
        batch_group = tl.program_id(1)
        heads = tl.arange(0, R_PAD)
        dims = tl.arange(0, DIM_PAD)
        head_ok = heads < HEADS_PER_GROUP
        row_mask = head_ok[:, None] & (dims < DIM)[None, :]
        row = (batch_group * n_queries + query) * HEADS_PER_GROUP
        offsets = (row + heads)[:, None] * DIM + dims[None, :]
        q = tl.load(q_ptr + offsets, mask=row_mask, other=0.0).to(tl.float32)
        grad_out = tl.load(grad_out_ptr + offsets, mask=row_mask, other=0.0).to(tl.float32)
        out = tl.load(out_ptr + offsets, mask=row_mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + row + heads, mask=head_ok, other=0.0)
        n_visible = tl.minimum(tl.where(query + 1 >= BLOCK, (query + 1 - BLOCK) // STRIDE + 1, 0) + 1, n_keys)
        key_base = batch_group * n_keys
        selection_row = (batch_group * n_queries + query) * n_selection
        delta = tl.sum(grad_out * out, axis=1)  # [R] sum_j P_j (dO . v_j)
        if HAS_IMPORTANCE:  # plus sum_j P_j dI_j, which needs a pass of its own
            for start in range(0, n_visible, KEYS):
                keys = start + tl.arange(0, KEYS)
                key_ok = keys < n_visible
                k = tl.load(k_ptr + (key_base + keys)[:, None] * DIM + dims[None, :],
                            mask=key_ok[:, None] & (dims < DIM)[None, :], other=0.0).to(tl.float32)
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                probs = tl.where(key_ok[None, :], tl.exp(scores - lse[:, None]), 0.0)
                extra = tl.zeros((KEYS,), tl.float32)  # dL/dP of each block from the importance
                for shift in tl.static_range(BLOCK // STRIDE):  # eq. 9 transposed: dI over the block's units
                    selection = (keys - 1 + shift) // (SELECTION_BLOCK // STRIDE)
                    extra += tl.load(grad_importance_ptr + selection_row + selection,
                                     mask=key_ok & (keys >= 1) & (selection < n_selection), other=0.0)
                delta += tl.sum(probs * extra[None, :], axis=1)
        tl.store(delta_ptr + row + heads, delta, mask=head_ok)
        grad_q = tl.zeros((R_PAD, DIM_PAD), tl.float32)
        for start in range(0, n_visible, KEYS):
            keys = start + tl.arange(0, KEYS)
            key_ok = keys < n_visible
            key_mask = key_ok[:, None] & (dims < DIM)[None, :]
            k = tl.load(k_ptr + (key_base + keys)[:, None] * DIM + dims[None, :], mask=key_mask, other=0.0
                        ).to(tl.float32)
            v = tl.load(v_ptr + (key_base + keys)[:, None] * DIM + dims[None, :], mask=key_mask, other=0.0
                        ).to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            probs = tl.where(key_ok[None, :], tl.exp(scores - lse[:, None]), 0.0)
            grad_probs = tl.dot(grad_out, tl.trans(v))  # [R, KEYS]
            if HAS_IMPORTANCE:
                for shift in tl.static_range(BLOCK // STRIDE):
                    selection = (keys - 1 + shift) // (SELECTION_BLOCK // STRIDE)
                    grad_probs += tl.load(grad_importance_ptr + selection_row + selection,
                                          mask=key_ok & (keys >= 1) & (selection < n_selection), other=0.0)[None, :]
            grad_scores = probs * (grad_probs - delta[:, None]) * scale
            grad_q += tl.dot(grad_scores, k)
        tl.store(grad_q_ptr + offsets, grad_q.to(grad_q_ptr.dtype.element_ty), mask=row_mask)

    @triton.jit
    def backward_key_kernel(
        q_ptr, k_ptr, v_ptr, lse_ptr, delta_ptr, grad_out_ptr, grad_importance_ptr, grad_k_ptr, grad_v_ptr,
        n_queries, n_keys, n_selection, scale,
        HEADS_PER_GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr, STRIDE: tl.constexpr,
        SELECTION_BLOCK: tl.constexpr, DIM_PAD: tl.constexpr, KEYS: tl.constexpr, ROWS: tl.constexpr,
        ROWS_PER_PROGRAM: tl.constexpr, HAS_IMPORTANCE: tl.constexpr, PRECISION: tl.constexpr,
    ):
        # program = (key tile, b g, split): rows are (query, head) pairs, T R of them, and the program
        # takes those of its split; partial grad_k, grad_v [splits, B, G, J, D] fp32
        tile = tl.program_id(0)
        batch_group = tl.program_id(1)
        split = tl.program_id(2)
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < DIM
        keys = tile * KEYS + tl.arange(0, KEYS)
        key_ok = keys < n_keys
        key_mask = key_ok[:, None] & dim_ok[None, :]
        key_offsets = (batch_group * n_keys + keys)[:, None] * DIM + dims[None, :]
        k = tl.load(k_ptr + key_offsets, mask=key_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + key_offsets, mask=key_mask, other=0.0).to(tl.float32)
        key_end = (keys - 1) * STRIDE + BLOCK - 1  # the last token of each compressed block
        grad_k = tl.zeros((KEYS, DIM_PAD), tl.float32)
        grad_v = tl.zeros((KEYS, DIM_PAD), tl.float32)
        n_rows = n_queries * HEADS_PER_GROUP
        first_query = tl.where(tile == 0, 0, (tile * KEYS - 1) * STRIDE + BLOCK - 1)  # sees the tile's first key
        split_end = tl.minimum(n_rows, (split + 1) * ROWS_PER_PROGRAM)
        for start in range(tl.maximum(first_query * HEADS_PER_GROUP, split * ROWS_PER_PROGRAM), split_end, ROWS):
            rows = start + tl.arange(0, ROWS)
            row_ok = rows < split_end
            query = rows // HEADS_PER_GROUP
            global_rows = batch_group * n_rows + rows
            row_mask = row_ok[:, None] & dim_ok[None, :]
            q = tl.load(q_ptr + global_rows[:, None] * DIM + dims[None, :], mask=row_mask, other=0.0).to(tl.float32)
            grad_out = tl.load(grad_out_ptr + global_rows[:, None] * DIM + dims[None, :], mask=row_mask,
                               other=0.0).to(tl.float32)
            lse = tl.load(lse_ptr + global_rows, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + global_rows, mask=row_ok, other=0.0)
            visible = row_ok[:, None] & key_ok[None, :] & ((keys[None, :] == 0) | (key_end[None, :] <= query[:, None]))
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [ROWS, KEYS]
            probs = tl.where(visible, tl.exp(scores - lse[:, None]), 0.0)
            grad_v += tl.dot(tl.trans(probs), grad_out)
            grad_probs = tl.dot(grad_out, tl.trans(v))
            if HAS_IMPORTANCE:
                selection_row = (batch_group * n_queries + query) * n_selection  # [ROWS]
                for shift in tl.static_range(BLOCK // STRIDE):
                    selection = (keys[None, :] - 1 + shift) // (SELECTION_BLOCK // STRIDE)  # [1, KEYS]
                    grad_probs += tl.load(grad_importance_ptr + selection_row[:, None] + selection,
                                          mask=visible & (keys[None, :] >= 1) & (selection < n_selection), other=0.0)
            grad_scores = probs * (grad_probs - delta[:, None]) * scale
            grad_k += tl.dot(tl.trans(grad_scores), q)
        partial = split * (tl.num_programs(1) * n_keys * DIM)
        tl.store(grad_k_ptr + partial + key_offsets, grad_k, mask=key_mask)
        tl.store(grad_v_ptr + partial + key_offsets, grad_v, mask=key_mask)

    @triton.jit
    def selection_kernel(
        importance_ptr, indices_ptr, valid_ptr, n_queries, n_selection,
        N_SELECTED: tl.constexpr, SELECTION_BLOCK: tl.constexpr, M_PAD: tl.constexpr, N_PAD: tl.constexpr,
        INVERT: tl.constexpr,
    ):
        # program = (t, b g): importance [B, G, T, M] -> indices (int64), valid (int8) [B, G, T, n]
        query = tl.program_id(0)
        batch_group = tl.program_id(1)
        row = batch_group * n_queries + query
        blocks = tl.arange(0, M_PAD)
        importance = tl.load(importance_ptr + row * n_selection + blocks, mask=blocks < n_selection, other=0.0)
        if INVERT:  # only in the test that shows a broken selection order is caught
            importance = -importance
        current = query // SELECTION_BLOCK
        ranking = tl.where((blocks <= current) & (blocks < n_selection), importance, float("-inf"))
        ranking = tl.where((blocks == 0) | (blocks == current), float("inf"), ranking)  # always selected
        chosen = blocks < 0
        for _ in tl.static_range(N_SELECTED):  # top-n, ties to the lower block
            best = tl.max(ranking, axis=0)
            pick = tl.min(tl.where(ranking == best, blocks, M_PAD), axis=0)
            take = (blocks == pick) & (ranking > float("-inf"))  # nothing left: take none
            chosen = chosen | take
            ranking = tl.where(take, float("-inf"), ranking)
        slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # ascending order of the chosen blocks
        tl.store(indices_ptr + row * N_SELECTED + slot, blocks.to(tl.int64), mask=chosen)
        n_chosen = tl.sum(chosen.to(tl.int32), axis=0)
        slots = tl.arange(0, N_PAD)
        padding = (slots >= n_chosen) & (slots < N_SELECTED)
        tl.store(indices_ptr + row * N_SELECTED + slots, tl.zeros((N_PAD,), tl.int64), mask=padding)
        tl.store(valid_ptr + row * N_SELECTED + slots, (slots < n_chosen).to(tl.int8), mask=slots < N_SELECTED)

    return dict(forward=forward_kernel, backward_query=backward_query_kernel, backward_key=backward_key_kernel,
                selection=selection_kernel)


def kernels() -> dict:
    return _kernels(interpreting())


def block_sizes(block: int, stride: int, selection_block: int) -> dict:
    return dict(BLOCK=block, STRIDE=stride, SELECTION_BLOCK=selection_block)


def n_selection_blocks(n_queries: int, selection_block: int) -> int:
    """Selection blocks the queries 0..T-1 may choose from (the last one possibly partial)."""
    return -(-n_queries // selection_block)


def compressed_forward(q: Tensor, keys: Tensor, values: Tensor, block: int, stride: int, selection_block: int,
                       causal_shift: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, G, T, R, D] at positions 0..T-1; keys, values [B, G, J, D] (memory slot first) ->
    output [B, G, T, R, D], log-sum-exp [B, G, T, R], importance [B, G, T, M] (fp32).
    causal_shift lets a query see blocks complete up to `causal_shift` tokens after it: nonzero
    only in the test that shows a broken causal bound is caught."""
    batch, n_groups, n_queries, heads_per_group, dim_head = q.shape
    q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
    n_selection = n_selection_blocks(n_queries, selection_block)
    output = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)  # [B, G, T, R]
    importance = torch.zeros(batch, n_groups, n_queries, n_selection, dtype=torch.float32, device=q.device)
    selections = power_of_two_below(max(1, SELECTION_UNITS // (selection_block // stride)))
    cover = selections * (selection_block // stride) + block // stride - 1
    kernels()["forward"][(n_queries, batch * n_groups)](
        q, keys, values, output, lse, importance, n_queries, keys.shape[2], n_selection,
        1 / math.sqrt(dim_head), causal_shift, HEADS_PER_GROUP=heads_per_group, DIM=dim_head,
        **block_sizes(block, stride, selection_block), R_PAD=padded(heads_per_group), DIM_PAD=padded(dim_head),
        KEYS=KEY_TILE, SELECTIONS=selections, COVER_PAD=padded(cover), PRECISION=precision(q.dtype),
    )
    return output, lse, importance


def select_blocks(importance: Tensor, n_selected: int, selection_block: int, invert: bool = False
                  ) -> tuple[Tensor, Tensor]:
    """importance [B, G, T, M] of queries at 0..T-1 -> indices (int64), valid (bool) [B, G, T, n].
    invert picks the least important blocks: only in the test that shows a broken order is caught."""
    batch, n_groups, n_queries, n_selection = importance.shape
    indices = torch.empty(batch, n_groups, n_queries, n_selected, dtype=torch.int64, device=importance.device)
    valid = torch.empty(indices.shape, dtype=torch.int8, device=importance.device)
    kernels()["selection"][(n_queries, batch * n_groups)](
        importance.contiguous(), indices, valid, n_queries, n_selection, N_SELECTED=n_selected,
        SELECTION_BLOCK=selection_block, M_PAD=padded(n_selection), N_PAD=padded(n_selected), INVERT=invert,
    )
    return indices, valid.bool()


# ----------------------------------------------------------------------------------------------
# torch custom ops, so torch.compile traces through them


@torch.library.custom_op("attnlab::nsa_compressed_attention_triton", mutates_args=())
def compressed_attention_op(q: Tensor, keys: Tensor, values: Tensor, block: int, stride: int, selection_block: int,
                            importance_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """q [B, G, T, R, D], keys, values [B, G, J, D] -> (output [B, G, T, R, D], log-sum-exp
    [B, G, T, R], importance [B, G, T, M]). importance_grad: the importance's gradient (straight-
    through gates) is carried back into q and keys; otherwise the backward ignores it."""
    return compressed_forward(q, keys, values, block, stride, selection_block)


@compressed_attention_op.register_fake
def _(q, keys, values, block, stride, selection_block, importance_grad):
    n_selection = n_selection_blocks(q.shape[2], selection_block)
    return (q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32),
            q.new_empty(*q.shape[:3], n_selection, dtype=torch.float32))


@torch.library.custom_op("attnlab::nsa_compressed_attention_triton_backward", mutates_args=())
def compressed_attention_backward(grad_output: Tensor, grad_importance: Tensor, q: Tensor, keys: Tensor,
                                  values: Tensor, output: Tensor, lse: Tensor, block: int, stride: int,
                                  selection_block: int) -> tuple[Tensor, Tensor, Tensor]:
    """-> dq [B, G, T, R, D], dkeys, dvalues [B, G, J, D]; grad_importance [B, G, T, M], or empty [0]."""
    batch, n_groups, n_queries, heads_per_group, dim_head = q.shape
    q, keys, values, output = q.contiguous(), keys.contiguous(), values.contiguous(), output.contiguous()
    grad_output, grad_importance = grad_output.contiguous(), grad_importance.float().contiguous()
    has_importance = grad_importance.numel() > 0
    n_selection = n_selection_blocks(n_queries, selection_block)
    grad_q = torch.empty_like(q)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)  # [B, G, T, R]
    n_splits = triton_cdiv(n_queries * heads_per_group, ROWS_PER_PROGRAM)
    grad_keys, grad_values = (torch.empty(n_splits, *keys.shape, dtype=torch.float32, device=q.device)
                              for _ in range(2))  # [splits, B, G, J, D], summed below
    common = dict(HEADS_PER_GROUP=heads_per_group, DIM=dim_head, **block_sizes(block, stride, selection_block),
                  DIM_PAD=padded(dim_head), KEYS=KEY_TILE, HAS_IMPORTANCE=has_importance,
                  PRECISION=precision(q.dtype))
    scale = 1 / math.sqrt(dim_head)
    importance_pointer = grad_importance if has_importance else lse
    kernels()["backward_query"][(n_queries, batch * n_groups)](
        q, keys, values, output, lse, grad_output, importance_pointer, grad_q, delta,
        n_queries, keys.shape[2], n_selection, scale, R_PAD=padded(heads_per_group), **common)
    kernels()["backward_key"][(triton_cdiv(keys.shape[2], KEY_TILE), batch * n_groups, n_splits)](
        q, keys, values, lse, delta, grad_output, importance_pointer, grad_keys, grad_values,
        n_queries, keys.shape[2], n_selection, scale, ROWS=ROW_TILE, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, **common)
    return grad_q, grad_keys.sum(0).to(keys.dtype), grad_values.sum(0).to(values.dtype)


@compressed_attention_backward.register_fake
def _(grad_output, grad_importance, q, keys, values, output, lse, block, stride, selection_block):
    return q.new_empty(q.shape), keys.new_empty(keys.shape), values.new_empty(values.shape)


def triton_cdiv(size: int, tile: int) -> int:
    return -(-size // tile)


def _setup(ctx, inputs, output) -> None:
    q, keys, values, block, stride, selection_block, importance_grad = inputs
    ctx.save_for_backward(q, keys, values, output[0], output[1])
    ctx.sizes = (block, stride, selection_block)
    ctx.importance_grad = importance_grad


def _backward(ctx, grad_output, _grad_lse, grad_importance):
    q, keys, values, output, lse = ctx.saved_tensors
    if not ctx.importance_grad or grad_importance is None:
        grad_importance = lse.new_empty(0)
    grad_q, grad_keys, grad_values = compressed_attention_backward(
        grad_output, grad_importance, q, keys, values, output, lse, *ctx.sizes)
    return grad_q, grad_keys, grad_values, None, None, None, None


compressed_attention_op.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("attnlab::nsa_select_blocks_triton", mutates_args=())
def select_blocks_op(importance: Tensor, n_selected: int, selection_block: int) -> tuple[Tensor, Tensor]:
    """importance [B, G, T, M] -> indices, valid [B, G, T, n] (no gradient: a discrete choice)."""
    return select_blocks(importance, n_selected, selection_block)


@select_blocks_op.register_fake
def _(importance, n_selected, selection_block):
    shape = (*importance.shape[:3], n_selected)
    return importance.new_empty(shape, dtype=torch.int64), importance.new_empty(shape, dtype=torch.bool)


def compressed_branch(q: Tensor, keys: Tensor, values: Tensor, block: int, stride: int, selection_block: int,
                      n_selected: int, straight_through: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The compressed branch and the selection by the Triton kernels, for a whole sequence from
    position 0: q [B, H, T, D] (no rotary); keys, values [B, G, J, D], the memory slot first ->
    output [B, H, T, D], indices, valid and selection scores [B, G, T, n] (the scores carry a
    gradient into q and keys when straight_through)."""
    from einops import rearrange

    check_available(q.device)
    grouped = rearrange(q, "b (g r) t d -> b g t r d", g=keys.shape[1])  # [B, G, T, R, D]
    output, _, importance = compressed_attention_op(grouped, keys.to(q.dtype), values.to(q.dtype), block, stride,
                                                    selection_block, straight_through)
    indices, valid = select_blocks_op(importance.detach(), n_selected, selection_block)
    scores = importance.gather(-1, indices)  # [B, G, T, n]
    return rearrange(output, "b g t r d -> b (g r) t d"), indices, valid, scores
