"""The triton back-end's kernels for full and local attention's calls through a cache
(kernels/decode_triton.py), on the CPU under the Triton interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets without CUDA; small sizes; real sizes and CUDA graphs: tests/test_gpu.py):
equal to the test oracle over per-row positions, windows, key/value groups, head widths, query
counts, storages of several splits and dtypes; reading only the keys each query sees; a full or
local model decodes through them as through torch's attention, compiled as eagerly (inductor);
`auto` never takes them on the CPU, and a named back-end that cannot run says why in one line."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from attnlab.attention.base import naive_attention
from attnlab.attention.kernels import choose_cached, decode_triton
from attnlab.errors import ConfigError
from attnlab.model import Transformer
from variants import counted, decode_case, decode_with_rollback, variant_config, visible_keys

SPLIT = decode_triton.SPLIT_KEYS


@pytest.fixture(autouse=True)
def interpreted():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs under TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA; GPU: tests/test_gpu.py)")


@pytest.mark.parametrize("batch, heads, groups, queries, length, width, window", [
    (1, 4, 4, 1, 50, 64, 0),            # a decode step within one split
    (3, 4, 2, 7, 2 * SPLIT + 77, 16, 0),  # a verification window over three splits, key/value groups
    (2, 8, 2, 5, SPLIT + 40, 48, 6),    # a window (local attention), a width that is no power of two
    (2, 4, 2, 4, 3 * SPLIT, 80, SPLIT + 30),  # a window across splits
    (2, 6, 3, 3, 100, 128, 0),          # three heads per group: rows padded
    (1, 16, 1, 8, SPLIT + 1, 32, 0),    # 128 rows; a split of one key
    (2, 2, 1, 3, 90, 256, 20),          # the widest head: keys scored 32 at a time
])
@pytest.mark.parametrize("dtype, storage_dtype", [
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),  # a bfloat16 cache beside float32 weights: float32 products
    (torch.float16, torch.float16),  # 16-bit products (the interpreter's bfloat16 ones are wrong; GPU: bfloat16)
])
def test_equals_the_oracle(batch, heads, groups, queries, length, width, window, dtype, storage_dtype):
    q, keys, values, positions = decode_case(batch, heads, groups, queries, length, width, dtype,
                                             storage_dtype=storage_dtype)
    expected = naive_attention(q.float(), keys.to(dtype).float(), values.to(dtype).float(),
                               visible_keys(positions, length, window))
    out = decode_triton.cached_attention(q, keys, values, positions, window)
    assert out.dtype == dtype and out.shape == q.shape
    tolerance = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), expected, **tolerance)


@pytest.mark.parametrize("window", [0, 40])
def test_reads_only_the_keys_its_queries_see(window):
    """What lies past every query's position (rejected draft tokens, a storage never written: a
    compiled model's cache longer than its text) or before every window changes nothing, even where
    it is not a number."""
    q, keys, values, _ = decode_case(2, 4, 2, 3, 3 * SPLIT, 32, torch.float32)
    positions = torch.tensor([[SPLIT + 20, SPLIT + 21, SPLIT + 22], [90, 91, 92]])
    expected = decode_triton.cached_attention(q, keys, values, positions, window)
    spoiled_keys, spoiled_values = keys.clone(), values.clone()
    spoiled_keys[0, :, SPLIT + 23:] = float("nan")
    spoiled_values[1, :, 93:] = float("inf")
    if window:
        spoiled_keys[0, :, :SPLIT + 20 - window + 1] = float("nan")
        spoiled_values[1, :, :90 - window + 1] = float("inf")
    assert torch.equal(decode_triton.cached_attention(q, spoiled_keys, spoiled_values, positions, window), expected)


def test_reads_a_slice_in_place_and_lays_rows_out_for_the_merge():
    """Queries that are a slice of the projections give what their contiguous copy gives; so do keys
    and values that are a slice of a storage's heads; the output is [B, T, H, D] in memory."""
    q, keys, values, positions = decode_case(2, 4, 2, 6, 40, 32, torch.float32)
    projections = torch.randn(2, 6, 4 + 2, 32)  # [B, T, queries and keys, D], as a step makes them
    projections[:, :, :4] = q.transpose(1, 2)
    sliced = projections.transpose(1, 2)[:, :4]  # [B, H, T, D], strides of the projections
    storage = torch.cat((keys, values), dim=1)  # [B, 2 G, L, D]: a slice of heads per branch
    assert not sliced.is_contiguous()
    out = decode_triton.cached_attention(sliced, storage[:, :2], storage[:, 2:], positions)
    torch.testing.assert_close(out, decode_triton.cached_attention(q, keys, values, positions), atol=0, rtol=0)
    assert out.transpose(1, 2).is_contiguous()


def test_opcheck_and_one_graph_under_torch_compile():
    q, keys, values, positions = decode_case(2, 4, 2, 3, 300, 32, torch.float32)
    torch.library.opcheck(torch.ops.attnlab.cached_attention_triton, (q, keys, values, positions, 0),
                          test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(decode_triton.cached_attention, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, keys, values, positions, 5),
                               decode_triton.cached_attention(q, keys, values, positions, 5), atol=0, rtol=0)


@pytest.mark.parametrize("name", ["full-cpu-decode", "local-cpu-decode"])
def test_a_model_decodes_through_it_as_through_torch(name, monkeypatch):
    """backend=triton takes every call through a cache after the prefill (chunks, per-row rollback,
    one-token steps) and decodes what the torch back-end does."""
    torch.manual_seed(0)
    config = variant_config(name)
    kind = config.attention.kind
    reference = Transformer(config).eval()
    getattr(config.attention, kind).backend = "triton"
    triton_model = Transformer(config).eval()
    for block in reference.blocks:
        block.attention.config = dataclasses.replace(block.attention.config, backend="torch")
    triton_model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(2))
    calls = counted(monkeypatch, decode_triton, "cached_attention")
    with torch.no_grad():
        expected = decode_with_rollback(reference, tokens)
        assert not calls
        torch.testing.assert_close(decode_with_rollback(triton_model, tokens), expected, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2 * config.depth  # the two chunks after the prefill, in every layer


def test_a_compiled_model_decodes_through_it_as_the_eager_one(monkeypatch):
    """compile_decoding() (inductor) traces a step through the op whole and runs the kernels inside
    it: a full model on backend=triton decodes, compiled, what it decodes eagerly (CUDA graphs:
    tests/test_gpu.py)."""
    torch.manual_seed(0)
    config = variant_config("full-cpu-decode", depth=1)
    config.attention.full.backend = "triton"
    eager, compiled = Transformer(config).eval(), Transformer(config).eval()
    compiled.load_state_dict(eager.state_dict())
    assert compiled.compile_decoding(cpp_wrapper=False, linear="library")  # the quicker compile
    tokens = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(2))
    launches = counted(monkeypatch, decode_triton, "_launch")  # inside the compiled step too
    with torch.inference_mode():
        expected = decode_with_rollback(eager, tokens)
        launches.clear()
        torch.testing.assert_close(decode_with_rollback(compiled, tokens), expected, atol=1e-5, rtol=1e-5)
    assert compiled.compiled_entries() == ["step", "draw", "decode_then", "draw_then_decode"]
    assert len(launches) == 2 * config.depth  # the chunk and the step after the prefill, every layer


def test_auto_never_takes_it_on_the_cpu_and_a_named_one_says_why(monkeypatch):
    """auto never takes the interpreter (on CUDA it leaves cached calls to torch for now:
    tests/test_gpu.py)."""
    from attnlab.attention import full, local, nsa

    q, keys, _, _ = decode_case(1, 2, 2, 1, 20, 32, torch.float32)
    assert choose_cached("auto", full.OFFERED, q, keys) in ("cpu", "torch")
    assert choose_cached("triton", full.OFFERED, q, keys) == "triton"
    assert choose_cached("triton", local.OFFERED, q, keys) == "triton"
    assert choose_cached("triton", nsa.CACHED, q, keys) == "torch"  # NSA's cached calls: cpu or torch
    assert choose_cached("triton", full.OFFERED, q.double(), keys.double()) == "torch"  # a dtype it lacks
    many_rows = torch.zeros(1, 64, 3, 128)  # 192 rows (padded: 256) by 128: more than a program holds
    assert choose_cached("triton", full.OFFERED, many_rows, torch.zeros(1, 1, 20, 128)) == "torch"
    with pytest.raises(ConfigError, match="^attention back-end triton has no attention dropout; choose"):
        choose_cached("triton", full.OFFERED, q, keys, dropout=0.1)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match=r"^attention back-end triton runs on CUDA tensors \(or the CPU under"):
        choose_cached("triton", full.OFFERED, q, keys)
