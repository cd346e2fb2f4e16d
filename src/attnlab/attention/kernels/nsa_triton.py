"""The `triton` back-end of NSA's selected branch, forward and backward (same semantics as
attention/nsa.py's reference `selected_attention`, which the tests compare against), registered
as torch custom ops.

One program per (batch, key/value group, query): it loads the R query heads of the group together
(they share the selection, eq. 10), walks the query's n selected blocks of `block` keys, and keeps an
online softmax (flash attention) over them; keys after the query are masked (query-group-centric:
each key block is loaded once for the whole group). The backward recomputes the probabilities from
the saved log-sum-exp in two kernels: a query-centric one (dq, the gates' gradient and each head's
delta = dO . O), and a key-block-centric one: one program per key block, which walks the list of
(query, slot) pairs that chose the block (built by a stable sort of the selections, `query_lists`;
a long list, as the initial block's, split over several programs, `work_items`) and accumulates
the block's dK, dV in registers, stored once per program, with no atomics; a last kernel adds each
block's pieces in order. The selection block need not equal
the compression block, and any R >= 1 works: R, the block and the head width are padded to powers
of two (at least 16, tl.dot's minimum) and masked.

Straight-through gates (use_diff_topk) multiply each selected block's values: the kernel takes them
and returns their gradient, as the torch path does.

Triton is imported lazily: attnlab imports without it. Runs on CUDA, or on CPU tensors under
TRITON_INTERPRET=1 (the tests), where it is slow and meant for small checks only.

Legend: B batch, G key/value heads, R query heads per group, T queries, S keys, D head width,
n selected blocks per query, l' selection block.
"""

from __future__ import annotations

import functools
import math
import os

import torch
from torch import Tensor

from attnlab.compiler import assume_constant_result
from attnlab.errors import ConfigError


@assume_constant_result
def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@assume_constant_result
def triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_installed() -> None:
    """Raise a one-line ConfigError unless triton can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError as error:
        raise ConfigError("nsa backend=triton needs triton (pip install triton); use backend=torch") from error


def check_available(device: torch.device) -> None:
    """Raise a one-line ConfigError unless Triton can run on this device."""
    check_installed()
    if device.type != "cuda" and not interpreting():
        raise ConfigError(
            f"nsa backend=triton runs on CUDA tensors (got {device.type}); use backend=torch, "
            "or TRITON_INTERPRET=1 for a slow CPU check"
        )


def _padded(size: int) -> int:
    return max(16, 1 << (size - 1).bit_length())


@functools.cache
def _forward_kernel(interpreted: bool):
    """Defined on first use, so importing attnlab does not import triton; once per mode (kernels
    defined under TRITON_INTERPRET=1 are interpreted ones)."""
    import triton
    import triton.language as tl

    @triton.jit
    def forward_kernel(
        q_ptr, k_ptr, v_ptr, indices_ptr, valid_ptr, gates_ptr, out_ptr, lse_ptr,
        n_queries, n_keys, offset, scale, causal_shift,
        HEADS_PER_GROUP: tl.constexpr, N_SELECTED: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr,
        R_PAD: tl.constexpr, BLOCK_PAD: tl.constexpr, DIM_PAD: tl.constexpr, HAS_GATES: tl.constexpr,
    ):
        # program = (t, b g); q, out [B, G, T, R, D]; k, v [B, G, S, D]; indices [B, G, T, n]; lse [B, G, T, R]
        query = tl.program_id(0)
        batch_group = tl.program_id(1)
        position = query + offset + causal_shift  # causal_shift: 0 except in the test of a broken bound
        heads = tl.arange(0, R_PAD)
        dims = tl.arange(0, DIM_PAD)
        tokens = tl.arange(0, BLOCK_PAD)
        head_ok = heads < HEADS_PER_GROUP
        dim_ok = dims < DIM
        row = (batch_group * n_queries + query) * HEADS_PER_GROUP
        q = tl.load(q_ptr + (row + heads)[:, None] * DIM + dims[None, :],
                    mask=head_ok[:, None] & dim_ok[None, :], other=0.0)  # [R, D]
        running_max = tl.full((R_PAD,), float("-inf"), tl.float32)
        running_sum = tl.zeros((R_PAD,), tl.float32)
        accumulator = tl.zeros((R_PAD, DIM_PAD), tl.float32)
        selection = (batch_group * n_queries + query) * N_SELECTED
        for slot in range(N_SELECTED):
            block_index = tl.load(indices_ptr + selection + slot)
            valid_flag = tl.load(valid_ptr + selection + slot).to(tl.int32)
            key = block_index * BLOCK + tokens  # [l']
            key_ok = (tokens < BLOCK) & (key <= position) & (key < n_keys) & ((tokens * 0 + valid_flag) != 0)
            key_rows = batch_group * n_keys + key
            k = tl.load(k_ptr + key_rows[:, None] * DIM + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :],
                        other=0.0)  # [l', D]
            v = tl.load(v_ptr + key_rows[:, None] * DIM + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :],
                        other=0.0)
            scores = tl.dot(q, tl.trans(k)) * scale  # [R, l']
            scores = tl.where(key_ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key seen yet: keep exp finite
            correction = tl.exp(running_max - safe_max)
            probs = tl.exp(scores - safe_max[:, None])  # [R, l']
            running_sum = running_sum * correction + tl.sum(probs, axis=1)
            if HAS_GATES:
                probs = probs * tl.load(gates_ptr + selection + slot)
            accumulator = accumulator * correction[:, None] + tl.dot(probs.to(v.dtype), v)
            running_max = new_max
        output = accumulator / running_sum[:, None]
        tl.store(out_ptr + (row + heads)[:, None] * DIM + dims[None, :], output.to(out_ptr.dtype.element_ty),
                 mask=head_ok[:, None] & dim_ok[None, :])
        tl.store(lse_ptr + row + heads, running_max + tl.log(running_sum), mask=head_ok)

    return forward_kernel


@functools.cache
def _backward_kernels(interpreted: bool) -> tuple:
    """Defined on first use, once per mode (TRITON_INTERPRET=1 or compiled)."""
    import triton
    import triton.language as tl

    @triton.jit
    def backward_query_kernel(
        q_ptr, k_ptr, v_ptr, indices_ptr, valid_ptr, gates_ptr, out_ptr, lse_ptr, grad_out_ptr,
        grad_q_ptr, grad_gates_ptr, delta_ptr,
        n_queries, n_keys, offset, scale,
        HEADS_PER_GROUP: tl.constexpr, N_SELECTED: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr,
        R_PAD: tl.constexpr, BLOCK_PAD: tl.constexpr, DIM_PAD: tl.constexpr, HAS_GATES: tl.constexpr,
    ):
        # program = (t, b g): grad_q [B, G, T, R, D]; grad_gates [B, G, T, n]; delta [B, G, T, R] (for the key kernel)
        query = tl.program_id(0)
        batch_group = tl.program_id(1)
        position = query + offset
        heads = tl.arange(0, R_PAD)
        dims = tl.arange(0, DIM_PAD)
        tokens = tl.arange(0, BLOCK_PAD)
        head_ok = heads < HEADS_PER_GROUP
        dim_ok = dims < DIM
        row = (batch_group * n_queries + query) * HEADS_PER_GROUP
        row_mask = head_ok[:, None] & dim_ok[None, :]
        q = tl.load(q_ptr + (row + heads)[:, None] * DIM + dims[None, :], mask=row_mask, other=0.0).to(tl.float32)
        grad_out = tl.load(grad_out_ptr + (row + heads)[:, None] * DIM + dims[None, :], mask=row_mask,
                           other=0.0).to(tl.float32)
        out = tl.load(out_ptr + (row + heads)[:, None] * DIM + dims[None, :], mask=row_mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + row + heads, mask=head_ok, other=0.0)
        delta = tl.sum(grad_out * out, axis=1)  # [R]
        tl.store(delta_ptr + row + heads, delta, mask=head_ok)
        grad_q = tl.zeros((R_PAD, DIM_PAD), tl.float32)
        selection = (batch_group * n_queries + query) * N_SELECTED
        for slot in range(N_SELECTED):
            block_index = tl.load(indices_ptr + selection + slot)
            valid_flag = tl.load(valid_ptr + selection + slot).to(tl.int32)
            key = block_index * BLOCK + tokens
            key_ok = (tokens < BLOCK) & (key <= position) & (key < n_keys) & ((tokens * 0 + valid_flag) != 0)
            key_rows = batch_group * n_keys + key
            key_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + key_rows[:, None] * DIM + dims[None, :], mask=key_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + key_rows[:, None] * DIM + dims[None, :], mask=key_mask, other=0.0).to(tl.float32)
            probs = tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None])  # [R, l']
            probs = tl.where(key_ok[None, :] & head_ok[:, None], probs, 0.0)
            grad_weighted = tl.dot(grad_out, tl.trans(v))  # dL/d(probs * gate) [R, l']
            if HAS_GATES:
                gate = tl.load(gates_ptr + selection + slot).to(tl.float32)
                tl.store(grad_gates_ptr + selection + slot, tl.sum(tl.sum(grad_weighted * probs, axis=1), axis=0))
                grad_probs = grad_weighted * gate
            else:
                grad_probs = grad_weighted
            grad_q += tl.dot(probs * (grad_probs - delta[:, None]) * scale, k)
        tl.store(grad_q_ptr + (row + heads)[:, None] * DIM + dims[None, :], grad_q.to(grad_q_ptr.dtype.element_ty),
                 mask=row_mask)

    @triton.jit
    def backward_key_kernel(
        q_ptr, k_ptr, v_ptr, gates_ptr, lse_ptr, delta_ptr, grad_out_ptr, order_ptr,
        item_block_ptr, item_begin_ptr, item_end_ptr, partial_k_ptr, partial_v_ptr,
        n_queries, n_keys, n_items, offset, scale,
        HEADS_PER_GROUP: tl.constexpr, N_SELECTED: tl.constexpr, BLOCK: tl.constexpr, DIM: tl.constexpr,
        R_PAD: tl.constexpr, BLOCK_PAD: tl.constexpr, DIM_PAD: tl.constexpr, HAS_GATES: tl.constexpr,
        QUERIES: tl.constexpr,
    ):
        # program = (work item, b g): an item is a key block m of group g, loaded once, and a piece of
        # its list of (query, slot) pairs that chose it (order [B G, T n] grouped by block; a long list,
        # such as the initial block's, is split over several items), walked QUERIES at a time, each with
        # its R heads; dK, dV [l', D] accumulated in registers and stored once per item into
        # partial [B G, items, l', D] (fp32): no atomics
        item = tl.program_id(0)
        batch_group = tl.program_id(1)
        block_index = tl.load(item_block_ptr + batch_group * n_items + item)
        dims = tl.arange(0, DIM_PAD)
        tokens = tl.arange(0, BLOCK_PAD)
        dim_ok = dims < DIM
        key = block_index * BLOCK + tokens  # [l']
        key_ok = (tokens < BLOCK) & (key < n_keys)
        key_mask = key_ok[:, None] & dim_ok[None, :]
        key_offsets = (batch_group * n_keys + key)[:, None] * DIM + dims[None, :]
        k = tl.load(k_ptr + key_offsets, mask=key_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + key_offsets, mask=key_mask, other=0.0).to(tl.float32)
        grad_k = tl.zeros((BLOCK_PAD, DIM_PAD), tl.float32)
        grad_v = tl.zeros((BLOCK_PAD, DIM_PAD), tl.float32)
        list_start = tl.load(item_begin_ptr + batch_group * n_items + item)
        list_end = tl.load(item_end_ptr + batch_group * n_items + item)
        lanes = tl.arange(0, QUERIES * R_PAD)  # (query of the list, head) pairs
        heads = lanes % R_PAD
        for first in range(list_start, list_end, QUERIES):
            entry_ok = (first + lanes // R_PAD < list_end) & (heads < HEADS_PER_GROUP)
            entry = tl.load(order_ptr + batch_group * n_queries * N_SELECTED + first + lanes // R_PAD, mask=entry_ok,
                            other=0)  # query * n + slot
            query = entry // N_SELECTED
            rows = (batch_group * n_queries + query) * HEADS_PER_GROUP + heads  # [QUERIES R]
            row_mask = entry_ok[:, None] & dim_ok[None, :]
            q = tl.load(q_ptr + rows[:, None] * DIM + dims[None, :], mask=row_mask, other=0.0).to(tl.float32)
            grad_out = tl.load(grad_out_ptr + rows[:, None] * DIM + dims[None, :], mask=row_mask,
                               other=0.0).to(tl.float32)
            lse = tl.load(lse_ptr + rows, mask=entry_ok, other=0.0)
            delta = tl.load(delta_ptr + rows, mask=entry_ok, other=0.0)
            allowed = entry_ok[:, None] & key_ok[None, :] & (key[None, :] <= query[:, None] + offset)
            probs = tl.where(allowed, tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None]), 0.0)  # [QR, l']
            grad_probs = tl.dot(grad_out, tl.trans(v))
            if HAS_GATES:
                gate = tl.load(gates_ptr + batch_group * n_queries * N_SELECTED + entry, mask=entry_ok,
                               other=0.0).to(tl.float32)
                weighted = probs * gate[:, None]
                grad_probs = grad_probs * gate[:, None]
            else:
                weighted = probs
            grad_v += tl.dot(tl.trans(weighted), grad_out)
            grad_k += tl.dot(tl.trans(probs * (grad_probs - delta[:, None]) * scale), q)
        partial = ((batch_group * n_items + item) * BLOCK + tokens)[:, None] * DIM + dims[None, :]
        tl.store(partial_k_ptr + partial, grad_k, mask=(tokens < BLOCK)[:, None] & dim_ok[None, :])
        tl.store(partial_v_ptr + partial, grad_v, mask=(tokens < BLOCK)[:, None] & dim_ok[None, :])

    @triton.jit
    def sum_items_kernel(
        partial_k_ptr, partial_v_ptr, item_first_ptr, item_count_ptr, grad_k_ptr, grad_v_ptr,
        n_keys, n_blocks, n_items,
        BLOCK: tl.constexpr, DIM: tl.constexpr, BLOCK_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    ):
        # program = (m, b g): the sum of key block m's items (consecutive, in order: deterministic)
        block_index = tl.program_id(0)
        batch_group = tl.program_id(1)
        dims = tl.arange(0, DIM_PAD)
        tokens = tl.arange(0, BLOCK_PAD)
        tile_mask = (tokens < BLOCK)[:, None] & (dims < DIM)[None, :]
        first = tl.load(item_first_ptr + batch_group * n_blocks + block_index)
        count = tl.load(item_count_ptr + batch_group * n_blocks + block_index)
        grad_k = tl.zeros((BLOCK_PAD, DIM_PAD), tl.float32)
        grad_v = tl.zeros((BLOCK_PAD, DIM_PAD), tl.float32)
        for item in range(first, first + count):
            partial = ((batch_group * n_items + item) * BLOCK + tokens)[:, None] * DIM + dims[None, :]
            grad_k += tl.load(partial_k_ptr + partial, mask=tile_mask, other=0.0)
            grad_v += tl.load(partial_v_ptr + partial, mask=tile_mask, other=0.0)
        key = block_index * BLOCK + tokens
        key_mask = (tokens < BLOCK)[:, None] & (key < n_keys)[:, None] & (dims < DIM)[None, :]
        key_offsets = (batch_group * n_keys + key)[:, None] * DIM + dims[None, :]
        tl.store(grad_k_ptr + key_offsets, grad_k.to(grad_k_ptr.dtype.element_ty), mask=key_mask)
        tl.store(grad_v_ptr + key_offsets, grad_v.to(grad_v_ptr.dtype.element_ty), mask=key_mask)

    return backward_query_kernel, backward_key_kernel, sum_items_kernel


def query_lists(indices: Tensor, valid: Tensor, n_blocks: int) -> tuple[Tensor, Tensor]:
    """For each key block, the (query, slot) pairs that chose it: a counting pass by a stable sort.
    indices, valid [B, G, T, n] -> order [B G, T n] (entries t n + slot, grouped by block, ascending
    queries within a block) and starts [B G, M + 1] (block m's entries are order[starts[m]:starts[m+1]])."""
    batch, n_groups, n_queries, n_selected = indices.shape
    blocks = torch.where(valid, indices, n_blocks).reshape(batch * n_groups, n_queries * n_selected)  # invalid last
    sorted_blocks, order = torch.sort(blocks, dim=-1, stable=True)
    edges = torch.arange(n_blocks + 1, device=indices.device, dtype=sorted_blocks.dtype)
    starts = torch.searchsorted(sorted_blocks, edges.expand(batch * n_groups, -1).contiguous())
    return order.to(torch.int32).contiguous(), starts.to(torch.int32).contiguous()


def work_items(starts: Tensor, n_entries: int, per_item: int) -> dict[str, Tensor]:
    """Split each key block's list (starts [B G, M + 1] from query_lists, n_entries = T n in all)
    into items of at most per_item entries, at least one per block (its dK, dV are written even when
    no query chose it). The number of items I = M + ceil(T n / per_item) bounds their count from the
    shapes alone; the unused ones have empty ranges. -> block, begin, end [B G, I] of each item; first
    item and item count [B G, M] of each block (all int32)."""
    n_blocks = starts.shape[1] - 1
    counts = starts[:, 1:] - starts[:, :-1]  # [B G, M]
    chunks = ((counts + per_item - 1) // per_item).clamp(min=1)
    ends = chunks.cumsum(-1)  # [B G, M] one past each block's last item
    first = ends - chunks
    n_items = n_blocks + -(-n_entries // per_item)
    items = torch.arange(n_items, device=starts.device, dtype=ends.dtype).expand(starts.shape[0], -1).contiguous()
    block = torch.searchsorted(ends, items, right=True).clamp(max=n_blocks - 1)  # [B G, I]
    begin = starts.gather(-1, block) + (items - first.gather(-1, block)) * per_item
    end = torch.minimum(starts.gather(-1, block + 1), begin + per_item)
    used = items < ends[:, -1:]
    tables = {"block": block, "begin": torch.where(used, begin, 0), "end": torch.where(used, end, 0),
              "first": first, "count": chunks}
    return {name: table.to(torch.int32).contiguous() for name, table in tables.items()}


def _sizes(heads_per_group: int, n_selected: int, block: int, dim_head: int, has_gates: bool) -> dict:
    return dict(
        HEADS_PER_GROUP=heads_per_group, N_SELECTED=n_selected, BLOCK=block, DIM=dim_head,
        R_PAD=_padded(heads_per_group), BLOCK_PAD=_padded(block), DIM_PAD=_padded(dim_head), HAS_GATES=has_gates,
    )


# ----------------------------------------------------------------------------------------------
# attnlab::nsa_selected_attention_triton: torch custom ops, so torch.compile traces through them


def selected_forward(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, valid: Tensor, gates: Tensor, offset: int,
                     block: int, causal_shift: int = 0) -> tuple[Tensor, Tensor]:
    """The forward kernel's launch (arguments as the op's). causal_shift lets a query see keys up to
    `causal_shift` tokens after it: nonzero only in the test that shows a broken causal bound is caught."""
    batch, n_groups, n_queries, heads_per_group, dim_head = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    indices, valid = indices.contiguous().to(torch.int32), valid.contiguous().to(torch.int8)
    has_gates = gates.numel() > 0
    gates = gates.contiguous()
    output = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)  # [B, G, T, R]
    sizes = _sizes(heads_per_group, indices.shape[-1], block, dim_head, has_gates)
    _forward_kernel(interpreting())[(n_queries, batch * n_groups)](
        q, k, v, indices, valid, gates if has_gates else q, output, lse,
        n_queries, k.shape[2], offset, 1 / math.sqrt(dim_head), causal_shift, **sizes,
    )
    return output, lse


@torch.library.custom_op("attnlab::nsa_selected_attention_triton", mutates_args=())
def selected_attention_op(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, valid: Tensor, gates: Tensor,
                          offset: int, block: int) -> tuple[Tensor, Tensor]:
    """q [B, G, T, R, D] at positions offset..offset+T-1; k, v [B, G, S, D]; indices, valid [B, G, T, n];
    gates [B, G, T, n], or empty [0] for none. -> (output [B, G, T, R, D], log-sum-exp [B, G, T, R])."""
    return selected_forward(q, k, v, indices, valid, gates, offset, block)


@selected_attention_op.register_fake
def _(q, k, v, indices, valid, gates, offset, block):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


QUERY_LANES = 64  # (query, head) pairs per step of the key-block-centric backward
# list entries (query, slot) one key-block program walks at most: the initial block is chosen by
# every query, so its list is split over several programs (their partial dK, dV summed after)
ENTRIES_PER_PROGRAM = 4096


@torch.library.custom_op("attnlab::nsa_selected_attention_triton_backward", mutates_args=())
def selected_attention_backward(grad_output: Tensor, q: Tensor, k: Tensor, v: Tensor, indices: Tensor,
                                valid: Tensor, gates: Tensor, output: Tensor, lse: Tensor, offset: int, block: int
                                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Two kernels: query-centric (dq, the gates' gradient, delta) and key-block-centric (dK, dV,
    each key block walking the list of queries that chose it)."""
    query_kernel, key_kernel, sum_kernel = _backward_kernels(interpreting())
    batch, n_groups, n_queries, heads_per_group, dim_head = q.shape
    q, k, v, output = q.contiguous(), k.contiguous(), v.contiguous(), output.contiguous()
    has_gates = gates.numel() > 0
    gates, grad_output = gates.contiguous(), grad_output.contiguous()
    n_blocks = -(-k.shape[2] // block)
    order, starts = query_lists(indices, valid, n_blocks)
    items = work_items(starts, order.shape[1], ENTRIES_PER_PROGRAM)
    n_items = items["block"].shape[1]
    indices, valid = indices.contiguous().to(torch.int32), valid.contiguous().to(torch.int8)
    grad_q = torch.empty_like(q)
    grad_gates = torch.zeros(gates.shape, dtype=torch.float32, device=gates.device)
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)  # [B, G, T, R]
    grad_k, grad_v = torch.empty_like(k), torch.empty_like(v)
    sizes = _sizes(heads_per_group, indices.shape[-1], block, dim_head, has_gates)
    scale = 1 / math.sqrt(dim_head)
    query_kernel[(n_queries, batch * n_groups)](
        q, k, v, indices, valid, gates if has_gates else q, output, lse, grad_output,
        grad_q, grad_gates if has_gates else grad_q, delta, n_queries, k.shape[2], offset, scale, **sizes,
    )
    heads_padded = 1 << (heads_per_group - 1).bit_length()  # a power of two; lanes = queries x heads >= 16
    partial_k, partial_v = (torch.empty(batch * n_groups, n_items, block, dim_head, dtype=torch.float32,
                                        device=q.device) for _ in range(2))
    key_kernel[(n_items, batch * n_groups)](
        q, k, v, gates if has_gates else q, lse, delta, grad_output, order,
        items["block"], items["begin"], items["end"], partial_k, partial_v,
        n_queries, k.shape[2], n_items, offset, scale,
        **{**sizes, "R_PAD": heads_padded}, QUERIES=max(1, QUERY_LANES // heads_padded),
    )
    sum_kernel[(n_blocks, batch * n_groups)](
        partial_k, partial_v, items["first"], items["count"], grad_k, grad_v, k.shape[2], n_blocks, n_items,
        BLOCK=block, DIM=dim_head, BLOCK_PAD=sizes["BLOCK_PAD"], DIM_PAD=sizes["DIM_PAD"],
    )
    return grad_q, grad_k, grad_v, grad_gates.to(gates.dtype)


@selected_attention_backward.register_fake
def _(grad_output, q, k, v, indices, valid, gates, output, lse, offset, block):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), gates.new_empty(gates.shape)


def _setup(ctx, inputs, output) -> None:
    q, k, v, indices, valid, gates, offset, block = inputs
    ctx.save_for_backward(q, k, v, indices, valid, gates, *output)
    ctx.offset, ctx.block = offset, block


def _backward(ctx, grad_output, _grad_lse):
    q, k, v, indices, valid, gates, output, lse = ctx.saved_tensors
    grad_q, grad_k, grad_v, grad_gates = selected_attention_backward(
        grad_output, q, k, v, indices, valid, gates, output, lse, ctx.offset, ctx.block)
    return grad_q, grad_k, grad_v, None, None, grad_gates, None, None


selected_attention_op.register_autograd(_backward, setup_context=_setup)


def selected_attention(q, k, v, indices, valid, gates, offset: int, block: int) -> Tensor:
    """The selected branch by the Triton kernels: q [B, H, T, D] at positions offset..offset+T-1,
    k, v [B, G, S, D], indices, valid, gates [B, G, T, n] (gates may be None). -> [B, H, T, D]."""
    from einops import rearrange

    check_available(q.device)
    n_groups = k.shape[1]
    k, v = k.to(q.dtype), v.to(q.dtype)
    gates = q.new_empty(0) if gates is None else gates.to(q.dtype)
    grouped = rearrange(q, "b (g r) t d -> b g t r d", g=n_groups)
    output, _ = selected_attention_op(grouped, k, v, indices, valid, gates, offset, block)
    return rearrange(output, "b g t r d -> b (g r) t d")
