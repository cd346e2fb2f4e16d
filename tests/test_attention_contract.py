"""The attention contract of DESIGN.md, checked for every variant in tests/variants.py (float32)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnlab.attention.base import AttentionSpec, naive_attention
from attnlab.model import Transformer
from attnlab.registry import ATTENTION
from variants import SPARSE, VARIANTS, variant_config

LENGTH = 45  # deliberately not a multiple of any window, block or bucket size


def make_model(name: str, seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(variant_config(name, **overrides)).eval()


def tokens(batch: int, length: int, vocab: int = 61, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator)


@pytest.fixture(params=sorted(VARIANTS))
def name(request) -> str:
    return request.param


def test_causal_bit_exact(name):
    model = make_model(name)
    x = tokens(2, LENGTH)
    with torch.no_grad():
        reference = model(x).logits
        for t in (0, 7, 8, 20, LENGTH - 2):
            changed = x.clone()
            changed[:, t + 1 :] = torch.randint(0, 61, changed[:, t + 1 :].shape)
            logits = model(changed).logits
            assert torch.equal(logits[:, : t + 1], reference[:, : t + 1]), f"position <= {t} changed"


def test_no_gradient_from_later_positions(name):
    model = make_model(name)
    attention = model.blocks[0].attention
    x = torch.randn(2, LENGTH, model.config.dim, requires_grad=True)
    y = attention(x)
    for t in (3, 17, 30):
        (grad,) = torch.autograd.grad(y[:, t].sum(), x, retain_graph=True)
        assert torch.all(grad[:, t + 1 :] == 0), f"gradient flows from after {t} into {t}"
        assert grad[:, t].abs().sum() > 0


def test_prefix_consistency(name):
    model = make_model(name)
    x = tokens(2, LENGTH)
    with torch.no_grad():
        full = model(x).logits
        for t in (1, 9, 16, 33):
            torch.testing.assert_close(model(x[:, :t]).logits, full[:, :t], atol=1e-5, rtol=1e-5)


def random_split(length: int, rng: random.Random) -> list[int]:
    sizes, left = [], length
    while left:
        size = min(left, rng.choice([1, 1, 2, 3, 5, 8, 13]))
        sizes.append(size)
        left -= size
    return sizes


@pytest.mark.parametrize("split_seed", [0, 1, 2])
def test_cache_equals_parallel(name, split_seed):
    model = make_model(name)
    x = tokens(3, LENGTH)
    sizes = [LENGTH] if split_seed == 0 else random_split(LENGTH, random.Random(split_seed))
    if split_seed == 0:
        sizes = [1] * 10 + [7, 28]  # single tokens, then a verification-sized chunk, then a prefill
    with torch.no_grad():
        parallel = model(x).logits
        cache = model.new_cache(3, 64)
        outputs, start = [], 0
        for size in sizes:
            outputs.append(model(x[:, start : start + size], cache=cache).logits)
            start += size
        assert cache.length == LENGTH
    torch.testing.assert_close(torch.cat(outputs, dim=1), parallel, atol=1e-5, rtol=1e-5)


def test_rollback(name):
    model = make_model(name)
    a, b, c = tokens(2, 20, seed=2), tokens(2, 7, seed=3), tokens(2, 9, seed=4)
    with torch.no_grad():
        cache = model.new_cache(2, 64)
        model(a, cache=cache)
        model(b, cache=cache)
        cache.truncate(20)
        assert cache.length == 20
        resumed = model(c, cache=cache).logits
        expected = model(torch.cat((a, c), dim=1)).logits[:, 20:]
        torch.testing.assert_close(resumed, expected, atol=1e-5, rtol=1e-5)
        cache.truncate(6)  # further back than any window or bucket: the storage keeps every position
        resumed = torch.cat([model(c[:, :4], cache=cache).logits, model(c[:, 4:5], cache=cache).logits], dim=1)
        expected = model(torch.cat((a[:, :6], c[:, :5]), dim=1)).logits[:, 6:]
    torch.testing.assert_close(resumed, expected, atol=1e-5, rtol=1e-5)


def test_per_row_rollback(name):
    """A cache rolled back to lengths of its own per row then equals, row by row, the parallel
    forward of that row's own tokens (a chunk and single tokens)."""
    model = make_model(name)
    a, b, c = tokens(3, 20, seed=2), tokens(3, 7, seed=3), tokens(3, 9, seed=4)
    kept = [0, 3, 7]  # tokens of b each row keeps
    with torch.no_grad():
        cache = model.new_cache(3, 64)
        model(a, cache=cache)
        model(b, cache=cache)
        cache.truncate_rows(torch.tensor([20 + n for n in kept]))
        assert cache.length == 27 and cache.lengths.tolist() == [20, 23, 27]
        resumed = torch.cat([model(c[:, :7], cache=cache).logits] + [model(c[:, t : t + 1], cache=cache).logits
                                                                   for t in (7, 8)], dim=1)
        assert cache.lengths.tolist() == [29, 32, 36]
        for row, n in enumerate(kept):
            own = torch.cat((a[row], b[row, :n], c[row]))[None]
            expected = model(own).logits[0, 20 + n :]
            torch.testing.assert_close(resumed[row], expected, atol=1e-5, rtol=1e-5)
        cache.truncate(25)  # level again, at a length every row has
        assert cache.lengths.tolist() == [25, 25, 25]
        d = tokens(3, 4, seed=5)
        level = torch.cat([model(d[:, :3], cache=cache).logits, model(d[:, 3:], cache=cache).logits], dim=1)
        for row, n in enumerate(kept):
            own = torch.cat((torch.cat((a[row], b[row, :n], c[row]))[:25], d[row]))[None]
            torch.testing.assert_close(level[row], model(own).logits[0, 25:], atol=1e-5, rtol=1e-5)
        # with the bounds a caller has read (speculative decoding's loop): the same state, no read of its own
        cache.truncate_rows(torch.tensor([24, 22, 25]), bounds=(25, 22))
        assert (cache.length, cache.shortest, cache.lengths.tolist()) == (25, 22, [24, 22, 25])
        with pytest.raises(ValueError, match="cannot truncate"):
            cache.truncate_rows(torch.tensor([30, 0, 0]))


def test_batch_rows_independent(name):
    model = make_model(name)
    x = tokens(3, LENGTH)
    other = x.clone()
    other[1:] = tokens(2, LENGTH, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits[0], model(other).logits[0], atol=1e-6, rtol=0)
        alone = model(x[:1]).logits[0]
    torch.testing.assert_close(alone, model(x).logits[0], atol=1e-5, rtol=1e-5)


def test_eval_changes_no_state(name):
    model = make_model(name)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with torch.no_grad():
        model(tokens(2, LENGTH))
        cache = model.new_cache(2, 64)
        model(tokens(2, 5), cache=cache)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_gradients_finite(name):
    model = make_model(name).train()
    x = tokens(2, LENGTH + 1)
    output = model(x[:, :-1], targets=x[:, 1:])
    output.loss.backward()
    for parameter_name, parameter in model.named_parameters():
        assert parameter.grad is not None, f"{parameter_name} got no gradient"
        assert torch.isfinite(parameter.grad).all(), parameter_name


def test_bf16_autocast(name):
    model = make_model(name).train()
    x = tokens(2, LENGTH + 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = model(x[:, :-1], targets=x[:, 1:])
    output.loss.backward()
    assert torch.isfinite(output.loss)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model.eval().new_cache(2, 64)
        assert torch.isfinite(model(x[:, :9], cache=cache).logits).all()


def test_cast_to_bfloat16_decodes_like_its_parallel_forward(name):
    """A model cast to bfloat16 (`--dtype bfloat16` of the decoding commands) decodes in it: its
    caches keep keys and values in bfloat16, and cached steps, a chunk and a per-row rollback give
    its parallel forward's logits to bfloat16's precision (a few of its steps near logits of ~2)."""
    model = make_model(name).to(torch.bfloat16)
    x = tokens(2, LENGTH)
    with torch.no_grad():
        parallel = model(x).logits
        cache = model.new_cache(2, 64)
        cached = torch.cat([model(x[:, :20], cache=cache).logits]
                           + [model(x[:, t : t + 1], cache=cache).logits for t in range(20, 25)]
                           + [model(x[:, 25:31], cache=cache).logits], dim=1)
        cache.truncate_rows(torch.tensor([31, 27]))
        rolled_back = model(x[:, 27:28], cache=cache).logits[1]  # row 1 continues at position 27
    assert parallel.dtype == torch.bfloat16
    assert {value.dtype for layer in cache.layers for value in vars(layer).values()
            if isinstance(value, torch.Tensor) and value.is_floating_point()} & {torch.bfloat16}
    torch.testing.assert_close(cached.float(), parallel[:, :31].float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(rolled_back.float(), parallel[1, 27:28].float(), atol=0.05, rtol=0.02)


def test_a_bfloat16_cache_beside_float32_weights(name):
    """new_cache(dtype=torch.bfloat16) of a float32 model (`attnlab sample --cache-dtype bfloat16`):
    the keys and values it stores are bfloat16, the logits stay float32, and cached steps, a chunk
    and a per-row rollback give the float32 cache's logits to bfloat16's rounding of what attention
    reads. What feeds a choice is not rounded (sinkhorn's bucket summaries: a near tie would choose
    another bucket), so the two caches choose alike and the logits differ by rounding alone."""
    model = make_model(name)
    x = tokens(2, 60)

    def decode(dtype: torch.dtype) -> tuple[torch.Tensor, set[torch.dtype]]:
        cache = model.new_cache(2, 64, dtype=dtype)
        logits = [model(x[:, :30], cache=cache).logits]
        logits += [model(x[:, t : t + 1], cache=cache).logits for t in range(30, 40)]
        logits.append(model(x[:, 40:46], cache=cache).logits)
        # row 1 then opens sinkhorn's bucket 7 again: with these tokens a near tie, which summaries
        # rounded to bfloat16 break the other way
        cache.truncate_rows(torch.tensor([44, 41]))
        logits += [model(x[:, t : t + 1], cache=cache).logits for t in range(46, 50)]
        stored = {value.dtype for layer in cache.layers for value in vars(layer).values()
                  if isinstance(value, torch.Tensor) and value.is_floating_point()}
        return torch.cat(logits, dim=1), stored

    with torch.no_grad():
        exact, _ = decode(torch.float32)
        rounded, stored = decode(torch.bfloat16)
    assert rounded.dtype == torch.float32 and torch.bfloat16 in stored
    torch.testing.assert_close(rounded, exact, atol=5e-3, rtol=0)
    with pytest.raises(ValueError, match="^a cache stores keys and values in a floating-point dtype.* torch.int8$"):
        model.new_cache(2, 64, dtype=torch.int8)


# ----------------------------------------------------------------------------------------------
# Memory: the largest tensor a layer's forward + backward creates, counted exactly by a dispatch
# mode (deterministic, unlike timing or allocator statistics on a shared machine).


class LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


def largest_tensor(layer: torch.nn.Module, length: int, dim: int) -> int:
    x = torch.randn(1, length, dim, requires_grad=True)
    with LargestTensor() as probe:
        layer(x).sum().backward()
    return probe.largest


class NaiveLayer(torch.nn.Module):
    """Full attention through the quadratic oracle: the probe must flag it."""

    def forward(self, x):
        q = k = v = x[:, None]  # [B, 1, T, dim]
        allowed = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return naive_attention(q, k, v, allowed)


def test_memory_probe_detects_quadratic():
    small, large = largest_tensor(NaiveLayer(), 256, 8), largest_tensor(NaiveLayer(), 512, 8)
    assert large >= 3.5 * small and large >= 512 * 512


@pytest.mark.parametrize("sparse_name", SPARSE)
def test_memory_linear_in_length(sparse_name):
    config = variant_config(sparse_name, max_seq_len=4096)
    spec = AttentionSpec(
        dim=config.dim, n_heads=config.heads, dim_head=config.dim_head, n_kv_heads=config.n_kv_heads,
        dropout=0.0, max_seq_len=4096, layer_index=0, n_layers=1, rotary=None,
    )
    attention_class = ATTENTION.get(config.attention.kind)
    layer = attention_class(spec, getattr(config.attention, config.attention.kind, None))
    small, large = largest_tensor(layer, 1024, config.dim), largest_tensor(layer, 2048, config.dim)
    assert large <= 2.5 * small, f"largest tensor grew {large / small:.1f}x when the length doubled"
    assert large < 2048 * 2048 // 4, "a tensor close to T x T was built"


def test_cache_refuses_more_than_it_holds(name):
    """A cache asked beyond its max_len says so in one line, and the forward changes nothing."""
    model = make_model(name)
    with torch.no_grad():
        cache = model.new_cache(2, 24)
        model(tokens(2, 20), cache=cache)
        with pytest.raises(ValueError, match="holds 24 tokens a row"):
            model(tokens(2, 5), cache=cache)
        assert cache.length == 20 and cache.lengths.tolist() == [20, 20]
        with pytest.raises(ValueError, match="cannot truncate"):
            cache.truncate(21)

