"""The Triton kernels of NSA's `triton` back-end have the reference path's semantics: the compressed
branch (output, selection importance, forward and every gradient, the straight-through scores'
included), the selection, and the selected branch (forward, the key-block-centric backward), run
on the CPU under the Triton interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets without
CUDA; small sizes, fp32).
Each case covers a different GQA group (1, 2, 4, 16 query heads per key/value head), compressed
block and stride (16/8, 16/16, 32/8, 32/16), selection block (16, 32, 64), number of selected
blocks (1 to 16) and a length that is no block multiple; not their full cross product.

A kernel run with a deliberately broken causal bound or selection order (test-only arguments of the
launchers) fails the same parity checks: the checks can see those faults."""

from __future__ import annotations

import os

import pytest
import torch
from tests.variants import random_selection

from attnlab.attention.nsa import choose_blocks, compressed_branch, n_complete_blocks, selected_attention
from attnlab.config import NSAAttentionConfig

TOLERANCE = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture
def kernels():
    """The kernel modules, where the kernels run under the interpreter."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs under TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA; GPU: tests/test_gpu.py)")
    from attnlab.attention.kernels import nsa_compressed_triton, nsa_triton

    return nsa_compressed_triton, nsa_triton


def nsa_config(block: int, stride: int, selection_block: int, n_selected: int) -> NSAAttentionConfig:
    return NSAAttentionConfig(compress_block_size=block, compress_stride=stride, selection_block_size=selection_block,
                              num_selected=n_selected, query_chunk_size=16)  # several reference chunks


def compressed_inputs(batch: int, groups: int, heads_per_group: int, length: int, dim_head: int,
                      config: NSAAttentionConfig):
    """q [B, H, T, D] and the memory slot + compressed keys, values [B, G, 1 + N, D], all requiring grad."""
    torch.manual_seed(length)
    n_blocks = n_complete_blocks(length, config.compress_block_size, config.compress_stride)
    q = torch.randn(batch, groups * heads_per_group, length, dim_head, requires_grad=True)
    keys = torch.randn(batch, groups, 1 + n_blocks, dim_head, requires_grad=True)
    values = torch.randn(batch, groups, 1 + n_blocks, dim_head, requires_grad=True)
    return q, keys, values


def assert_compressed_forward_equal(got, want) -> None:
    """Outputs, the valid selections (indices, in order) and their scores of two compressed branches."""
    (output, indices, valid, scores), (output_want, indices_want, valid_want, scores_want) = got, want
    torch.testing.assert_close(output, output_want, **TOLERANCE)
    assert torch.equal(valid, valid_want), "validity of the selected blocks"
    assert torch.equal(indices[valid], indices_want[valid]), "selected blocks"
    torch.testing.assert_close(scores[valid], scores_want[valid].float(), **TOLERANCE)


# GQA group, compressed block / stride, selection block, selected blocks, length, batch x groups,
# straight-through scores
COMPRESSED_CASES = [
    (1, 16, 8, 16, 2, 45, (1, 2), True),
    (2, 32, 16, 32, 4, 77, (2, 1), False),
    (4, 16, 16, 64, 3, 90, (1, 1), True),
    (16, 32, 8, 16, 16, 51, (1, 1), True),
]


@pytest.mark.parametrize("heads_per_group, block, stride, selection_block, n_selected, length, shape, straight",
                         COMPRESSED_CASES)
def test_compressed_kernel_equals_torch(kernels, monkeypatch, heads_per_group, block, stride, selection_block,
                                        n_selected, length, shape, straight):
    """Output, selection and scores; the gradients of q, keys and values through the output and,
    with straight-through gates, through the selection scores (eq. 9-10 backward). Two cases split
    the key-centric backward's query rows over several programs, as long sequences do."""
    compressed, _ = kernels
    if heads_per_group in (2, 16):
        monkeypatch.setattr(compressed, "ROWS_PER_PROGRAM", 64)
    config = nsa_config(block, stride, selection_block, n_selected)
    q, keys, values = compressed_inputs(*shape, heads_per_group, length, 8, config)
    want = compressed_branch(q, keys, values, torch.arange(length), 0, config)
    got = compressed.compressed_branch(q, keys, values, block, stride, selection_block, n_selected, straight)
    assert_compressed_forward_equal(got, want)
    weight = torch.randn_like(want[0])
    score_weight = torch.randn_like(want[3]) * want[2]  # the valid slots' scores
    need = torch.autograd.grad((want[0] * weight).sum() + straight * (want[3] * score_weight).sum(), [q, keys, values])
    have = torch.autograd.grad((got[0] * weight).sum() + straight * (got[3] * score_weight).sum(), [q, keys, values])
    for name, a, b in zip(("q", "keys", "values"), have, need, strict=True):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m, n=name: f"grad {n}: {m}")


def test_broken_causal_bound_in_compressed_kernel_is_caught(kernels):
    """Letting each query see the compressed block that completes `stride` tokens after it (the
    test-only causal_shift) changes outputs the parity check compares: it fails."""
    compressed, _ = kernels
    config = nsa_config(16, 8, 16, 3)
    q, keys, values = compressed_inputs(1, 2, 2, 40, 8, config)
    want = compressed_branch(q, keys, values, torch.arange(40), 0, config)[0]
    grouped = q.detach().view(1, 2, 2, 40, 8).transpose(2, 3)  # [B, G, T, R, D]
    sizes = (config.compress_block_size, config.compress_stride, config.selection_block_size)
    exact = compressed.compressed_forward(grouped, keys.detach(), values.detach(), *sizes)[0]
    torch.testing.assert_close(exact.transpose(2, 3).reshape(want.shape), want.detach(), **TOLERANCE)
    broken = compressed.compressed_forward(grouped, keys.detach(), values.detach(), *sizes, causal_shift=8)[0]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(broken.transpose(2, 3).reshape(want.shape), want.detach(), **TOLERANCE)


@pytest.mark.parametrize("n_selected, selection_block, length", [(3, 8, 30), (5, 4, 45), (16, 2, 50)])
def test_selection_kernel_equals_choose_blocks(kernels, n_selected, selection_block, length):
    """Top-n causal blocks, the initial and own block forced in, ascending, valid ones first; fewer
    than n blocks at early queries (invalid padding). Small selection blocks, so that later queries
    have more blocks than they select."""
    compressed, _ = kernels
    torch.manual_seed(n_selected)
    config = nsa_config(16, 16, 16, n_selected)
    config.selection_block_size = selection_block  # the kernel takes any block; the layer's check does not apply
    importance = torch.rand(1, 2, length, -(-length // selection_block))
    indices_want, valid_want = choose_blocks(importance, torch.arange(length), config)
    indices, valid = compressed.select_blocks(importance, n_selected, selection_block)
    assert torch.equal(valid, valid_want)
    assert torch.equal(indices[valid], indices_want[valid])
    # the broken order (the least important blocks instead of the most) is caught by the same check
    inverted, inverted_valid = compressed.select_blocks(importance, n_selected, selection_block, invert=True)
    assert torch.equal(inverted_valid, valid_want)
    assert not torch.equal(inverted[valid], indices_want[valid])


# GQA group, selection block, selected blocks, length, key/value groups, gates
SELECTED_CASES = [(1, 16, 1, 37, 2, False), (4, 32, 5, 70, 1, True), (16, 64, 3, 150, 1, False),
                  (2, 16, 6, 40, 1, True)]  # more selected than the 3 blocks there are


@pytest.mark.parametrize("heads_per_group, block, n_selected, length, groups, gated", SELECTED_CASES)
def test_selected_kernel_equals_torch(kernels, monkeypatch, heads_per_group, block, n_selected, length, groups,
                                      gated):
    """Forward and the gradients of q, k, v and the straight-through gates: dq by the query-centric
    kernel, dK and dV by the key-block-centric one (each block walks the queries that chose it; in
    the gated cases, lists split over several programs, as the initial block's is at long lengths)."""
    _, selected = kernels
    if gated:
        monkeypatch.setattr(selected, "ENTRIES_PER_PROGRAM", 16)
    torch.manual_seed(length)
    batch, dim_head = 1, 8
    positions = torch.arange(length)
    q = torch.randn(batch, groups * heads_per_group, length, dim_head, requires_grad=True)
    k, v = (torch.randn(batch, groups, length, dim_head, requires_grad=True) for _ in range(2))
    indices, valid = random_selection(batch, groups, positions, block, n_selected) if n_selected > 1 else (
        (positions // block).expand(batch, groups, length)[..., None].contiguous(),
        torch.ones(batch, groups, length, 1, dtype=torch.bool))  # the own block only
    gates = torch.rand(batch, groups, length, n_selected, requires_grad=True) if gated else None
    want = selected_attention(q, k, v, indices, valid, gates, positions, block, chunk=32)
    got = selected.selected_attention(q, k, v, indices, valid, gates, 0, block)
    torch.testing.assert_close(got, want, **TOLERANCE)
    weight = torch.randn_like(want)
    inputs = [q, k, v] + ([gates] if gated else [])
    need = torch.autograd.grad((want * weight).sum(), inputs)
    have = torch.autograd.grad((got * weight).sum(), inputs)
    for name, a, b in zip(("q", "k", "v", "gates"), have, need, strict=False):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m, n=name: f"grad {n}: {m}")


def test_broken_causal_bound_in_selected_kernel_is_caught(kernels):
    """A query that also sees the next key of its selected blocks fails the parity check."""
    _, selected = kernels
    torch.manual_seed(0)
    length, block = 40, 16
    q, k, v = (torch.randn(1, 2, length, 8) for _ in range(3))
    indices, valid = random_selection(1, 2, torch.arange(length), block, 2)
    want = selected_attention(q, k, v, indices, valid, None, torch.arange(length), block, chunk=32)
    grouped = q.view(1, 2, 1, length, 8).transpose(2, 3)  # [B, G, T, R, D]
    for shift, equal in ((0, True), (1, False)):
        got = selected.selected_forward(grouped, k, v, indices, valid, q.new_empty(0), 0, block, causal_shift=shift)[0]
        got = got.transpose(2, 3).reshape(want.shape)
        if equal:
            torch.testing.assert_close(got, want, **TOLERANCE)
        else:
            with pytest.raises(AssertionError):
                torch.testing.assert_close(got, want, **TOLERANCE)


def nsa_layer(backend: str):
    """Compressed 16 / stride 8, selection 16, GQA groups of 4, straight-through top-k."""
    from attnlab.attention.base import AttentionSpec, RotaryEmbedding
    from attnlab.attention.nsa import NativeSparseAttention

    config = NSAAttentionConfig(compress_block_size=16, compress_stride=8, selection_block_size=16, num_selected=3,
                                sliding_window_size=8, use_diff_topk=True, query_chunk_size=16, backend=backend)
    spec = AttentionSpec(dim=32, n_heads=8, dim_head=8, n_kv_heads=2, dropout=0.0, max_seq_len=128,
                         layer_index=0, n_layers=1, rotary=RotaryEmbedding(8))
    torch.manual_seed(0)
    return NativeSparseAttention(spec, config)


def test_layer_on_triton_equals_torch(kernels):
    """The whole layer with the paper's kind of blocks (compressed 16 / stride 8, selection 16),
    GQA groups of 4 and straight-through top-k: forward and every parameter's gradient."""
    reference, triton_layer = nsa_layer("torch"), nsa_layer("triton")
    triton_layer.load_state_dict(reference.state_dict())
    x = torch.randn(1, 50, 32, requires_grad=True)
    want, got = reference(x), triton_layer(x)
    torch.testing.assert_close(got, want, **TOLERANCE)
    need = torch.autograd.grad(want.square().sum(), [x, *reference.parameters()])
    have = torch.autograd.grad(got.square().sum(), [x, *triton_layer.parameters()])
    names = ["x"] + [name for name, _ in reference.named_parameters()]
    for name, a, b in zip(names, have, need, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_operator_registrations(kernels):
    """torch.library.opcheck: schema, fake (meta) kernels and autograd registration of the
    compressed-branch and selection ops (what torch.compile relies on)."""
    compressed, _ = kernels
    config = nsa_config(16, 8, 16, 3)
    q, keys, values = compressed_inputs(1, 1, 2, 20, 8, config)
    grouped = q.detach().view(1, 1, 2, 20, 8).transpose(2, 3).contiguous().requires_grad_()
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(compressed.compressed_attention_op, (grouped, keys, values, 16, 8, 16, True),
                          test_utils=checks)
    importance = compressed.compressed_forward(grouped.detach(), keys.detach(), values.detach(), 16, 8, 16)[2]
    torch.library.opcheck(compressed.select_blocks_op, (importance, 3, 16), test_utils=checks)


def test_layer_on_triton_compiles_whole(kernels):
    """torch.compile(fullgraph=True) traces the layer on the triton back-end through its custom ops
    (fake kernels, autograd registrations): the same output and input gradient as eager."""
    layer = nsa_layer("triton")
    x = torch.randn(1, 18, 32, requires_grad=True)
    want = layer(x)
    (want_grad,) = torch.autograd.grad(want.square().sum(), [x])
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    got = compiled(x)
    (got_grad,) = torch.autograd.grad(got.square().sum(), [x])
    torch.testing.assert_close(got, want, **TOLERANCE)
    torch.testing.assert_close(got_grad, want_grad, **TOLERANCE)
