"""The NSA CPU kernel (attention/kernels/nsa_cpu.py): block-listed attention equal to dense float64
attention in outputs and every gradient (gates included), causal to the bit; the compressed branch
and block selection equal to the torch path's; and the whole layer equal on both CPU paths."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.attention import nsa
from attnlab.attention.kernels import nsa_cpu
from attnlab.attention.kernels.cpu import available
from attnlab.config import NSAAttentionConfig
from test_nsa import CASES, DIM, make_layer

needs_kernel = pytest.mark.skipif(not available(), reason="no C++ compiler")


def block_attention(q, k, v, blocks, positions, block, window=0, gates=None):
    """The custom op attnlab::nsa_block_attention_cpu's output (no gates: an empty tensor)."""
    gates = q.new_empty(0) if gates is None else gates
    return nsa_cpu.block_attention(q, k, v, blocks, gates, positions, block, window)[0]


def visible_keys(blocks: list[int], position: int, block: int, window: int, n_keys: int) -> list[tuple[int, int]]:
    """(slot, key) pairs a query at `position` sees, in slot order."""
    first = max(0, position - window + 1) if window else 0
    return [(slot, key) for slot, m in enumerate(blocks) if m >= 0
            for key in range(m * block, min(m * block + block, n_keys)) if first <= key <= position]


def dense_reference(q, k, v, blocks, positions, block, window, gates):
    """The kernel's semantics one query at a time in float64: softmax over the visible keys, each
    probability times its slot's gate."""
    batch, n_groups, n_queries, n_heads, dim = q.shape
    rows = []
    for b in range(batch):
        for g in range(n_groups):
            for t in range(n_queries):
                seen = visible_keys(blocks[b, g, t].tolist(), int(positions[t]), block, window, k.shape[2])
                if not seen:
                    rows.append(q.new_zeros(n_heads, dim))
                    continue
                slots, keys = zip(*seen)
                probs = torch.softmax(q[b, g, t] @ k[b, g, list(keys)].T / math.sqrt(dim), dim=-1)
                if gates is not None:
                    probs = probs * gates[b, g, t, list(slots)]
                rows.append(probs @ v[b, g, list(keys)])
    return torch.stack(rows).view(q.shape)


def random_blocks(batch, n_groups, n_queries, n_slots, n_blocks, generator):
    """Distinct blocks per query in random order, some slots empty (-1)."""
    picks = [torch.cat([torch.randperm(n_blocks, generator=generator), torch.full((n_slots,), -1)])[:n_slots]
             for _ in range(batch * n_groups * n_queries)]
    blocks = torch.stack(picks).view(batch, n_groups, n_queries, n_slots)
    return torch.where(torch.rand(blocks.shape, generator=generator) < 0.15, -1, blocks)


KERNEL_CASES = {  # batch, groups, tokens, heads per group, head width, block, slots, window, gates
    "selected-d64": (2, 2, 37, 2, 64, 16, 4, 0, False),
    "selected-gates-d24": (1, 3, 50, 3, 24, 8, 3, 0, True),
    "window-d64": (1, 2, 40, 2, 64, 16, 0, 20, False),
    "selected-gates-d8-block5": (2, 1, 33, 4, 8, 5, 6, 0, True),
    "one-head-window-block7": (1, 2, 30, 1, 16, 7, 0, 9, False),
}


@needs_kernel
@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
def test_block_attention_matches_dense_reference(case):
    batch, n_groups, n_tokens, n_heads, dim, block, n_slots, window, use_gates = KERNEL_CASES[case]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, n_groups, n_tokens, n_heads, dim, dtype=torch.float64, generator=generator)
    k, v = torch.randn(2, batch, n_groups, n_tokens, dim, dtype=torch.float64, generator=generator).unbind(0)
    positions = torch.arange(n_tokens)
    if window:
        blocks = nsa_cpu.window_blocks(positions, window, block).expand(batch, n_groups, -1, -1)
    else:
        blocks = random_blocks(batch, n_groups, n_tokens, n_slots, -(-n_tokens // block), generator)
    gates = torch.rand(*blocks.shape, dtype=torch.float64, generator=generator) + 0.5 if use_gates else None
    inputs = [x for x in (q, k, v, gates) if x is not None]
    for x in inputs:
        x.requires_grad_()
    expected = dense_reference(q, k, v, blocks, positions, block, window, gates)
    weight = torch.randn(expected.shape, dtype=torch.float64, generator=generator)
    expected_grads = torch.autograd.grad((expected * weight).sum(), inputs)

    singles = [x.detach().float().requires_grad_() for x in inputs]
    q32, k32, v32, *gates32 = singles
    y = block_attention(q32, k32, v32, blocks, positions, block, window, gates32[0] if gates32 else None)
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad((y * weight.float()).sum(), singles)
    for name, got, want in zip(["q", "k", "v", "gates"], grads, expected_grads):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


@needs_kernel
def test_block_attention_reads_only_visible_keys_bit_exact():
    """A query's output and its gradient into q do not change by a bit when keys and values it
    does not see change."""
    generator = torch.Generator().manual_seed(1)
    batch, n_groups, n_tokens, n_heads, dim, block = 1, 2, 48, 2, 24, 8
    q = torch.randn(batch, n_groups, n_tokens, n_heads, dim, generator=generator)
    k, v = torch.randn(2, batch, n_groups, n_tokens, dim, generator=generator).unbind(0)
    blocks = random_blocks(batch, n_groups, n_tokens, 3, n_tokens // block, generator)
    positions = torch.arange(n_tokens)

    def run(k, v):
        q_ = q.clone().requires_grad_()
        y = block_attention(q_, k, v, blocks, positions, block)
        (grad,) = torch.autograd.grad(y[:, :, 20].sum(), q_)
        return y[:, :, 20], grad[:, :, 20]

    reference = run(k, v)
    for g in range(n_groups):
        seen = {key for _, key in visible_keys(blocks[0, g, 20].tolist(), 20, block, 0, n_tokens)}
        hidden = torch.tensor([key not in seen for key in range(n_tokens)])
        changed_k, changed_v = k.clone(), v.clone()
        changed_k[0, g, hidden] = torch.randn(int(hidden.sum()), dim, generator=generator)
        changed_v[0, g, hidden] = torch.randn(int(hidden.sum()), dim, generator=generator)
        for got, want in zip(run(changed_k, changed_v), reference):
            assert torch.equal(got, want)


@needs_kernel
def test_inference_equals_training_forward():
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 40, 2, 16, generator=generator)
    k, v = torch.randn(2, 1, 2, 40, 16, generator=generator).unbind(0)
    blocks = random_blocks(1, 2, 40, 3, 5, generator)
    positions = torch.arange(40)
    with torch.no_grad():
        inference = block_attention(q, k, v, blocks, positions, 8)
    training = block_attention(q.requires_grad_(), k, v, blocks, positions, 8)
    assert torch.equal(inference, training)


def test_window_blocks_cover_each_window_exactly():
    for window, block in ((64, 16), (5, 4), (1, 16), (17, 8)):
        positions = torch.arange(100)
        blocks = nsa_cpu.window_blocks(positions, window, block)
        for t in positions.tolist():
            covered = {key for m in blocks[t].tolist() if m >= 0 for key in range(m * block, m * block + block)}
            assert set(range(max(0, t - window + 1), t + 1)) <= covered
            assert all(m * block <= t for m in blocks[t].tolist())


@needs_kernel
def test_too_many_blocks_refused():
    q = torch.zeros(1, 1, 4, 1, 8)
    k = torch.zeros(1, 1, 4, 8)
    blocks = torch.zeros(1, 1, 4, nsa_cpu.MAX_BLOCKS + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="at most"):
        block_attention(q, k, k, blocks, torch.arange(4), 1)
    many_heads = torch.zeros(1, 1, 4, nsa_cpu.MAX_HEADS + 1, 8)
    with pytest.raises(ValueError, match="query heads"):
        block_attention(many_heads, k, k, blocks[..., :2], torch.arange(4), 1)
    assert nsa_cpu.fits(nsa_cpu.MAX_BLOCKS, nsa_cpu.MAX_HEADS)
    assert not nsa_cpu.fits(nsa_cpu.MAX_BLOCKS + 1, 1) and not nsa_cpu.fits(1, nsa_cpu.MAX_HEADS + 1)


SELECTION_CASES = {  # compress block, stride, selection block, selected, tokens
    "paper-overlap": (16, 8, 16, 4, 300),
    "selection-6": (4, 2, 6, 3, 61),
    "no-overlap": (4, 4, 8, 3, 70),
    "selection-smaller": (8, 4, 4, 4, 45),
}


@needs_kernel
@pytest.mark.parametrize("case", sorted(SELECTION_CASES))
def test_compressed_selection_equals_the_reference(case):
    block, stride, selection, n_selected, n_tokens = SELECTION_CASES[case]
    config = NSAAttentionConfig(compress_block_size=block, compress_stride=stride, selection_block_size=selection,
                                num_selected=n_selected, query_chunk_size=32)
    generator = torch.Generator().manual_seed(3)
    n_groups, n_heads, dim = 2, 2, 16
    n_blocks = nsa.n_complete_blocks(n_tokens, block, stride)
    q = torch.randn(1, n_groups * n_heads, n_tokens, dim, generator=generator, requires_grad=True)
    keys, values = (torch.randn(1, n_groups, 1 + n_blocks, dim, generator=generator).requires_grad_() for _ in "kv")

    output, chosen, scores = nsa_cpu.compressed_attention(q, keys, values, block, stride, selection, n_selected,
                                                          straight_through=True)
    # the reference, with selection scores (what straight-through top-k differentiates)
    positions = torch.arange(n_tokens)
    expected, indices, valid, expected_scores = nsa.compressed_branch(q, keys, values, positions, 0, config)
    expected_blocks = torch.where(valid, indices, -1)
    expected_scores = expected_scores * valid  # empty slots score 0
    assert torch.equal(chosen, expected_blocks)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores, expected_scores, atol=1e-5, rtol=1e-5)
    weight = torch.randn(expected.shape, generator=generator)
    score_weight = torch.randn(scores.shape, generator=generator)
    for score_factor in (0.0, 1.0):  # without and with a gradient into the selection scores
        grads = torch.autograd.grad((output * weight).sum() + score_factor * (scores * score_weight).sum(),
                                    (q, keys, values), retain_graph=True)
        expected_loss = (expected * weight).sum() + score_factor * (expected_scores * score_weight).sum()
        expected_grads = torch.autograd.grad(expected_loss, (q, keys, values), retain_graph=True)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_custom_ops_pass_the_operator_checks():
    """Schema, fake implementation, autograd registration and dispatch (torch.library.opcheck)."""
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(1, 2, 20, 2, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(1, 2, 20, 8, generator=generator, requires_grad=True) for _ in "kv")
    blocks = random_blocks(1, 2, 20, 3, 5, generator)
    gates = torch.rand(blocks.shape, generator=generator, requires_grad=True)
    torch.library.opcheck(nsa_cpu.block_attention, (q, k, v, blocks, gates, torch.arange(20), 4, 0))
    keys, values = (torch.randn(1, 2, 9, 8, generator=generator, requires_grad=True) for _ in "kv")
    for straight_through in (False, True):
        torch.library.opcheck(nsa_cpu.compressed_selection,
                              (q, keys, values, torch.arange(20), 4, 2, 4, 3, straight_through))


@needs_kernel
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_equal_on_both_cpu_paths(case, monkeypatch):
    """The whole layer in float32, the cpu back-end against the reference: outputs and every gradient."""
    calls = []
    forward = nsa_cpu._forward
    monkeypatch.setattr(nsa_cpu, "_forward", lambda *args: calls.append(len(args) > 8) or forward(*args))
    results = []
    for enabled in ("1", "0"):
        monkeypatch.setenv("ATTNLAB_CPU_KERNELS", enabled)
        layer = make_layer(**CASES[case]).float()
        x = torch.randn(2, 150, DIM, generator=torch.Generator().manual_seed(5), requires_grad=True)
        y = layer(x)
        weight = torch.randn(y.shape, generator=torch.Generator().manual_seed(6))
        results.append((y, torch.autograd.grad((y * weight).sum(), [x, *layer.parameters()])))
    # the kernel ran the compressed branch with the selection, then the selected and sliding branches
    assert calls == [True, False, False]
    (y_kernel, grads_kernel), (y_torch, grads_torch) = results
    torch.testing.assert_close(y_kernel, y_torch, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads_kernel, grads_torch, strict=True):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)
