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
- Gates: a sigmoid of a linear map of the input, one per head and branch. They start favouring the
  sliding branch (`gate_init_bias`: logits -4, -4, +4, gates 0.018 / 0.018 / 0.982), as the reference
  library's do (from -2, -2, +2); with every gate at 0.5 the layer learned slower early on, and with
  logits of 2 slower by step 100 than with 4 (docs/nsa.md#learning-quality).

Deliberate departures, each for exact causality or for memory:
- The compressed branch's query and compressed keys carry no rotary positions (positions enter the
  compression network as learned intra-block embeddings); the selected and sliding branches use
  rotated queries and keys, like every other attention in attnlab.
- Eq. 9's overlap sum is computed per stride unit: a compressed block's probability counts for
  every stride-long unit it covers, a selection block sums its units. This needs `compress_stride`
  to divide both block sizes (checked).
- `use_diff_topk` multiplies each selected block's values by 1 + s - stop_gradient(s), s its
  selection score: exactly 1 in the forward pass, while s receives a gradient (straight-through).

The reference path runs queries in chunks of `query_chunk_size`: a chunk's compressed scores
C x (1 + N) and its gathered selected blocks C x n x l' x D live one chunk at a time, and in
training each chunk is checkpointed (recomputed in the backward), so no T x T tensor and no
T x blocks x block x D tensor is ever built.

Back-ends (kernels/__init__.py): `cpu`, block-listed C++ kernels for all three branches of a whole
sequence (kernels/nsa_cpu.py: each query lists its key blocks and reads them in place; the
compressed pass also makes the selection); `flex`, FlexAttention block masks for the selected and
sliding branches (kernels/nsa_flex.py, kernels/flex_local.py); `triton`, Triton kernels for the
compressed branch with the selection (kernels/nsa_compressed_triton.py) and the selected branch
(kernels/nsa_triton.py), the sliding branch on FlexAttention's window (on CUDA). Through a cache on
the CPU, `cpu` also runs all three branches: the compressed one with the block selection over the
blocks complete at each query only (kernels/decode_cpu.py's compressed_selection; the reference
scores every slot of the storage, masked), the selected one (its blocks listed: listed_attention)
and the sliding one (cached_attention with the window), each reading the storage in place. One
semantics, tested against the reference.

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

from attnlab.attention.base import (
    Attention,
    AttentionSpec,
    KVCache,
    branch_free,
    compiled_branch,
    new_lengths,
    overlapping_windows,
    select_rows,
    write_rows,
)
from attnlab.attention.kernels import (
    check_backend,
    choose,
    choose_cached,
    decode_cpu,
    nsa_compressed_triton,
    nsa_cpu,
    nsa_flex,
    nsa_triton,
    serves_call,
)
from attnlab.attention.kernels.flex_local import flex_local_attention
from attnlab.attention.local import cached_window_attention, local_attention
from attnlab.config import NSAAttentionConfig
from attnlab.errors import ConfigError
from attnlab.registry import ATTENTION

OFFERED = ("torch", "cpu", "flex", "triton")
CACHED = ("torch", "cpu")  # the back-ends of calls through a cache (choose_cached)

# ----------------------------------------------------------------------------------------------
# Pure functions: the compressed branch and the selection (eq. 7-11)


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


def compressed_branch(
    q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, first_max: int, config: NSAAttentionConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The reference path of the compressed branch and the block selection, for queries at
    `positions`: [T], consecutive, or [B, T], each row's own (a cache whose rows differ in length);
    first_max is the largest first position (of any row), known on the host.

    q [B, H, T, D] (no rotary); keys, values [B, G, 1 + N, D]: the memory slot, then the compressed
    blocks complete by the last query. -> output [B, H, T, D], indices, valid [B, G, T, n] and the
    selection scores [B, G, T, n]. Chunks of `query_chunk_size` queries, each seeing only the blocks
    complete by its last query, checkpointed when a gradient is needed.
    """
    block, stride, chunk = config.compress_block_size, config.compress_stride, config.query_chunk_size
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, keys, values))
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    results = []
    for start in range(0, q.shape[2], chunk):
        part = slice(start, start + chunk)
        last = first_max + min(q.shape[2], start + chunk) - 1  # the chunk's last position, in any row
        n_visible = n_complete_blocks(last + 1, block, stride)  # causal skipping of later blocks
        n_selection = last // config.selection_block_size + 1
        args = (q[:, :, part], keys[:, :, : 1 + n_visible], values[:, :, : 1 + n_visible], positions[..., part],
                config, n_selection)
        results.append(checkpoint(compressed_attention_chunk, *args, use_reentrant=False) if needs_grad
                       else compressed_attention_chunk(*args))
    output, indices, valid, scores = (torch.cat(parts, dim=2) for parts in zip(*results))
    return output, indices, valid, scores


def selected_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, valid: Tensor, gates: Tensor | None,
                       positions: Tensor, block: int, chunk: int) -> Tensor:
    """The reference path of the selected branch: each query attends to the tokens at or before it
    in its selected blocks. q [B, H, T, D] at `positions` [T] (or [B, T], each row's own); k, v
    [B, G, S, D]; indices, valid [B, G, T, n]; gates [B, G, T, n] or None (multiply each block's
    values) -> [B, H, T, D]. Chunks of queries, checkpointed when a gradient is needed; keys and
    values are gathered from a block view (index_select), never from a repeated T x blocks tensor."""
    n_groups = k.shape[1]
    k, v = k.to(q.dtype), v.to(q.dtype)
    k_blocked, v_blocked = _blocked(k, block), _blocked(v, block)  # [B, G, M, l', D]
    grouped = rearrange(q, "b (g r) t d -> b g t r d", g=n_groups)  # query-major: plain batched matmuls
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, gates))
    outputs = []
    for start in range(0, q.shape[2], chunk):
        part = slice(start, start + chunk)
        args = (grouped[:, :, part], k_blocked, v_blocked, indices[:, :, part], valid[:, :, part],
                None if gates is None else gates[:, :, part].to(q.dtype), positions[..., part], block)
        outputs.append(checkpoint(_selected_chunk, *args, use_reentrant=False) if needs_grad
                       else _selected_chunk(*args))
    return rearrange(torch.cat(outputs, dim=2), "b g t r d -> b (g r) t d")


def _selected_chunk(q, k_blocked, v_blocked, indices, valid, gates, positions, block: int) -> Tensor:
    """One chunk of the selected branch: q [B, G, C, R, D] -> [B, G, C, R, D] (never an empty row:
    the own block is always selected)."""
    # [B, G, C, n l', D], in q's dtype (a cache may store them in another: only the gathered blocks are cast)
    keys, values = (_gather_blocks(blocked, indices).to(q.dtype) for blocked in (k_blocked, v_blocked))
    key_position = (indices[..., None] * block + torch.arange(block, device=q.device)).flatten(-2)
    allowed = valid.repeat_interleave(block, dim=-1) & (key_position <= per_group(positions[..., None]))
    scores = torch.matmul(q, keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [B, G, C, R, n l']
    probs = torch.softmax(scores.masked_fill(~allowed[:, :, :, None], float("-inf")), dim=-1)
    if gates is not None:  # straight-through gates: exactly 1 forward, a gradient for the scores
        probs = probs * gates.repeat_interleave(block, dim=-1)[:, :, :, None]
    return torch.matmul(probs, values)


def _blocked(tensor: Tensor, block: int) -> Tensor:
    """[B, G, S, D] -> contiguous [B, G, M, l', D], zero-padded to whole blocks."""
    padded = F.pad(tensor, (0, 0, 0, -tensor.shape[2] % block))
    return rearrange(padded, "b g (m s) d -> b g m s d", s=block).contiguous()


def _gather_blocks(blocked: Tensor, indices: Tensor) -> Tensor:
    """blocked [B, G, M, l', D] (contiguous), indices [B, G, C, n] -> [B, G, C, n l', D] (index_select)."""
    batch, n_groups, n_blocks, block, dim_head = blocked.shape
    base = (torch.arange(batch * n_groups, device=indices.device) * n_blocks).view(batch, n_groups, 1, 1)
    rows = blocked.view(batch * n_groups * n_blocks, block * dim_head)
    picked = rows.index_select(0, (indices + base).reshape(-1))
    return picked.view(batch, n_groups, indices.shape[2], indices.shape[3] * block, dim_head)


# ----------------------------------------------------------------------------------------------
# Compression networks: a block of l keys (or values) [.., l, D] -> one [.., D]


class BlockCompressor(nn.Module):
    """One compressor per kind, weights per key/value head. blocks [B, G, N, l, D] -> [B, G, N, D].

    The paper's phi is "an MLP with intra-block position encoding" of unstated width. The MLP's
    hidden width is `compress_mlp_mult` x l x D: by default l x D / 64 (16 at blocks of 16 and heads
    of 64), so both compressors hold fewer parameters than the layer's projections; as wide as its
    input (1.0, the earlier default) they held six times the rest of a small model and learned
    about as well (docs/nsa.md#learning-quality)."""

    def __init__(self, kind: str, n_groups: int, block: int, dim_head: int, mlp_mult: float, positions: bool) -> None:
        super().__init__()
        self.kind = kind
        flat = block * dim_head

        def weight(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape) * shape[-2] ** -0.5)

        self.positions = None
        if kind != "mean" and positions:  # intra-block positions (section 3.3.1)
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
        if self.positions is not None:
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
    if count == 0:  # no block complete yet: only the memory slot is visible
        return keys.new_zeros(*keys.shape[:2], 0, keys.shape[-1])
    start = first * stride
    span = keys[:, :, start : start + (count - 1) * stride + block]
    blocks = overlapping_windows(span, block, stride)  # [B, G, count, l, D]
    return network(blocks)


# ----------------------------------------------------------------------------------------------
# State and module


class NSACache(KVCache):
    """Keys and values of every fed token (selection may pick any block), [B, G, L, D] per name (L:
    max_len in whole selection blocks), unrotated keys for the compression network, and the
    compressed key and value of every compression block, [B, G, N + 1, D] (the last slot takes the
    writes of tokens that complete no block). A forward compresses each block one of its new tokens
    completes, from the storage after writing them: a block's compressed key is then always of its
    row's own tokens, since a query sees a block only once its last token is at or before it, and any
    rollback past that token rewrites it (and so compresses the block again)."""

    def __init__(self, lengths: Tensor, max_len: int, names: list[str], n_groups: int, dim_head: int,
                 config: NSAAttentionConfig, dtype) -> None:
        super().__init__(lengths, max_len)
        block = config.selection_block_size
        shape = (lengths.shape[0], n_groups, -(-max_len // block) * block, dim_head)
        self.tensors = {name: torch.zeros(shape, device=lengths.device, dtype=dtype) for name in names}
        self.n_blocks = max(1, n_complete_blocks(max_len, config.compress_block_size, config.compress_stride))
        self.compressed_keys = torch.zeros(*shape[:2], self.n_blocks + 1, dim_head, device=lengths.device, dtype=dtype)
        self.compressed_values = torch.zeros_like(self.compressed_keys)
        self.config = config
        self.kv_tokens_loaded: int | None = None  # keys/values row 0's query read in the last one-token step

    def append(self, new: dict[str, Tensor], positions: Tensor) -> None:
        """Store new [B, G, T, D] per name at positions [B, T]."""
        for name, value in new.items():
            write_rows(self.tensors[name], value, positions)

    def compress(self, keys: Tensor, values: Tensor, positions: Tensor, key_network: nn.Module,
                 value_network: nn.Module, dtype: torch.dtype) -> None:
        """Compress each block that a token at positions [B, T] completes (its last token), from the
        stored keys and values [B, G, L, D] (eq. 7). Most tokens complete none (one in every stride
        does): the networks run only when some token does (a torch.cond in a compiled step; on CUDA
        every step, as a CUDA graph holds no branch: `branch_free`). dtype: the networks' (the stored
        rows are cast to it; the cache may hold them in another)."""
        block, stride = self.config.compress_block_size, self.config.compress_stride
        start = positions - (block - 1)  # [B, T] the first token of the block each token would end
        completes = (start >= 0) & (start % stride == 0)
        index = torch.where(completes, start // stride, self.n_blocks).clamp(max=self.n_blocks)  # [B, T]
        rows = start.clamp(min=0)[..., None] + torch.arange(block, device=positions.device)  # [B, T, l]
        rows = rows.clamp(max=keys.shape[2] - 1)[:, None].expand(-1, keys.shape[1], -1, -1)  # [B, G, T, l]

        def compressed(rows: Tensor) -> tuple[Tensor, Tensor]:  # [B, G, T, D] each
            return key_network(select_rows(keys, rows).to(dtype)), value_network(select_rows(values, rows).to(dtype))

        def nothing(rows: Tensor) -> tuple[Tensor, Tensor]:
            empty = keys.new_zeros(*rows.shape[:3], keys.shape[-1], dtype=dtype)
            return empty, empty.clone()

        if torch.compiler.is_compiling() and branch_free(keys):  # tokens completing none write the spare slot
            new_keys, new_values = compressed(rows)
        elif torch.compiler.is_compiling():
            shape = (*rows.shape[:3], keys.shape[-1])  # [B, G, T, D]
            new_keys, new_values = compiled_branch(completes.any(), compressed, nothing, (rows,), (shape, shape))
        elif bool(completes.any()):
            new_keys, new_values = compressed(rows)
        else:
            return
        write_rows(self.compressed_keys, new_keys, index)
        write_rows(self.compressed_values, new_values, index)


@ATTENTION.register("nsa")
class NativeSparseAttention(Attention):
    """Projections: `heads` holds the queries, the output and the keys/values every branch shares;
    with `separate_branch_kv`, those serve the compressed branch and `branch_kv` projects the
    selected and sliding branches' own."""

    config_class = NSAAttentionConfig

    @staticmethod
    def keys_per_query(config: NSAAttentionConfig, seq_len: int, n_heads: int, layer_index: int) -> float:
        """Compressed blocks, the selected blocks' tokens and the sliding window."""
        selected = min(config.num_selected * config.selection_block_size, seq_len)
        return seq_len / config.compress_stride + selected + min(config.sliding_window_size, seq_len)

    def __init__(self, spec: AttentionSpec, config: NSAAttentionConfig) -> None:
        super().__init__(spec, config)
        check_config(config, spec)
        check_backend("nsa", config.backend, OFFERED)
        if config.backend == "triton":
            nsa_triton.check_installed()
        heads, groups, dim_head = spec.n_heads, spec.n_kv_heads, spec.dim_head
        if config.separate_branch_kv:  # selected and sliding branches' own keys and values
            self.branch_kv = nn.Linear(spec.dim, 4 * groups * dim_head, bias=False)
        self.to_gates = nn.Linear(spec.dim, 3 * heads)  # eq. 5: g_c in [0, 1] per head and branch
        args = (config.compressor, groups, config.compress_block_size, dim_head, config.compress_mlp_mult,
                config.compress_positions)
        self.compress_keys, self.compress_values = BlockCompressor(*args), BlockCompressor(*args)
        self.memory = nn.Parameter(torch.randn(2, groups, dim_head) * 0.02)  # always-visible compressed key, value
        self.init_own_parameters()

    def init_own_parameters(self) -> None:
        """The gates start favouring the sliding branch (logits -b, -b, +b per head: compressed,
        selected, sliding), so the layer first learns local attention and the compressed and
        selected branches grow in as their keys become useful; the paper leaves the gates'
        initialisation open. The model calls this again after its generic initialisation."""
        bias = self.config.gate_init_bias
        with torch.no_grad():
            self.to_gates.bias.copy_(torch.tensor([-bias, -bias, bias]).repeat(self.spec.n_heads))

    def migrate_state_dict(self, state_dict: dict[str, Tensor], prefix: str) -> None:
        """Earlier releases named the projections to_q, to_out and one fused to_kv (k, v and, with
        separate_branch_kv, the selected and sliding branches' k, v after them)."""
        for name in ("to_q", "to_out"):
            if prefix + f"{name}.weight" in state_dict:
                state_dict[prefix + f"heads.{name}.weight"] = state_dict.pop(prefix + f"{name}.weight")
        fused = state_dict.pop(prefix + "to_kv.weight", None)
        if fused is not None:
            width = self.spec.n_kv_heads * self.spec.dim_head
            state_dict[prefix + "heads.to_k.weight"] = fused[:width].clone()
            state_dict[prefix + "heads.to_v.weight"] = fused[width : 2 * width].clone()
            if self.config.separate_branch_kv:
                state_dict[prefix + "branch_kv.weight"] = fused[2 * width :].clone()

    def _project(self, x: Tensor, positions: int | Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """x [B, T, dim] at `positions` (an int, the first of T, or [B, T]) -> query without and with
        rotary [B, H, T, D], per-branch keys/values [B, G, T, D]."""
        q, k, v = self.heads.project(x)
        rotated_q, rotated_k = self.heads.rotate(q, k, positions)
        if not self.config.separate_branch_kv:
            return q, rotated_q, {"k_cmp": k, "v": v, "k": rotated_k}
        own = rearrange(self.branch_kv(x), "b t (n g d) -> n b g t d", n=4, d=self.spec.dim_head)
        _, k_slc = self.heads.rotate(q, own[0], positions)
        _, k_win = self.heads.rotate(q, own[2], positions)
        return q, rotated_q, {"k_cmp": k, "v_cmp": v, "k_slc": k_slc, "v_slc": own[1], "k_win": k_win,
                              "v_win": own[3]}

    @staticmethod
    def _branch(tensors: dict[str, Tensor], branch: str) -> tuple[Tensor, Tensor]:
        if "k" in tensors:  # shared keys/values
            return (tensors["k_cmp"] if branch == "cmp" else tensors["k"]), tensors["v"]
        return tensors[f"k_{branch}"], tensors[f"v_{branch}"]

    def _with_memory(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """The memory slot before compressed keys, values [B, G, N, D] -> [B, G, 1 + N, D] each."""
        memory = self.memory.to(keys.dtype)[:, None, :, None].expand(-1, keys.shape[0], -1, -1, -1)  # [2, B, G, 1, D]
        return torch.cat((memory[0], keys), dim=2), torch.cat((memory[1], values.to(keys.dtype)), dim=2)

    def _gated_sum(self, x: Tensor, out_cmp: Tensor, out_slc: Tensor, out_win: Tensor) -> Tensor:
        """Eq. 5: the branches [B, H, T, D] under per-head sigmoid gates of x [B, T, dim] -> [B, T, dim]."""
        gate = rearrange(torch.sigmoid(self.to_gates(x)), "b t (h c) -> c b h t 1", c=3)  # [3, B, H, T, 1]
        return self.heads.merge(gate[0] * out_cmp + gate[1] * out_slc + gate[2] * out_win)

    def forward(self, x: Tensor, cache: NSACache | None = None) -> Tensor:
        if cache is not None and not cache.prefill:
            return self._cached(x, cache)
        config, n_tokens = self.config, x.shape[1]  # a whole sequence (training, or a prefill into an empty cache)
        q_plain, q, tensors = self._project(x, 0 if cache is None else cache.positions(n_tokens))
        k_cmp, v_cmp = self._branch(tensors, "cmp")
        n_blocks = n_complete_blocks(n_tokens, config.compress_block_size, config.compress_stride)
        compressed_k = compress(k_cmp, 0, n_blocks, config.compress_block_size, config.compress_stride,
                                self.compress_keys)
        compressed_v = compress(v_cmp, 0, n_blocks, config.compress_block_size, config.compress_stride,
                                self.compress_values)
        if cache is not None:
            cache.append(tensors, cache.positions(n_tokens))
            cache.compressed_keys[:, :, :n_blocks] = compressed_k
            cache.compressed_values[:, :, :n_blocks] = compressed_v
        all_k, all_v = self._with_memory(compressed_k.to(q.dtype), compressed_v)  # [B, G, 1 + N, D]
        # the selection scores need a gradient only for straight-through top-k in training
        straight_through = config.use_diff_topk and torch.is_grad_enabled() and q_plain.requires_grad
        positions = torch.arange(n_tokens, device=x.device)  # [T]
        out_cmp, indices, valid, score = self._compressed(q_plain, all_k, all_v, positions, straight_through)
        gates = (1 + score - score.detach()).to(q.dtype) if straight_through else None  # exactly 1 forward
        out_slc = self._selected(q, *self._branch(tensors, "slc"), indices, valid, gates, positions)
        out_win = self._sliding(q, *self._branch(tensors, "win"))
        return self._gated_sum(x, out_cmp, out_slc, out_win)

    def _cached(self, x: Tensor, cache: NSACache) -> Tensor:
        """The next T tokens x [B, T, dim] of each row, at its own positions, through the static
        storage: fixed shapes whatever the position (a decode step compiles once)."""
        config = self.config
        positions = cache.positions(x.shape[1])  # [B, T]
        q_plain, q, tensors = self._project(x, positions)
        cache.append(tensors, positions)
        stored = cache.tensors
        k_cmp, v_cmp = self._branch(stored, "cmp")
        cache.compress(k_cmp, v_cmp, positions, self.compress_keys, self.compress_values, q.dtype)
        n_selection = k_cmp.shape[2] // config.selection_block_size
        k_slc, v_slc = self._branch(stored, "slc")
        backend = choose_cached(config.backend, CACHED, q, k_slc)
        out_cmp, indices, valid = self._cached_compressed(q_plain, cache, positions, n_selection, backend)
        out_slc = self._cached_selected(q, k_slc, v_slc, indices, valid, positions, n_selection, backend)
        k_win, v_win = self._branch(stored, "win")
        out_win = cached_window_attention(q, k_win, v_win, positions, config.sliding_window_size, backend)
        if x.shape[1] == 1 and not torch.compiler.is_compiling():  # the paper's Table 4 count, row 0
            n_visible = n_complete_blocks(int(positions[0, 0]) + 1, config.compress_block_size, config.compress_stride)
            cache.kv_tokens_loaded = kv_tokens_loaded(config, int(positions[0, 0]), n_visible, indices[0, 0, 0],
                                                      valid[0, 0, 0])
        return self._gated_sum(x, out_cmp, out_slc, out_win)

    def _cached_compressed(self, q_plain, cache: NSACache, positions, n_selection: int, backend: str):
        """The compressed branch and the block selection through a cache: queries q_plain [B, H, T, D]
        (no rotary) at positions [B, T] over the cache's compressed blocks -> output [B, H, T, D],
        indices and valid [B, G, T, n]. The cpu back-end reads the blocks complete at each query
        only; the reference scores every slot of the storage, masked."""
        config, n_blocks = self.config, cache.n_blocks  # the slot after them only takes writes
        keys, values = cache.compressed_keys[:, :, :n_blocks], cache.compressed_values[:, :, :n_blocks]
        if backend == "cpu":
            out, chosen = decode_cpu.compressed_selection(
                q_plain, self.memory, keys, values, positions, config.compress_block_size, config.compress_stride,
                config.selection_block_size, config.num_selected)
            return out, chosen.clamp(min=0), chosen >= 0
        all_k, all_v = self._with_memory(keys.to(q_plain.dtype), values)
        out, indices, valid, _ = compressed_attention_chunk(q_plain, all_k, all_v, positions, config, n_selection)
        return out, indices, valid

    def _cached_selected(self, q, k_slc, v_slc, indices, valid, positions, n_selection: int, backend: str) -> Tensor:
        """The selected branch through a cache: queries q [B, H, T, D] over the storage k_slc, v_slc
        [B, G, S, D] (S: n_selection whole blocks), the blocks indices, valid [B, G, T, n] -> [B, H, T, D]."""
        block = self.config.selection_block_size
        if backend == "cpu":  # each query's selected blocks listed (per query head), read in place
            heads_per_group = q.shape[1] // k_slc.shape[1]
            starts = (indices * block).repeat_interleave(heads_per_group, dim=1)  # [B, H, T, n]
            biases = torch.zeros(starts.shape, device=q.device).masked_fill(
                ~valid.repeat_interleave(heads_per_group, dim=1), float("-inf"))
            return decode_cpu.listed_attention(q, k_slc, v_slc, starts, biases, block, positions)
        blocked = (store.view(*store.shape[:2], n_selection, block, store.shape[-1])
                   for store in (k_slc, v_slc))  # [B, G, M, l', D]: a view of the storage
        grouped = rearrange(q, "b (g r) t d -> b g t r d", g=k_slc.shape[1])
        return rearrange(_selected_chunk(grouped, *blocked, indices, valid, None, positions, block),
                         "b g t r d -> b (g r) t d")

    # -- back-ends of a whole sequence: one semantics, tested against the reference (tests/test_nsa_kernels.py)

    def _compressed(self, q, keys, values, positions, straight_through: bool):
        """-> output [B, H, T, D], indices, valid and selection scores [B, G, T, n]."""
        config = self.config
        heads_per_group = q.shape[1] // keys.shape[1]
        backend = choose(config.backend, OFFERED, q, True)
        if backend == "triton":
            return nsa_compressed_triton.compressed_branch(
                q, keys, values, config.compress_block_size, config.compress_stride, config.selection_block_size,
                config.num_selected, straight_through)
        if backend == "cpu" and nsa_cpu.fits(0, heads_per_group):
            out, blocks, score = nsa_cpu.compressed_attention(
                q, keys, values, config.compress_block_size, config.compress_stride, config.selection_block_size,
                config.num_selected, straight_through)
            return out, blocks.clamp(min=0), blocks >= 0, score
        return compressed_branch(q, keys, values, positions, 0, config)

    def _selected(self, q, k, v, indices, valid, gates, positions) -> Tensor:
        config, block = self.config, self.config.selection_block_size
        backend = choose(config.backend, OFFERED, q, True)
        if backend == "triton":
            return nsa_triton.selected_attention(q, k, v, indices, valid, gates, 0, block)
        if backend == "flex" and gates is None:  # flex has no per-block value gates
            return nsa_flex.selected_attention(q, k, v, indices, valid, 0, block)
        if backend == "cpu" and nsa_cpu.fits(indices.shape[-1], q.shape[1] // k.shape[1]):
            return nsa_cpu.selected_attention(q, k, v, torch.where(valid, indices, -1), block, gates)
        return selected_attention(q, k, v, indices, valid, gates, positions, block, config.query_chunk_size)

    def _sliding(self, q, k, v) -> Tensor:
        window = self.config.sliding_window_size
        backend = choose(self.config.backend, OFFERED, q, True)
        # triton's sliding branch is FlexAttention's window on CUDA (torch has no flex backward on the CPU)
        if backend == "flex" or (backend == "triton" and q.device.type == "cuda" and serves_call("flex", q, True)):
            return flex_local_attention(q, k, v, window)
        if backend == "cpu" and nsa_cpu.fits(0, q.shape[1] // k.shape[1]):
            return nsa_cpu.sliding_attention(q, k, v, window)
        return local_attention(q, k, v, window)

    def new_cache(self, batch: int, max_len: int, device=None, dtype=None, lengths: Tensor | None = None) -> NSACache:
        names = (["k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win"] if self.config.separate_branch_kv
                 else ["k_cmp", "k", "v"])
        if dtype is None:
            dtype = self.memory.dtype  # a float parameter, also when the projections are int8 (model/quantize.py)
        lengths = new_lengths(batch, device) if lengths is None else lengths
        self.heads.reserve(max_len, lengths.device)
        return NSACache(lengths, max_len, names, self.spec.n_kv_heads, self.spec.dim_head, self.config, dtype)


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
        key = "model.attention.nsa."
        raise ConfigError(
            f"{key}compress_stride={stride} must divide {key}compress_block_size={config.compress_block_size} "
            f"and {key}selection_block_size={config.selection_block_size}"
        )
    if config.num_selected < 2:
        raise ConfigError("nsa: num_selected must be >= 2 (the initial and the current block are always selected)")
    if config.query_chunk_size < 1:
        raise ConfigError("nsa: query_chunk_size must be >= 1")
    if spec.dropout:
        raise ConfigError("nsa: attention dropout is not supported; use model.dropout (residual dropout)")
