"""Native sparse attention: the memory-lean layer equals a dense T x T reference written straight
from the paper's equations, in outputs and in every gradient; its custom backward passes gradcheck;
every option changes behaviour; the cache reports the keys/values a decode step reads."""

from __future__ import annotations

import math

import pytest
import torch
from einops import rearrange

from attnlab.attention.base import AttentionSpec, RotaryEmbedding, expand_kv
from attnlab.attention.nsa import (
    NativeSparseAttention,
    compress,
    n_complete_blocks,
    selected_attention,
)
from attnlab.config import NSAAttentionConfig
from attnlab.errors import ConfigError

DIM, HEADS, KV_HEADS, DIM_HEAD = 24, 4, 2, 6


def make_layer(seed: int = 0, kv_heads: int = KV_HEADS, **options) -> NativeSparseAttention:
    # a compressor as wide as its input: at these toy widths the default's (1/64) would be one unit wide,
    # and its near-equal compressed keys would tie the selection scores
    defaults = dict(compress_block_size=4, compress_stride=2, selection_block_size=6, num_selected=3,
                    sliding_window_size=5, query_chunk_size=8, compress_mlp_mult=1.0)
    config = NSAAttentionConfig(**{**defaults, **options})
    spec = AttentionSpec(dim=DIM, n_heads=HEADS, dim_head=DIM_HEAD, n_kv_heads=kv_heads, dropout=0.0,
                         max_seq_len=128, layer_index=0, n_layers=1, rotary=RotaryEmbedding(DIM_HEAD))
    torch.manual_seed(seed)
    layer = NativeSparseAttention(spec, config).double()
    with torch.no_grad():  # non-zero biases and positions so that every parameter matters
        for parameter in layer.parameters():
            if parameter.abs().sum() == 0:
                parameter.normal_(0, 0.3)
    return layer


def dense_attention(q, k, v, allowed, weights=None):
    """softmax over allowed keys; q [B, H, T, D], k v [B, G, S, D], allowed [B|1, H|1, T, S];
    weights [B, H, T, S] multiply the probabilities (straight-through gates)."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1])
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    if weights is not None:
        probs = probs * weights
    return torch.einsum("bhts,bhsd->bhtd", probs, v), probs


def reference(layer: NativeSparseAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer, densely: T x T masks, an explicit overlap matrix for eq. 9, per-query selection."""
    config = layer.config
    batch, length, _ = x.shape
    q_plain, q, tensors = layer._project(x, 0)
    k_cmp, v_cmp = layer._branch(tensors, "cmp")
    block, stride, sel = config.compress_block_size, config.compress_stride, config.selection_block_size
    n_blocks = n_complete_blocks(length, block, stride)
    memory_k = layer.memory[0].expand(batch, -1, -1)[:, :, None]
    memory_v = layer.memory[1].expand(batch, -1, -1)[:, :, None]
    keys = torch.cat((memory_k, compress(k_cmp, 0, n_blocks, block, stride, layer.compress_keys)), dim=2)
    values = torch.cat((memory_v, compress(v_cmp, 0, n_blocks, block, stride, layer.compress_values)), dim=2)
    position = torch.arange(length)
    ends = torch.arange(n_blocks) * stride + block - 1
    visible = torch.cat((torch.ones(length, 1, dtype=torch.bool), ends[None] <= position[:, None]), dim=1)
    out_cmp, probs = dense_attention(q_plain, keys, values, visible)

    # eq. 9: overlap (in stride units) of compressed block i with selection block j
    n_sel = math.ceil(length / sel)
    unit = torch.arange(n_sel * sel // stride)
    first_unit = torch.arange(n_blocks)[:, None]  # compressed block i covers units i .. i + l/d - 1
    covers_c = (unit[None] >= first_unit) & (unit[None] < first_unit + block // stride)
    covers_s = (unit // (sel // stride))[None] == torch.arange(n_sel)[:, None]
    overlap = covers_c.double() @ covers_s.double().T  # [N, M]
    group_probs = rearrange(probs[..., 1:], "b (g r) t n -> b g r t n", g=layer.spec.n_kv_heads).sum(2)
    importance = group_probs @ overlap  # [B, G, T, M]
    chosen = torch.zeros(batch, layer.spec.n_kv_heads, length, n_sel, dtype=torch.bool)
    for t in range(length):
        current = t // sel
        candidates = [j for j in range(n_sel) if j * sel <= t and j not in (0, current)]
        for b in range(batch):
            for g in range(layer.spec.n_kv_heads):
                ranked = sorted(candidates, key=lambda j: -importance[b, g, t, j].item())
                for j in [0, current, *ranked[: config.num_selected - len({0, current})]]:
                    chosen[b, g, t, j] = True
    key_block = torch.arange(length) // sel
    causal = position[None, :] <= position[:, None]
    allowed = expand_kv(chosen[..., key_block], HEADS) & causal  # [B, H, T, S]
    k_slc, v_slc = layer._branch(tensors, "slc")
    weights = None
    if config.use_diff_topk:
        gate = 1 + importance - importance.detach()
        weights = expand_kv(gate[..., key_block], HEADS)
    out_slc, _ = dense_attention(q, k_slc, v_slc, allowed, weights)
    k_win, v_win = layer._branch(tensors, "win")
    band = causal & (position[None, :] > position[:, None] - config.sliding_window_size)
    out_win, _ = dense_attention(q, k_win, v_win, band)
    gate = rearrange(torch.sigmoid(layer.to_gates(x)), "b t (h c) -> c b h t 1", c=3)
    y = gate[0] * out_cmp + gate[1] * out_slc + gate[2] * out_win
    return layer.heads.merge(y)


CASES = {
    "overlap-mlp": dict(),
    "shared-kv": dict(separate_branch_kv=False),  # one key/value projection for every branch
    "diff-topk": dict(use_diff_topk=True),
    "no-overlap-mean": dict(compress_block_size=4, compress_stride=4, selection_block_size=8, compressor="mean"),
    "conv-separate": dict(compressor="conv", separate_branch_kv=True, num_selected=4),
    "attention-pool": dict(compressor="attention", selection_block_size=2, query_chunk_size=5),
    "only-forced-blocks": dict(num_selected=2, selection_block_size=4),  # no block gathered per query
    "no-compress-positions": dict(compress_positions=False, compress_mlp_mult=1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_dense_reference_with_gradients(case):
    layer = make_layer(**CASES[case])
    x = torch.randn(2, 37, DIM, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    expected = reference(layer, x)
    torch.testing.assert_close(y, expected, atol=1e-10, rtol=1e-10)
    weight = torch.randn_like(y)
    grads = torch.autograd.grad((y * weight).sum(), [x, *layer.parameters()])
    expected_grads = torch.autograd.grad((expected * weight).sum(), [x, *layer.parameters()])
    names = ["x"] + [name for name, _ in layer.named_parameters()]
    for name, got, want in zip(names, grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


def test_selected_attention_gradcheck():
    torch.manual_seed(0)
    batch, groups, heads, length, dim_head, block, n_sel = 1, 2, 4, 11, 3, 3, 2
    q = torch.randn(batch, heads, length, dim_head, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, groups, length, dim_head, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, groups, length, dim_head, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(length)
    current = positions // block
    other = torch.clamp(current - 1, min=0)
    indices = torch.stack((other, current), dim=-1).expand(batch, groups, length, n_sel).contiguous()
    valid = torch.ones_like(indices, dtype=torch.bool)
    valid[..., 0] = current > 0
    gates = torch.rand(batch, groups, length, n_sel, dtype=torch.float64, requires_grad=True)

    def run(q, k, v, gates):
        return selected_attention(q, k, v, indices, valid, gates, positions, block, chunk=4)

    assert torch.autograd.gradcheck(run, (q, k, v, gates))


def test_each_option_changes_behaviour():
    x = torch.randn(1, 40, DIM, dtype=torch.float64)
    base = make_layer()
    with torch.no_grad():
        reference_output = base(x)
    changes = dict(
        compress_block_size=6, compress_stride=1, selection_block_size=4, num_selected=2,
        sliding_window_size=9, compressor="conv", separate_branch_kv=False, compress_positions=False,
    )
    for key, value in changes.items():
        layer = make_layer(**{key: value})
        if key not in ("compressor", "separate_branch_kv", "compress_block_size"):
            layer.load_state_dict(base.state_dict(), strict=key != "compress_positions")  # positions dropped
        with torch.no_grad():
            assert not torch.allclose(layer(x), reference_output), f"{key} has no effect"
    # chunking and diff top-k leave the forward unchanged; diff top-k adds gradient paths
    for key, value in dict(query_chunk_size=3, use_diff_topk=True).items():
        layer = make_layer(**{key: value})
        layer.load_state_dict(base.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(layer(x), reference_output, atol=1e-12, rtol=0)
    plain, straight = make_layer(), make_layer(use_diff_topk=True)
    x.requires_grad_(True)
    grad_plain = torch.autograd.grad(plain(x).sum(), plain.heads.to_q.weight)[0]
    grad_straight = torch.autograd.grad(straight(x).sum(), straight.heads.to_q.weight)[0]
    assert not torch.allclose(grad_plain, grad_straight)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(compress_block_size=6, compress_stride=4), "must divide"),
        (dict(selection_block_size=6, compress_stride=4, compress_block_size=8), "must divide"),
        (dict(num_selected=1), "num_selected"),
        (dict(sliding_window_size=0), ">= 1"),
    ],
)
def test_bad_config_is_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        make_layer(**options)


def test_attention_dropout_refused():
    spec = AttentionSpec(dim=DIM, n_heads=HEADS, dim_head=DIM_HEAD, n_kv_heads=KV_HEADS, dropout=0.1,
                         max_seq_len=64, layer_index=0, n_layers=1, rotary=None)
    with pytest.raises(ConfigError, match="dropout"):
        NativeSparseAttention(spec, NSAAttentionConfig())


def test_decode_reports_tokens_loaded():
    """Per decode step: memory slot + complete compressed blocks + selected tokens + window."""
    layer = make_layer(compress_block_size=4, compress_stride=4, selection_block_size=4, num_selected=2,
                       sliding_window_size=3).eval()
    cache = layer.new_cache(1, 64)
    x = torch.randn(1, 40, DIM, dtype=torch.float64)
    counts = []
    with torch.no_grad():
        for t in range(40):
            layer(x[:, t : t + 1], cache=cache)
            cache.advance(1)  # a layer's cache on its own counts its tokens when told (ModelCache does it)
            counts.append(cache.kv_tokens_loaded)
    for t, count in enumerate(counts):
        n_blocks = n_complete_blocks(t + 1, 4, 4)
        own = t % 4 + 1  # tokens of the current block at or before t
        selected = own if t < 4 else own + 4  # the initial block is the other selection
        assert count == 1 + n_blocks + selected + min(3, t + 1), (t, count)


def test_bench_decode_reports_tokens_loaded():
    """`attnlab bench decode` reports the per-step count for NSA (mean over layers), nothing for full."""
    from attnlab.bench.measure import measure_decode
    from attnlab.bench.runner import decode_table

    values = dict(dim=16, depth=2, heads=2, dim_head=8, kv_heads=1, attention=dict(kind="nsa", nsa=dict(
        compress_block_size=4, compress_stride=4, selection_block_size=4, num_selected=2, sliding_window_size=3)))
    nsa = measure_decode(values, context=40, new_tokens=3, use_cache=True)
    full = measure_decode({**values, "attention": {"kind": "full"}}, context=40, new_tokens=3, use_cache=True)
    # positions 40-42: memory slot + 10 blocks + (1-3 own + 4 initial) selected + window 3, mean 20
    assert nsa["kv_tokens_loaded"] == 1 + 10 + 6 + 3
    assert full["kv_tokens_loaded"] is None
    table = decode_table([nsa, full])
    assert "kv tokens loaded/step" in table and f"| {nsa['kv_tokens_loaded']:.0f} |" in table


@pytest.mark.parametrize("chunk", [1, 3])
def test_rows_of_their_own_length_across_query_chunks(chunk):
    """A cache rolled back to a length per row then fed chunks longer than the layer's query chunks:
    each row equals the layer run on that row's own tokens alone."""
    layer = make_layer(query_chunk_size=chunk).eval()
    x = torch.randn(3, 40, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    kept = [13, 17, 22]  # each row's tokens after the rollback; blocks of 4 every 2 tokens cut mid-block
    with torch.no_grad():
        cache = layer.new_cache(3, 64)
        layer(x[:, :24], cache=cache)
        cache.lengths.copy_(torch.tensor(kept))  # rolled back, row by row
        new = x[:, 24:]  # what each row feeds next, at its own positions
        chunk = layer(new[:, :7], cache=cache)
        cache.advance(7)
        got = torch.cat([chunk, layer(new[:, 7:8], cache=cache)], dim=1)
        for row, length in enumerate(kept):
            own = torch.cat((x[row, :length], new[row, :8]))[None]
            torch.testing.assert_close(got[row], layer(own)[0, length:], rtol=1e-9, atol=1e-9)


def test_gates_start_favouring_the_sliding_branch():
    """Default gates: sigmoid(-4) for the compressed and selected branches, sigmoid(4) for the
    sliding one, in every head, also after the model's generic initialisation; 0 puts all at 0.5."""
    from attnlab.config import ModelConfig, config_from_dict
    from attnlab.model import Transformer

    for options, expected in (({}, [-4.0, -4.0, 4.0]), ({"gate_init_bias": 0.0}, [0.0, 0.0, 0.0])):
        values = dict(dim=32, depth=2, heads=4, dim_head=8, kv_heads=2, attention=dict(kind="nsa", nsa=options))
        model = Transformer(config_from_dict(values, ModelConfig))
        for block in model.blocks:
            torch.testing.assert_close(block.attention.to_gates.bias, torch.tensor(expected * 4))
    spec = AttentionSpec(dim=DIM, n_heads=HEADS, dim_head=DIM_HEAD, n_kv_heads=KV_HEADS, dropout=0.0,
                         max_seq_len=64, layer_index=0, n_layers=1, rotary=None)
    torch.testing.assert_close(NativeSparseAttention(spec, NSAAttentionConfig()).to_gates.bias,
                               torch.tensor([-4.0, -4.0, 4.0] * HEADS))


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_default_compressor_smaller_than_the_projections(kv_heads):
    """At the default shapes (dim 256, 4 heads of 64, blocks of 16) the two compression networks hold
    fewer parameters than the layer's query, key, value and output projections, with or without
    GQA; the earlier default (compress_mlp_mult 1.0) held several times more."""
    spec = AttentionSpec(dim=256, n_heads=4, dim_head=64, n_kv_heads=kv_heads, dropout=0.0, max_seq_len=64,
                         layer_index=0, n_layers=1, rotary=None)
    for options, smaller in (({}, True), ({"compress_mlp_mult": 1.0}, False)):
        layer = NativeSparseAttention(spec, NSAAttentionConfig(**options))
        compressors = sum(p.numel() for name, p in layer.named_parameters() if name.startswith("compress_"))
        projections = sum(p.numel() for p in layer.heads.parameters())
        assert (compressors <= projections) == smaller, (options, compressors, projections)
