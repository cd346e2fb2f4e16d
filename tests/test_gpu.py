"""Checks that need a CUDA GPU (skipped without one): the Triton NSA kernels (compressed branch with
the selection importance, selection, selected branch), the Triton kernels of full and local
attention's calls through a cache, and the FlexAttention back-ends at real
sizes, forward and backward (flex has no backward on the CPU), against the torch path; training
and the cache on the GPU for every variant.

    pytest tests/test_gpu.py        # on a machine with a GPU

Errors are relative norms ||got - want|| / ||want||, with the reference computed in fp32 from the
same inputs: under about 5e-3 for fp32 kernels (Triton's fp32 dot uses tf32), 3e-2 for bf16.
"""

from __future__ import annotations

import pytest
import torch
from tests.variants import VARIANTS, random_selection, variant_config

from attnlab.attention.base import AttentionSpec, RotaryEmbedding
from attnlab.attention.nsa import NativeSparseAttention, selected_attention
from attnlab.config import NSAAttentionConfig
from attnlab.model.transformer import Transformer

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
DEVICE = "cuda"
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 3e-2}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), "non-finite values"
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("heads_per_group, block", [(16, 64), (3, 48)])
def test_triton_selected_kernel_equals_torch(dtype, gated, heads_per_group, block):
    """2048 queries, 16 selected blocks; GQA groups of 16 (the paper's), and of 3 with blocks of 48
    (both padded inside the kernel)."""
    from attnlab.attention.kernels import nsa_triton

    torch.manual_seed(0)
    batch, groups, length, dim_head, n_selected = 2, 2, 2048, 64, 16
    heads = groups * heads_per_group
    q = torch.randn(batch, heads, length, dim_head, device=DEVICE)
    k, v = (torch.randn(batch, groups, length, dim_head, device=DEVICE) for _ in range(2))
    indices, valid = random_selection(batch, groups, torch.arange(length, device=DEVICE), block, n_selected)
    gates = torch.rand(batch, groups, length, n_selected, device=DEVICE) + 0.5 if gated else None
    positions = torch.arange(length, device=DEVICE)
    inputs = [q, k, v] + ([gates] if gated else [])
    low = [tensor.to(dtype).requires_grad_() for tensor in inputs]
    high = [tensor.to(dtype).float().requires_grad_() for tensor in inputs]  # same values, fp32
    got = nsa_triton.selected_attention(*low[:3], indices, valid, low[3] if gated else None, 0, block)
    want = selected_attention(*high[:3], indices, valid, high[3] if gated else None, positions, block, chunk=256)
    assert got.dtype == dtype
    assert relative_error(got, want) < TOLERANCE[dtype]
    weight = torch.randn_like(want)
    have = torch.autograd.grad((got.float() * weight).sum(), low)
    need = torch.autograd.grad((want * weight).sum(), high)
    for name, a, b in zip("qkvg", have, need, strict=False):
        assert relative_error(a, b) < TOLERANCE[dtype], f"grad {name}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads_per_group, block, stride, selection_block", [(16, 32, 16, 64), (4, 16, 8, 32)])
def test_triton_compressed_kernel_equals_torch(dtype, heads_per_group, block, stride, selection_block):
    """The compressed branch's kernel at 2048 queries: output and the group's importance of every
    selection block (eq. 8-10), forward and the gradients of q, keys and values through both (the
    importance's gradient is the straight-through path's); and the selection kernel on that
    importance equals choose_blocks, 16 blocks per query."""
    from attnlab.attention.kernels import nsa_compressed_triton
    from attnlab.attention.nsa import block_importance, choose_blocks, compressed_visibility, n_complete_blocks

    torch.manual_seed(0)
    batch, groups, length, dim_head, n_selected = 1, 2, 2048, 64, 16
    config = NSAAttentionConfig(compress_block_size=block, compress_stride=stride, selection_block_size=selection_block,
                                num_selected=n_selected)
    n_blocks, n_selection = n_complete_blocks(length, block, stride), -(-length // selection_block)
    q = torch.randn(batch, groups, length, heads_per_group, dim_head, device=DEVICE)
    keys, values = (torch.randn(batch, groups, 1 + n_blocks, dim_head, device=DEVICE) for _ in range(2))
    low = [tensor.to(dtype).requires_grad_() for tensor in (q, keys, values)]
    high = [tensor.to(dtype).float().requires_grad_() for tensor in (q, keys, values)]  # same values, fp32
    output, _, importance = nsa_compressed_triton.compressed_attention_op(*low, block, stride, selection_block, True)
    # the reference in one chunk: [B, G, R, T, 1 + N] probabilities (eq. 7-10)
    grouped = high[0].transpose(2, 3)  # [B, G, R, T, D]
    visible = compressed_visibility(torch.arange(length, device=DEVICE), n_blocks, config)
    scores = grouped @ high[1][:, :, None].transpose(-1, -2) / dim_head**0.5
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    want_output = (probs @ high[2][:, :, None]).transpose(2, 3)  # [B, G, T, R, D]
    want_importance = block_importance(probs[..., 1:], config, n_selection)  # [B, G, T, M]
    assert relative_error(output, want_output) < TOLERANCE[dtype]
    assert relative_error(importance, want_importance) < TOLERANCE[dtype]
    weight, importance_weight = torch.randn_like(want_output), torch.randn_like(want_importance)
    have = torch.autograd.grad((output.float() * weight).sum() + (importance * importance_weight).sum(), low)
    need = torch.autograd.grad((want_output * weight).sum() + (want_importance * importance_weight).sum(), high)
    for name, a, b in zip(("q", "keys", "values"), have, need, strict=True):
        assert relative_error(a, b) < TOLERANCE[dtype], f"grad {name}"
    chosen = importance.detach()
    indices, valid = nsa_compressed_triton.select_blocks_op(chosen, n_selected, selection_block)
    want_indices, want_valid = choose_blocks(chosen, torch.arange(length, device=DEVICE), config)
    assert torch.equal(valid, want_valid) and torch.equal(indices[valid], want_indices[valid])


def nsa_layer(backend: str, heads: int = 16, kv_heads: int = 2, **options) -> NativeSparseAttention:
    defaults = dict(compress_block_size=32, compress_stride=16, selection_block_size=64, num_selected=8,
                    sliding_window_size=256, query_chunk_size=512)
    config = NSAAttentionConfig(**{**defaults, **options, "backend": backend})
    spec = AttentionSpec(dim=512, n_heads=heads, dim_head=64, n_kv_heads=kv_heads, dropout=0.0, max_seq_len=4096,
                         layer_index=0, n_layers=1, rotary=RotaryEmbedding(64, max_seq_len=4096).to(DEVICE))
    torch.manual_seed(0)
    layer = NativeSparseAttention(spec, config)
    with torch.no_grad():  # non-zero biases, so that every parameter matters
        for parameter in layer.parameters():
            if parameter.abs().sum() == 0:
                parameter.normal_(0, 0.3)
    return layer.to(DEVICE)


@pytest.mark.parametrize("backend, straight_through", [("triton", False), ("triton", True), ("flex", False)])
def test_nsa_layer_backend_equals_torch(backend, straight_through):
    """A 1500-token layer (not a multiple of any block or of flex's length bucket), forward and
    every gradient, fp32."""
    reference = nsa_layer("torch", use_diff_topk=straight_through)
    layer = nsa_layer(backend, use_diff_topk=straight_through)
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(2, 1500, 512, device=DEVICE, requires_grad=True)
    want, got = reference(x), layer(x)
    assert relative_error(got, want) < TOLERANCE[torch.float32]
    need = torch.autograd.grad(want.square().sum(), [x, *reference.parameters()])
    have = torch.autograd.grad(got.square().sum(), [x, *layer.parameters()])
    names = ["x"] + [name for name, _ in reference.named_parameters()]
    for name, a, b in zip(names, have, need, strict=True):
        assert relative_error(a, b) < 1e-2, name


@pytest.mark.parametrize("backend", ["triton", "flex"])
def test_nsa_backend_cache_equals_parallel(backend):
    """Prefill, one token, then a chunk of several: the same outputs as one parallel pass."""
    layer = nsa_layer(backend).eval()
    x = torch.randn(1, 700, 512, device=DEVICE)
    with torch.no_grad():
        want = layer(x)
        cache = layer.new_cache(1, 700, device=DEVICE)
        parts = []
        for a, b in [(0, 600), (600, 601), (601, 700)]:
            parts.append(layer(x[:, a:b], cache=cache))
            cache.advance(b - a)  # a layer's cache on its own counts its tokens when told
        got = torch.cat(parts, dim=1)
    assert relative_error(got, want) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("name, section", [("local", "local"), ("routing", "routing"), ("sinkhorn", "sinkhorn")])
def test_flex_backward_equals_torch(name, section):
    """FlexAttention's compiled forward and backward give the torch path's loss and gradients."""
    torch.manual_seed(0)
    reference_config = variant_config(name, max_seq_len=512)
    getattr(reference_config.attention, section).backend = "torch"  # auto would take flex on CUDA too
    reference = Transformer(reference_config).to(DEVICE)
    config = variant_config(name, max_seq_len=512)
    getattr(config.attention, section).backend = "flex"
    flex = Transformer(config).to(DEVICE)
    flex.load_state_dict(reference.state_dict())
    reference.eval()  # no dropout, no Gumbel noise: the two must agree
    flex.eval()
    # 299 queries: flex serves chunks of LENGTH_BUCKET (128) or more on CUDA
    tokens = torch.randint(0, config.num_tokens, (2, 300), device=DEVICE)
    want = reference(tokens[:, :-1], targets=tokens[:, 1:]).loss
    got = flex(tokens[:, :-1], targets=tokens[:, 1:]).loss
    assert abs(float(got) - float(want)) < 1e-4
    want.backward()
    got.backward()
    for (name_, a), (_, b) in zip(flex.named_parameters(), reference.named_parameters(), strict=True):
        if b.grad is not None:
            assert relative_error(a.grad, b.grad) < 1e-2, name_


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_trains_and_caches_on_gpu(name):
    """Every contract variant: a bf16-autocast training step on the GPU gives a finite loss and
    gradients, and fp32 decoding through the cache equals the parallel forward."""
    torch.manual_seed(0)
    model = Transformer(variant_config(name)).to(DEVICE)
    tokens = torch.randint(0, model.config.num_tokens, (2, 46), device=DEVICE)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens[:, :-1], targets=tokens[:, 1:]).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        want = model(tokens).logits
        cache = model.new_cache(2, 46)
        got = torch.cat([model(tokens[:, a:b], cache=cache).logits for a, b in [(0, 20), (20, 21), (21, 46)]], dim=1)
    assert relative_error(got, want) < 1e-4


@pytest.mark.parametrize("dtype, storage_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                   (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("heads, kv_heads, queries, window", [(32, 2, 1, 0), (8, 8, 6, 0), (32, 2, 1, 512)])
def test_triton_cached_attention_equals_torch(dtype, storage_dtype, heads, kv_heads, queries, window):
    """The triton back-end's cached-call kernels (kernels/decode_triton.py) at real sizes: a storage
    of 16k positions, each row's queries at its own positions, against torch's attention over the
    whole storage with the mask; what lies past the positions is never read."""
    from attnlab.attention import full
    from attnlab.attention.base import masked_attention
    from attnlab.attention.kernels import choose_cached, decode_triton

    torch.manual_seed(0)
    length, width = 16384, 128
    q = torch.randn(3, heads, queries, width, device=DEVICE, dtype=dtype)
    keys, values = (torch.randn(3, kv_heads, length, width, device=DEVICE).to(storage_dtype) for _ in range(2))
    starts = torch.tensor([[37], [9000], [length - queries]], device=DEVICE)
    positions = starts + torch.arange(queries, device=DEVICE)
    key_index = torch.arange(length, device=DEVICE)
    visible = key_index <= positions[..., None]
    if window:
        visible &= key_index > positions[..., None] - window
    want = masked_attention(q.float(), keys.float(), values.float(), visible[:, None])
    got = decode_triton.cached_attention(q, keys, values, positions, window)
    assert relative_error(got, want) < TOLERANCE[dtype]
    assert choose_cached("triton", full.OFFERED, q, keys) == "triton"
    assert choose_cached("auto", full.OFFERED, q, keys) == "torch"  # until timed on a GPU (gpu.sh cached)
    keys[0, :, 37 + queries:] = float("nan")
    values[1, :, 9000 + queries:] = float("inf")
    assert torch.equal(decode_triton.cached_attention(q, keys, values, positions, window), got)


# every type over caches in the weights' dtype, two over caches of bfloat16 keys and values, and
# full and local attention's cached calls on the triton back-end's kernels (the eager model: auto)
CUDA_GRAPH_CASES = [*((name, None, "auto") for name in ("full", "local", "routing", "sinkhorn", "nsa")),
                    ("full", torch.bfloat16, "auto"), ("nsa", torch.bfloat16, "auto"),
                    ("full", None, "triton"), ("local", None, "triton"), ("full", torch.bfloat16, "triton")]


@pytest.mark.parametrize("name, cache_dtype, backend", CUDA_GRAPH_CASES)
def test_compiled_decoding_replays_cuda_graphs(name, cache_dtype, backend):
    """compile_decoding() on the GPU (inductor, CUDA graphs): the eager logits over a prefill,
    one-token steps, a chunk, a level and a per-row rollback, with every logit kept across steps;
    no step skips CUDA graphs (the caches' tensors are static inputs); a second cache, at other
    addresses, too. Also over caches of bfloat16 keys and values beside float32 weights, and with
    the compiled model's attention on another back-end than the eager one's."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = Transformer(variant_config(name, depth=2, max_seq_len=512)).to(DEVICE).eval()
    compiled_config = variant_config(name, depth=2, max_seq_len=512)
    getattr(compiled_config.attention, name).backend = backend
    compiled = Transformer(compiled_config).to(DEVICE).eval()
    compiled.load_state_dict(eager.state_dict())
    assert compiled.compile_decoding() and compiled._cuda_graphs
    tokens = torch.randint(0, 61, (2, 80), device=DEVICE)

    def decode(model: Transformer) -> torch.Tensor:
        cache = model.new_cache(2, 128, dtype=cache_dtype)
        logits = [model(tokens[:, :20], cache=cache).logits]
        logits += [model(tokens[:, p : p + 1], cache=cache).logits for p in range(20, 40)]
        logits.append(model(tokens[:, 40:46], cache=cache).logits)
        cache.truncate(42)
        cache.truncate_rows(torch.tensor([42, 37], device=DEVICE))
        logits += [model(tokens[:, p : p + 1], cache=cache).logits for p in range(46, 60)]
        return torch.cat(logits, dim=1)

    with torch.no_grad():
        want = decode(eager)
        for _ in range(2):
            assert relative_error(decode(compiled), want) < 1e-4
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("name", ["full", "local", "routing", "sinkhorn", "nsa"])
@pytest.mark.parametrize("per_row", [True, False])
def test_speculative_greedy_equals_target_on_gpu(per_row, name):
    """Speculative decoding on the GPU at batch 4, with each row's caches rolled back to its own
    length (per_row) or all to the shortest: greedy output equals the target's greedy decoding,
    and a per-row rolled-back cache equals each row's own parallel forward."""
    from attnlab.generate.sampling import SamplingConfig, generate
    from attnlab.generate.speculative import EarlyExitDraft, speculative_generate

    torch.manual_seed(0)
    target = Transformer(variant_config(name, depth=2)).to(DEVICE).eval()
    draft = EarlyExitDraft(target, 1)  # close to the target: many drafts accepted, some not
    greedy = SamplingConfig(temperature=0)
    prompt = torch.randint(0, 61, (4, 9), device=DEVICE)
    expected = generate(target, prompt, 32, greedy)
    result = speculative_generate(target, draft, prompt, 32, gamma=5, sampling=greedy, per_row=per_row)
    assert result.per_row == per_row and 0 < result.n_accepted < result.n_drafted
    assert torch.equal(result.tokens, expected)
    tokens = torch.randint(0, 61, (3, 30), device=DEVICE)
    with torch.no_grad():
        cache = target.new_cache(3, 64)
        target(tokens[:, :20], cache=cache)
        cache.truncate_rows(torch.tensor([12, 16, 20], device=DEVICE))
        got = target(tokens[:, 20:26], cache=cache).logits
        for row, length in enumerate((12, 16, 20)):
            own = torch.cat((tokens[row, :length], tokens[row, 20:26]))[None]
            assert relative_error(got[row], target(own).logits[0, length:]) < 1e-4


@pytest.mark.parametrize("per_row", [True, False])
def test_compiled_early_exit_speculative_on_gpu(per_row):
    """An early-exit draft of a target compiled with CUDA graphs proposes through the target's
    compiled draw (its first block's graph): greedy speculative decoding at batch 4 equals the
    target's greedy decoding, and no call skips CUDA graphs."""
    from torch._dynamo.utils import counters

    from attnlab.generate.sampling import SamplingConfig, generate
    from attnlab.generate.speculative import EarlyExitDraft, speculative_generate

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    target = Transformer(variant_config("full", depth=2)).to(DEVICE).eval()
    greedy = SamplingConfig(temperature=0)
    prompt = torch.randint(0, 61, (4, 9), device=DEVICE)
    expected = generate(target, prompt, 32, greedy)
    assert target.compile_decoding() and target._cuda_graphs
    draws = []
    draw = target.draw
    target.draw = lambda *arguments: draws.append(arguments[-1]) or draw(*arguments)
    result = speculative_generate(target, EarlyExitDraft(target, 1), prompt, 32, gamma=5, sampling=greedy,
                                  per_row=per_row)
    assert torch.equal(result.tokens, expected)
    assert draws and set(draws) == {1}  # every proposal through the target's draw, one block deep
    assert counters["inductor"]["cudagraph_skips"] == 0
