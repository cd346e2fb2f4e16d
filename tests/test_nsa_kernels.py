"""NSA back-ends have the torch path's semantics: FlexAttention's forward (CPU, eager) and the Triton
selected-branch kernels' forward and backward (CPU under TRITON_INTERPRET=1, small sizes, fp32)
and the whole layer on the triton back-end equal the memory-lean torch path."""

from __future__ import annotations

import os

import pytest
import torch

from attnlab.attention.base import AttentionSpec, RotaryEmbedding
from attnlab.attention.nsa import NativeSparseAttention, selected_attention
from attnlab.config import NSAAttentionConfig
from attnlab.errors import ConfigError

DIM, HEADS, DIM_HEAD = 24, 6, 6


def make_layer(backend: str, kv_heads: int = 2, **options) -> NativeSparseAttention:
    """Overlapping compression (block 4, stride 2), selection blocks of 6 != compression block, a
    compressor as wide as its input (the default's would be one unit wide at these widths)."""
    defaults = dict(compress_block_size=4, compress_stride=2, selection_block_size=6, num_selected=3,
                    sliding_window_size=5, query_chunk_size=8, compress_mlp_mult=1.0)
    config = NSAAttentionConfig(**{**defaults, **options, "backend": backend})
    spec = AttentionSpec(dim=DIM, n_heads=HEADS, dim_head=DIM_HEAD, n_kv_heads=kv_heads, dropout=0.0,
                         max_seq_len=64, layer_index=0, n_layers=1, rotary=RotaryEmbedding(DIM_HEAD))
    torch.manual_seed(0)
    layer = NativeSparseAttention(spec, config)
    with torch.no_grad():  # non-zero biases and positions so that every parameter matters
        for parameter in layer.parameters():
            if parameter.abs().sum() == 0:
                parameter.normal_(0, 0.3)
    return layer


def selection(batch: int, groups: int, length: int, block: int, n_selected: int):
    """Initial, two-blocks-back and current block per query; the first two invalid while they do not exist."""
    current = torch.arange(length) // block
    indices = torch.stack((torch.zeros_like(current), torch.clamp(current - 2, min=0), current), dim=-1)
    indices = indices[:, :n_selected].expand(batch, groups, length, n_selected).contiguous()
    valid = torch.ones_like(indices, dtype=torch.bool)
    valid[..., 0] = current > 0
    valid[..., 1] = current > 1
    return indices, valid


# ---- flex


def test_flex_forward_equals_torch():
    torch_layer, flex_layer = make_layer("torch").eval(), make_layer("flex").eval()
    flex_layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(2, 23, DIM)
    with torch.no_grad():
        expected = torch_layer(x)
        torch.testing.assert_close(flex_layer(x), expected, atol=2e-5, rtol=1e-5)
        # through the cache: a prefix, then one token, then a chunk of several (verification)
        cache = flex_layer.new_cache(2, 32)
        outputs = []
        for start, end in [(0, 13), (13, 14), (14, 23)]:
            outputs.append(flex_layer(x[:, start:end], cache=cache))
            cache.advance(end - start)  # a layer's cache on its own counts its tokens when told
        torch.testing.assert_close(torch.cat(outputs, dim=1), expected, atol=2e-5, rtol=1e-5)


def test_flex_refuses_training_on_cpu():
    layer = make_layer("flex")
    with pytest.raises(ConfigError, match="no backward on CPU"):
        layer(torch.randn(1, 9, DIM, requires_grad=True))


# ---- triton (interpreter): tests/conftest.py sets TRITON_INTERPRET=1 where CUDA is absent, before
# triton is first imported

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def interpreter():
    pytest.importorskip("triton")
    if not INTERPRETED:
        pytest.skip("runs under TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    from attnlab.attention.kernels import nsa_triton

    return nsa_triton


@pytest.mark.parametrize("gated", [False, True])
def test_interpreted_triton_selected_kernel_equals_torch(interpreter, gated):
    """GQA with 3 query heads per group, head width 5 and blocks of 3 (all padded inside the kernel)."""
    torch.manual_seed(0)
    batch, groups, length, block, dim_head = 2, 2, 14, 3, 5
    q = torch.randn(batch, HEADS, length, dim_head, requires_grad=True)
    k = torch.randn(batch, groups, length, dim_head, requires_grad=True)
    v = torch.randn(batch, groups, length, dim_head, requires_grad=True)
    indices, valid = selection(batch, groups, length, block, 3)
    gates = torch.rand(batch, groups, length, 3, requires_grad=True) if gated else None
    positions = torch.arange(length)
    expected = selected_attention(q, k, v, indices, valid, gates, positions, block, chunk=4)
    got = interpreter.selected_attention(q, k, v, indices, valid, gates, 0, block)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    weight = torch.randn_like(expected)
    inputs = [q, k, v] + ([gates] if gated else [])
    want = torch.autograd.grad((expected * weight).sum(), inputs)
    have = torch.autograd.grad((got * weight).sum(), inputs)
    for name, a, b in zip("qkvg", have, want, strict=False):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"grad {n}: {m}")


def test_interpreted_triton_layer_equals_torch(interpreter):
    """The whole layer, straight-through top-k on, forward and every gradient; and a cached step."""
    torch_layer = make_layer("torch", use_diff_topk=True)
    triton_layer = make_layer("triton", use_diff_topk=True)
    triton_layer.load_state_dict(torch_layer.state_dict())
    x = torch.randn(1, 17, DIM, requires_grad=True)
    expected, got = torch_layer(x), triton_layer(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    want = torch.autograd.grad(expected.square().sum(), [x, *torch_layer.parameters()])
    have = torch.autograd.grad(got.square().sum(), [x, *triton_layer.parameters()])
    names = ["x"] + [name for name, _ in torch_layer.named_parameters()]
    for name, a, b in zip(names, have, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():
        cache = triton_layer.new_cache(1, 32)
        triton_layer(x[:, :12], cache=cache)
        cache.advance(12)
        torch.testing.assert_close(triton_layer(x[:, 12:], cache=cache), expected[:, 12:], atol=1e-5, rtol=1e-5)


def test_triton_needs_cuda_or_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer = make_layer("triton")
    with pytest.raises(ConfigError, match="CUDA"):
        layer(torch.randn(1, 9, DIM))
