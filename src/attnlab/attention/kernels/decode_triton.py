"""The `triton` back-end of full and local attention's calls through a cache (a decode step, a
speculative verification) on CUDA: the same semantics as the cpu back-end's operator
(kernels/decode_cpu.py's `cached_attention`), which the tests compare with the oracle. Query t of
row b sees the keys at lo..positions[b, t] of the cache's storage (lo = position - window + 1 with a
window, else 0) and nothing else: a storage longer than the text (a compiled model's caches are a
power of two long, transformer.decode_capacity) costs no reads, where torch's attention with a mask
reads the whole storage.

Split keys, as flash decoding does (Dao, Haziza, Massa, Sizov 2023): the storage's positions are cut
into splits of SPLIT_KEYS; one program per (batch row, key/value head, split) scores its split's
keys for every query of the call and every query head of the group together (rows = queries x heads
per group, padded to tl.dot's 16), keeping an online softmax (flash attention), and writes its
unnormalised sum with its running maximum and total; a split past every query's position, or before
every query's window, writes an empty sum without reading a key. A second kernel merges the splits
each (row, group) used. The grids depend on the storage's shape alone, never on the positions, so a
CUDA graph captures a step once and replays it at every length.

Arithmetic: queries and storage of one 16-bit dtype are multiplied in it with float32 sums (the
tensor cores; what torch's attention does with them, the probabilities rounded to the values' dtype
before their product); a float32 call, or a mixed one (a bfloat16 cache beside float32 weights), in
float32 throughout (not tf32), as the cpu operator computes. The Triton interpreter multiplies
bfloat16 tiles wrongly (triton 3.9), so the CPU tests run that path in float16; tests/test_gpu.py
runs it in bfloat16.

Registered as a torch custom op (attnlab::cached_attention_triton), so torch.compile traces a step
through it. Triton is imported lazily: attnlab imports without it. Runs on CUDA, or on CPU tensors
under TRITON_INTERPRET=1 (the tests; slow, small sizes only).

Legend: B batch, H query heads, G key/value heads, R = H / G heads per group, T queries, L storage
positions, D head width, S splits.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from attnlab.attention.kernels.decode_cpu import out_layout
from attnlab.attention.kernels.nsa_triton import interpreting

SPLIT_KEYS = 256  # storage positions per program: a 4096-token context is 16 splits per (row, group)
MAX_WIDTH = 256  # head width
# a program's float32 accumulator, rows (queries x heads per group) by head width, both padded to
# powers of two: at most 128 x 128 (or 64 x 256), as a flash-attention program of 8 warps holds
MAX_ACCUMULATOR = 128 * 128


def serves(q: Tensor, keys: Tensor) -> bool:
    """Whether the kernels take queries q [B, H, T, D] over storage keys [B, G, L, D]: head widths up
    to MAX_WIDTH, queries x heads per group by width within MAX_ACCUMULATOR (padded), float32,
    bfloat16 or float16."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    rows = q.shape[2] * (q.shape[1] // keys.shape[1])
    return (q.shape[-1] <= MAX_WIDTH and _padded(rows) * _padded(q.shape[-1]) <= MAX_ACCUMULATOR
            and q.dtype in dtypes and keys.dtype in dtypes)


def native(q: Tensor, keys: Tensor) -> bool:
    """Whether the kernel multiplies in the queries' own dtype: queries and storage of one 16-bit
    dtype (what torch's attention does with them: products in that dtype, float32 sums, the
    probabilities rounded to it before the values' product). Else, a float32 call or a mixed one (a
    bfloat16 cache beside float32 weights), in float32 throughout, as the cpu operator computes."""
    return q.dtype == keys.dtype and q.dtype in (torch.bfloat16, torch.float16)


def _padded(size: int) -> int:
    return max(16, 1 << (size - 1).bit_length())


@functools.cache
def _kernels(interpreted: bool) -> tuple:
    """Defined on first use (importing attnlab does not import triton), once per mode: kernels
    defined under TRITON_INTERPRET=1 are interpreted ones."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(
        q_ptr, k_ptr, v_ptr, positions_ptr, partial_ptr, maximum_ptr, total_ptr,
        q_batch, q_head, q_query, k_batch, k_group, k_position, v_batch, v_group, v_position,
        n_groups, n_keys, n_splits, window, scale,
        QUERIES: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, ROWS_PAD: tl.constexpr, DIM: tl.constexpr,
        DIM_PAD: tl.constexpr, SPLIT: tl.constexpr, KEYS: tl.constexpr, NATIVE: tl.constexpr,
    ):
        # NATIVE: queries and storage of one 16-bit dtype, multiplied in it (float32 sums); else in float32
        # program = (b g, split); q [B, H, T, D] (last dimension contiguous); k, v [B, G, L, D];
        # partial [B G, S, ROWS_PAD, DIM_PAD], maximum and total [B G, S, ROWS_PAD] (float32)
        batch_group = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a storage may pass 2**31 elements
        split = tl.program_id(1).to(tl.int64)
        batch = batch_group // n_groups
        group = batch_group % n_groups
        rows = tl.arange(0, ROWS_PAD)  # row = query * R + head within the group
        row_ok = rows < QUERIES * HEADS_PER_GROUP
        query = rows // HEADS_PER_GROUP
        head = group * HEADS_PER_GROUP + rows % HEADS_PER_GROUP
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < DIM
        position = tl.load(positions_ptr + batch * QUERIES + query, mask=row_ok, other=-1)  # [ROWS]
        lowest = tl.where(window > 0, position - window + 1, 0)
        last_seen = tl.max(position)  # the latest key any query sees
        first_seen = tl.min(tl.where(row_ok, lowest, n_keys))  # the earliest
        running_max = tl.full((ROWS_PAD,), float("-inf"), tl.float32)
        running_sum = tl.zeros((ROWS_PAD,), tl.float32)
        accumulator = tl.zeros((ROWS_PAD, DIM_PAD), tl.float32)
        start = split * SPLIT
        if (start <= last_seen) & (start + SPLIT > first_seen):  # a split some query sees
            q = tl.load(q_ptr + batch * q_batch + head[:, None] * q_head + query[:, None] * q_query + dims[None, :],
                        mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [ROWS, D]
            if not NATIVE:
                q = q.to(tl.float32)
            for offset in range(0, SPLIT, KEYS):
                keys = start + offset + tl.arange(0, KEYS)
                if (start + offset <= last_seen) & (start + offset + KEYS > first_seen):
                    # a key no query sees is not read: past the text it may be anything, even inf
                    read = (keys < n_keys) & (keys <= last_seen) & (keys >= first_seen)
                    key_ok = read[:, None] & dim_ok[None, :]
                    k = tl.load(k_ptr + batch * k_batch + group * k_group + keys[:, None] * k_position + dims[None, :],
                                mask=key_ok, other=0.0)  # [KEYS, D]
                    v = tl.load(v_ptr + batch * v_batch + group * v_group + keys[:, None] * v_position + dims[None, :],
                                mask=key_ok, other=0.0)
                    if NATIVE:  # the tensor cores' products, exact in float32
                        scores = tl.dot(q, tl.trans(k)) * scale  # [ROWS, KEYS]
                    else:
                        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
                    seen = (keys[None, :] <= position[:, None]) & (keys[None, :] >= lowest[:, None]) & row_ok[:, None]
                    scores = tl.where(seen, scores, float("-inf"))
                    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
                    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # no key seen yet: keep exp finite
                    correction = tl.exp(running_max - safe_max)
                    probs = tl.exp(scores - safe_max[:, None])
                    running_sum = running_sum * correction + tl.sum(probs, axis=1)
                    if NATIVE:  # the probabilities rounded to the values' dtype, as flash attention does
                        weighed = tl.dot(probs.to(v.dtype), v)
                    else:
                        weighed = tl.dot(probs, v.to(tl.float32), input_precision="ieee")
                    accumulator = accumulator * correction[:, None] + weighed
                    running_max = new_max
        slot = batch_group * n_splits + split
        tl.store(partial_ptr + (slot * ROWS_PAD + rows)[:, None] * DIM_PAD + dims[None, :], accumulator)
        tl.store(maximum_ptr + slot * ROWS_PAD + rows, running_max)
        tl.store(total_ptr + slot * ROWS_PAD + rows, running_sum)

    @triton.jit
    def merge_kernel(
        partial_ptr, maximum_ptr, total_ptr, positions_ptr, out_ptr,
        out_batch, out_head, out_query, n_groups, n_splits, window,
        QUERIES: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, ROWS_PAD: tl.constexpr, DIM: tl.constexpr,
        DIM_PAD: tl.constexpr, SPLIT: tl.constexpr,
    ):
        # program = b g: the splits its queries saw, merged; out [B, H, T, D] (last dimension contiguous)
        batch_group = tl.program_id(0).to(tl.int64)
        batch = batch_group // n_groups
        group = batch_group % n_groups
        rows = tl.arange(0, ROWS_PAD)
        row_ok = rows < QUERIES * HEADS_PER_GROUP
        query = rows // HEADS_PER_GROUP
        head = group * HEADS_PER_GROUP + rows % HEADS_PER_GROUP
        dims = tl.arange(0, DIM_PAD)
        position = tl.load(positions_ptr + batch * QUERIES + query, mask=row_ok, other=-1)
        lowest = tl.where(window > 0, position - window + 1, 0)
        first_split = tl.maximum(tl.min(tl.where(row_ok, lowest, 1 << 30)), 0) // SPLIT
        end_split = tl.minimum(tl.max(position) // SPLIT + 1, n_splits)
        total_max = tl.full((ROWS_PAD,), float("-inf"), tl.float32)
        total_sum = tl.zeros((ROWS_PAD,), tl.float32)
        total = tl.zeros((ROWS_PAD, DIM_PAD), tl.float32)
        for split in range(first_split, end_split):
            slot = batch_group * n_splits + split
            split_max = tl.load(maximum_ptr + slot * ROWS_PAD + rows)
            split_sum = tl.load(total_ptr + slot * ROWS_PAD + rows)
            split_partial = tl.load(partial_ptr + (slot * ROWS_PAD + rows)[:, None] * DIM_PAD + dims[None, :])
            new_max = tl.maximum(total_max, split_max)
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            old_weight = tl.exp(total_max - safe_max)
            split_weight = tl.exp(split_max - safe_max)
            total_sum = total_sum * old_weight + split_sum * split_weight
            total = total * old_weight[:, None] + split_partial * split_weight[:, None]
            total_max = new_max
        result = total / tl.where(total_sum > 0, total_sum, 1.0)[:, None]  # a row with no key: zeros
        tl.store(out_ptr + batch * out_batch + head[:, None] * out_head + query[:, None] * out_query + dims[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims < DIM)[None, :])

    return split_kernel, merge_kernel


def _launch(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, window: int) -> Tensor:
    """The two kernels' launch (arguments as the op's). -> [B, H, T, D], laid out as out_layout's."""
    batch, n_heads, n_queries, width = q.shape
    n_groups, n_keys = keys.shape[1], keys.shape[2]
    heads_per_group = n_heads // n_groups
    q, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, values))
    positions = positions.contiguous()
    rows_padded, width_padded = _padded(n_queries * heads_per_group), _padded(width)
    n_splits = -(-n_keys // SPLIT_KEYS)
    partial = torch.empty(batch * n_groups, n_splits, rows_padded, width_padded, dtype=torch.float32, device=q.device)
    maximum = torch.empty(batch * n_groups, n_splits, rows_padded, dtype=torch.float32, device=q.device)
    total = torch.empty_like(maximum)
    out = out_layout(q)
    sizes = dict(QUERIES=n_queries, HEADS_PER_GROUP=heads_per_group, ROWS_PAD=rows_padded, DIM=width,
                 DIM_PAD=width_padded)
    warps = 8 if rows_padded * width_padded > 64 * 128 else 4
    key_tile = 64 if width_padded <= 128 else 32  # keys scored together: a tile of keys and one of values
    split_kernel, merge_kernel = _kernels(interpreting())
    split_kernel[(batch * n_groups, n_splits)](
        q, keys, values, positions, partial, maximum, total,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        n_groups, n_keys, n_splits, window, 1 / math.sqrt(width),
        **sizes, SPLIT=SPLIT_KEYS, KEYS=key_tile, NATIVE=native(q, keys), num_warps=warps,
    )
    merge_kernel[(batch * n_groups,)](
        partial, maximum, total, positions, out, out.stride(0), out.stride(1), out.stride(2),
        n_groups, n_splits, window, **sizes, SPLIT=SPLIT_KEYS, num_warps=warps,
    )
    return out


@torch.library.custom_op("attnlab::cached_attention_triton", mutates_args=())
def cached_attention_op(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, window: int) -> Tensor:
    """q [B, H, T, D] at positions [B, T] over a cache's storage keys, values [B, G, L, D]."""
    return _launch(q, keys, values, positions, window)


@cached_attention_op.register_fake
def _(q, keys, values, positions, window):
    return out_layout(q)


def cached_attention(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, window: int = 0) -> Tensor:
    """q [B, H, T, D] at positions [B, T] over a cache's storage keys, values [B, G, L, D] (a slice
    of its heads read in place): query t of row b sees the keys at lo..positions[b, t] (lo = position
    - window + 1 with a window, else 0). -> [B, H, T, D] in q's dtype, laid out as [B, T, H, D]
    (decode_cpu.out_layout: the heads merge back into rows without a copy). The caller has checked
    that it can (kernels.choose_cached)."""
    return cached_attention_op(q, keys, values, positions, window)
