"""The cpu back-end's operators for calls through a cache (kernels/decode_cpu.py): over a range of
positions (full, local), over listed blocks (routing, sinkhorn) and over NSA's compressed blocks
with the block selection, each equal to the test oracle (NSA's: its reference path) over per-row
positions, windows or blocks, key/value groups, head widths, query counts and dtypes;
a full, local, routing, sinkhorn or NSA model decodes through them (the contract suite's *-cpu-decode
variants check cache = no cache and compiled = eager on them); where they cannot serve, torch's
attention does, or a named back-end says why in one line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnlab.attention import full, nsa, routing, sinkhorn
from attnlab.attention.base import naive_attention
from attnlab.attention.kernels import choose_cached, decode_cpu
from attnlab.attention.kernels.cpu import OperatorLibrary
from attnlab.config import NSAAttentionConfig
from attnlab.errors import ConfigError
from attnlab.model import Transformer
from variants import counted, decode_case, decode_with_rollback, variant_config, visible_keys

pytestmark = pytest.mark.skipif(not decode_cpu.available(), reason="no C++ compiler for the CPU kernels")


@pytest.mark.parametrize("batch, heads, groups, queries, length, width, window", [
    (1, 4, 4, 1, 50, 64, 0),     # a decode step
    (3, 4, 2, 7, 77, 16, 0),     # a verification window, key/value groups, storage not a multiple of 16
    (2, 8, 2, 5, 40, 48, 6),     # a window (local attention), a width of three vectors
    (2, 2, 1, 3, 33, 128, 0),
    (2, 4, 4, 7, 70, 128, 0),    # the values weighed for 3 queries at a time, then the 1 left
    (1, 2, 2, 64, 80, 32, 0),    # the most queries a call takes
    (2, 4, 2, 4, 300, 80, 100),  # a window longer than a key block
    (2, 4, 2, 1, 45, 48, 0),     # one query, three vectors of 16 (six of 8), a short last key block
    (2, 2, 1, 1, 37, 16, 9),     # one query, a width of one vector of 16 (two of 8), a window
])
@pytest.mark.parametrize("dtype, storage_dtype", [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),  # a bfloat16 cache beside float32 weights
])
@pytest.mark.parametrize("lanes", [8, 16])  # keys scored together: either width on any CPU
def test_equals_the_oracle(batch, heads, groups, queries, length, width, window, dtype, storage_dtype, lanes):
    q, keys, values, positions = decode_case(batch, heads, groups, queries, length, width, dtype,
                                      storage_dtype=storage_dtype)
    expected = naive_attention(q.float(), keys.float(), values.float(), visible_keys(positions, length, window))
    out = decode_cpu.cached_attention(q, keys, values, positions, window, lanes)
    assert out.dtype == dtype and out.shape == q.shape
    # float32 arithmetic throughout; only a bfloat16 output is rounded
    tolerance = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), expected, **tolerance)


def test_the_cpus_own_width_is_one_of_the_two():
    """lanes 0 (the default) scores keys by the CPU's vector width: 16 or 8, bit for bit; any other
    width is a one-line error."""
    q, keys, values, positions = decode_case(2, 4, 2, 5, 90, 64, torch.float32)
    native = decode_cpu.cached_attention(q, keys, values, positions)
    assert any(torch.equal(native, decode_cpu.cached_attention(q, keys, values, positions, 0, lanes))
               for lanes in (8, 16))
    with pytest.raises(RuntimeError, match="lanes must be 0, 8 or 16, got 4"):
        decode_cpu.cached_attention(q, keys, values, positions, 0, 4)


@pytest.mark.parametrize("queries, storage_dtype, width, lanes", [
    (3, torch.float32, 32, 0),
    (3, torch.bfloat16, 32, 0),   # read in pairs of vectors
    (1, torch.bfloat16, 32, 0),
    (3, torch.bfloat16, 48, 16),  # three vectors of 16: converted into float32 once for the queries
    (1, torch.bfloat16, 48, 16),  # converted as loaded
])
def test_reads_only_the_keys_its_queries_see(queries, storage_dtype, width, lanes):
    """What lies past every query's position (rejected draft tokens, a storage never written) or
    before every query's window changes nothing, even where it is not a number."""
    q, keys, values, _ = decode_case(2, 4, 2, queries, 64, width, torch.float32, storage_dtype=storage_dtype)
    positions = torch.tensor([[20, 21, 22], [40, 41, 42]])[:, 3 - queries:]
    expected = decode_cpu.cached_attention(q, keys, values, positions, 8, lanes)
    for cut in (slice(0, 13), slice(23, 64)):  # the windows start at 13 at the earliest
        spoiled_keys, spoiled_values = keys.clone(), values.clone()
        spoiled_keys[0, :, cut] = float("nan")
        spoiled_values[0, :, cut] = float("inf")
        spoiled = decode_cpu.cached_attention(q, spoiled_keys, spoiled_values, positions, 8, lanes)
        assert torch.equal(spoiled, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_a_slice_in_place_and_lays_rows_out_for_the_merge(dtype):
    """Queries that are a slice of the projections (heads spaced wider than a head's rows) give what
    their contiguous copy gives; the output is [B, T, H, D] in memory, so merging the heads is a view."""
    q, keys, values, positions = decode_case(2, 4, 2, 6, 40, 32, dtype)
    projections = torch.randn(2, 6, 4 + 2, 32).to(dtype)  # [B, T, queries and keys, D], as a step makes them
    projections[:, :, :4] = q.transpose(1, 2)
    sliced = projections.transpose(1, 2)[:, :4]  # [B, H, T, D], strides of the projections
    assert not sliced.is_contiguous()
    out = decode_cpu.cached_attention(sliced, keys, values, positions)
    assert torch.equal(out, decode_cpu.cached_attention(q, keys, values, positions))
    assert out.stride() == decode_cpu.out_layout(q).stride() and out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("storage_dtype", [torch.float32, torch.bfloat16])
def test_reads_a_slice_of_the_storages_heads_in_place(storage_dtype):
    """A slice of a cache's heads (routing's or sinkhorn's local heads before their routed or sorted
    ones: not contiguous over rows) gives what its contiguous copy gives."""
    q, keys, values, positions = decode_case(2, 4, 2, 3, 40, 32, torch.float32, storage_dtype=storage_dtype)
    storage_keys, storage_values = (torch.cat((x, torch.randn(2, 3, 40, 32).to(storage_dtype)), dim=1)
                                    for x in (keys, values))  # these two heads, then three others
    sliced_keys, sliced_values = storage_keys[:, :2], storage_values[:, :2]
    assert not sliced_keys.is_contiguous()
    assert torch.equal(decode_cpu.cached_attention(q, sliced_keys, sliced_values, positions, 8),
                       decode_cpu.cached_attention(q, keys, values, positions, 8))


def test_a_compiled_call_equals_the_eager_one():
    """Traced whole as one operator (its fake gives the shape; the compiled-decoding tests run it
    through inductor's C++ wrapper)."""
    q, keys, values, positions = decode_case(2, 4, 2, 6, 40, 32, torch.float32)
    compiled = torch.compile(decode_cpu.cached_attention, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, keys, values, positions, 0), decode_cpu.cached_attention(q, keys, values,
                                                                                               positions, 0))


def test_opcheck():
    q, keys, values, positions = decode_case(2, 4, 2, 3, 40, 32, torch.float32)
    torch.library.opcheck(torch.ops.attnlab.cached_attention_cpu, (q, keys, values, positions, 0),
                          test_utils=("test_schema", "test_faketensor"))


def listed_case(batch, heads, groups, queries, length, width, n_blocks, block, dtype, storage_dtype, seed=0):
    """Queries at consecutive positions of each row, and blocks listed for each (row, head, query):
    starts anywhere from before the storage to past it (hidden), some blocks absent (bias -inf)."""
    q, keys, values, positions = decode_case(batch, heads, groups, queries, length, width, dtype, seed,
                                      storage_dtype=storage_dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    starts = torch.randint(-block, length + 2, (batch, heads, queries, n_blocks), generator=generator)
    starts[..., -1] = positions[:, None, :] - block + 1  # a block ending at the query itself: it sees a key
    biases = torch.randn(starts.shape, generator=generator)
    biases[torch.rand(starts.shape, generator=generator) < 0.2] = float("-inf")
    biases[..., -1] = 0.0
    return q, keys, values, starts, biases, positions


def listed_oracle(q, keys, values, starts, biases, block, positions) -> torch.Tensor:
    """Every listed key gathered, in float64: its score plus its block's bias; hidden past the query's
    position, outside the storage, or in an absent block."""
    batch, n_heads, n_queries, width = q.shape
    length = keys.shape[2]
    expand = n_heads // keys.shape[1]
    keys, values = (x.double().repeat_interleave(expand, dim=1) for x in (keys, values))  # [B, H, L, D]
    key_positions = (starts[..., None] + torch.arange(block)).flatten(-2)  # [B, H, T, N b]
    seen = ((key_positions >= 0) & (key_positions < length) & (key_positions <= positions[:, None, :, None])
            & biases.repeat_interleave(block, dim=-1).isfinite())
    index = key_positions.clamp(0, length - 1)
    gathered_keys, gathered_values = (x[:, :, None].expand(-1, -1, n_queries, -1, -1).gather(
        3, index[..., None].expand(-1, -1, -1, -1, width)) for x in (keys, values))  # [B, H, T, N b, D]
    scores = torch.einsum("bhtd,bhtkd->bhtk", q.double(), gathered_keys) / width**0.5
    scores = (scores + biases.double().repeat_interleave(block, dim=-1)).masked_fill(~seen, float("-inf"))
    return torch.einsum("bhtk,bhtkd->bhtd", scores.softmax(dim=-1), gathered_values)


@pytest.mark.parametrize("batch, heads, groups, queries, length, width, n_blocks, block", [
    (1, 4, 4, 1, 50, 64, 9, 1),    # a routing step: W + 1 keys, each a block of one
    (2, 4, 2, 6, 77, 16, 5, 1),    # a verification of 6, key/value groups
    (2, 4, 4, 1, 60, 64, 3, 6),    # a sinkhorn step: 2 chosen buckets of 6 and its own
    (3, 2, 1, 4, 48, 128, 4, 8),
    (2, 8, 2, 3, 40, 48, 2, 16),   # a width of three vectors of 16 (six of 8)
])
@pytest.mark.parametrize("dtype, storage_dtype", [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),  # a bfloat16 cache beside float32 weights
])
def test_listed_blocks_equal_the_oracle(batch, heads, groups, queries, length, width, n_blocks, block, dtype,
                                        storage_dtype):
    arguments = listed_case(batch, heads, groups, queries, length, width, n_blocks, block, dtype, storage_dtype)
    q, keys, values, starts, biases, positions = arguments
    out = decode_cpu.listed_attention(q, keys, values, starts, biases, block, positions)
    assert out.dtype == dtype and out.shape == q.shape
    assert out.stride() == decode_cpu.out_layout(q).stride()
    tolerance = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), listed_oracle(*arguments[:5], block, positions), **tolerance)


@pytest.mark.parametrize("storage_dtype", [torch.float32, torch.bfloat16])
def test_listed_blocks_read_a_slice_of_heads_in_place_and_nothing_unseen(storage_dtype):
    """A slice of a cache's heads (routed or sorted heads after local ones: not contiguous over
    rows) gives what its contiguous copy gives; keys past every query's position change nothing,
    even where they are not numbers."""
    q, keys, values, starts, biases, positions = listed_case(2, 3, 3, 2, 40, 32, 4, 3, torch.float32, storage_dtype)
    storage_keys, storage_values = (torch.cat((torch.randn(2, 1, 40, 32).to(storage_dtype), x), dim=1)
                                    for x in (keys, values))  # a local head first, then the three
    sliced_keys, sliced_values = storage_keys[:, 1:], storage_values[:, 1:]
    assert not sliced_keys.is_contiguous()
    expected = decode_cpu.listed_attention(q, keys, values, starts, biases, 3, positions)
    assert torch.equal(decode_cpu.listed_attention(q, sliced_keys, sliced_values, starts, biases, 3, positions),
                       expected)
    last = int(positions.max())
    sliced_keys[:, :, last + 1 :] = float("nan")
    sliced_values[:, :, last + 1 :] = float("inf")
    assert torch.equal(decode_cpu.listed_attention(q, sliced_keys, sliced_values, starts, biases, 3, positions),
                       expected)


@pytest.mark.parametrize("batch, routed, queries, length, n_clusters, window", [
    (1, 4, 1, 50, 3, 4),     # a decode step
    (3, 2, 6, 77, 5, 8),     # a verification window of each row's own positions
    (2, 3, 2, 20, 1, 40),    # one cluster, a window longer than the storage: every earlier key, then -1
    (2, 2, 3, 64, 16, 2),    # clusters rarer than the window: fewer than W + 1 keys, -1 after them
])
def test_routed_keys_equal_the_top_k_of_positions(batch, routed, queries, length, n_clusters, window):
    """The scan back from each query finds what routing's top-k over every stored position finds,
    in the same order (latest first), exactly."""
    generator = torch.Generator().manual_seed(3)
    clusters = torch.randint(0, n_clusters, (batch, routed, length), generator=generator)
    starts = torch.randint(0, length - queries + 1, (batch, 1), generator=generator)
    positions = starts + torch.arange(queries)
    n_keys = min(window + 1, length)
    expected = routing.routed_key_positions(clusters, positions, window)
    assert torch.equal(decode_cpu.routed_keys(clusters, positions, n_keys), expected)
    torch.library.opcheck(torch.ops.attnlab.routed_keys_cpu, (clusters, positions, n_keys),
                          test_utils=("test_schema", "test_faketensor"))


def test_listed_opcheck_and_a_one_line_error():
    q, keys, values, starts, biases, positions = listed_case(2, 4, 2, 3, 40, 32, 3, 2, torch.float32, torch.float32)
    torch.library.opcheck(torch.ops.attnlab.listed_attention_cpu, (q, keys, values, starts, biases, 2, positions),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="starts .int64. and biases .float32. must be"):
        decode_cpu.listed_attention(q, keys, values, starts.int(), biases, 2, positions)


NSA_SETTINGS = [  # (compress block, stride, selection block, blocks selected)
    (4, 2, 6, 3),    # the contract suite's: overlapping compression, selection blocks of another size
    (16, 8, 16, 4),  # the benchmark's
    (8, 8, 8, 5),    # no overlap, more blocks selected than some queries have
]


def compressed_case(batch, heads, groups, queries, length, width, settings, dtype, storage_dtype, seed=0):
    """Queries at each row's own consecutive positions (the first rows early: no block complete yet),
    the memory slot, and a compressed storage with a slot for every block of `length` tokens."""
    compress_block, stride, *_ = settings
    generator = torch.Generator().manual_seed(seed)
    n_slots = max(1, nsa.n_complete_blocks(length, compress_block, stride))
    q = torch.randn(batch, heads, queries, width, generator=generator).to(dtype)
    memory = torch.randn(2, groups, width, generator=generator)
    keys, values = (torch.randn(batch, groups, n_slots, width, generator=generator).to(storage_dtype)
                    for _ in range(2))
    starts = torch.randint(0, length - queries + 1, (batch, 1), generator=generator)
    starts[0] = 0
    starts[-1] = length - queries
    return q, memory, keys, values, starts + torch.arange(queries)


def compressed_reference(q, memory, keys, values, positions, settings):
    """NSA's reference path through a cache (nsa.compressed_attention_chunk over every slot, masked)."""
    compress_block, stride, selection_block, n_select = settings
    config = NSAAttentionConfig(compress_block_size=compress_block, compress_stride=stride,
                                selection_block_size=selection_block, num_selected=n_select)
    memory = memory.to(q.dtype)[:, None, :, None].expand(-1, q.shape[0], -1, -1, -1)
    all_keys = torch.cat((memory[0], keys.to(q.dtype)), dim=2)
    all_values = torch.cat((memory[1], values.to(q.dtype)), dim=2)
    n_selection = -(-(int(positions.max()) + 1) // selection_block)
    out, indices, valid, _ = nsa.compressed_attention_chunk(q, all_keys, all_values, positions, config, n_selection)
    return out, indices, valid


@pytest.mark.parametrize("batch, heads, groups, queries, length, width", [
    (1, 4, 2, 1, 200, 64),   # a decode step
    (2, 4, 2, 6, 77, 16),    # a verification of 6 at each row's own positions
    (3, 2, 1, 4, 48, 128),
    (2, 8, 2, 3, 40, 48),    # a width of three vectors of 16 (six of 8)
])
@pytest.mark.parametrize("settings", NSA_SETTINGS)
@pytest.mark.parametrize("dtype, storage_dtype", [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.bfloat16),  # a bfloat16 cache beside float32 weights
])
def test_compressed_selection_equals_the_reference(batch, heads, groups, queries, length, width, settings, dtype,
                                                   storage_dtype):
    """The compressed branch's output and the chosen blocks (ascending, then the empty slots) are the
    reference's, from each query's complete blocks only."""
    arguments = compressed_case(batch, heads, groups, queries, length, width, settings, dtype, storage_dtype)
    out, chosen = decode_cpu.compressed_selection(*arguments, *settings)
    expected_out, indices, valid = compressed_reference(*arguments, settings)
    assert out.dtype == dtype and out.shape == arguments[0].shape
    assert out.stride() == decode_cpu.out_layout(arguments[0]).stride()
    assert chosen.shape == indices.shape and chosen.dtype == torch.int64
    tolerance = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), expected_out.float(), **tolerance)
    if dtype == torch.float32:  # bfloat16's rounded scores may rank close blocks the other way
        assert torch.equal(chosen >= 0, valid)
        assert torch.equal(torch.where(valid, chosen, -1), torch.where(valid, indices, -1))


def test_compressed_selection_reads_only_the_complete_blocks_in_place():
    """A slice of a storage (its slot of the spare writes cut off, as the cache passes it) is read in
    place; slots past every query's complete blocks change nothing, even where they are not numbers;
    a query before the first complete block sees the memory slot alone."""
    settings = (4, 2, 6, 3)
    q, memory, keys, values, positions = compressed_case(2, 4, 2, 3, 40, 32, settings, torch.float32,
                                                         torch.float32)
    storage_keys, storage_values = (torch.cat((x, torch.randn(2, 2, 1, 32)), dim=2) for x in (keys, values))
    sliced_keys, sliced_values = storage_keys[:, :, :-1], storage_values[:, :, :-1]
    expected = decode_cpu.compressed_selection(q, memory, keys, values, positions, *settings)
    result = decode_cpu.compressed_selection(q, memory, sliced_keys, sliced_values, positions, *settings)
    assert all(torch.equal(a, b) for a, b in zip(result, expected))
    last = nsa.n_complete_blocks(int(positions.max()) + 1, 4, 2)
    sliced_keys[:, :, last:] = float("nan")
    sliced_values[:, :, last:] = float("inf")
    result = decode_cpu.compressed_selection(q, memory, sliced_keys, sliced_values, positions, *settings)
    assert all(torch.equal(a, b) for a, b in zip(result, expected))
    early = torch.zeros(2, 1, dtype=torch.int64)  # position 0: no block complete
    out, chosen = decode_cpu.compressed_selection(q[:, :, :1], memory, keys, values, early, *settings)
    torch.testing.assert_close(out, memory[1].repeat_interleave(2, dim=0)[None, :, None].expand_as(out))
    assert chosen.tolist() == [[[[0, -1, -1]]] * 2] * 2


def test_compressed_selection_opcheck_and_a_one_line_error():
    settings = (4, 2, 6, 3)
    arguments = compressed_case(2, 4, 2, 3, 40, 32, settings, torch.float32, torch.float32)
    torch.library.opcheck(torch.ops.attnlab.compressed_selection_cpu, (*arguments, *settings),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="the blocks must be whole strides"):
        decode_cpu.compressed_selection(*arguments, 5, 2, 6, 3)


@pytest.mark.parametrize("name, module, operator_name", [
    ("full-cpu-decode", decode_cpu, "cached_attention"), ("local-cpu-decode", decode_cpu, "cached_attention"),
    ("routing-cpu-decode", routing, "listed_attention"), ("sinkhorn-cpu-decode", sinkhorn, "listed_attention"),
    ("nsa-cpu-decode", decode_cpu, "listed_attention"),  # NSA's selected branch (its sliding one: cached_attention)
    ("nsa-cpu-decode", decode_cpu, "compressed_selection")])  # and its compressed branch
def test_auto_decodes_through_it_and_equals_torch(name, module, operator_name, monkeypatch):
    """`auto` takes the operator for a cached call (not for the prefill), and decodes what the torch
    back-end does."""
    torch.manual_seed(0)
    auto, reference = Transformer(variant_config(name)).eval(), Transformer(variant_config(name)).eval()
    kind = auto.config.attention.kind
    for block in reference.blocks:  # the same settings (a local window of 8), on torch's attention
        block.attention.config = dataclasses.replace(block.attention.config, backend="torch")
    reference.load_state_dict(auto.state_dict())
    assert getattr(auto.config.attention, kind).backend == "auto"
    tokens = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(2))
    calls = counted(monkeypatch, module, operator_name)

    with torch.no_grad():
        expected = decode_with_rollback(reference, tokens)
        assert not calls
        torch.testing.assert_close(decode_with_rollback(auto, tokens), expected, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2 * auto.config.depth  # the two chunks after the prefill, in every layer


def test_where_it_cannot_serve_torch_does_or_a_named_backend_says_why(monkeypatch):
    q, keys, values, positions = decode_case(1, 2, 2, 1, 20, 8, torch.float32)  # a head width of 8: no block for it
    assert choose_cached("cpu", full.OFFERED, q, keys) == "torch"
    wide = torch.randn(1, 2, 1, 32)
    assert choose_cached("auto", full.OFFERED, wide, keys) == "cpu"
    assert choose_cached("torch", full.OFFERED, wide, keys) == "torch"
    assert choose_cached("auto", full.OFFERED, wide, keys, dropout=0.1) == "torch"
    with pytest.raises(ConfigError, match="^attention back-end cpu runs float32 or bfloat16 tensors; choose"):
        choose_cached("cpu", full.OFFERED, wide.double(), keys.double())
    monkeypatch.setattr(decode_cpu, "available", lambda: False)  # no compiler, or ATTNLAB_CPU_KERNELS=0
    assert choose_cached("auto", full.OFFERED, wide, keys) == "torch"
    with pytest.raises(ConfigError, match="needs the compiled CPU kernels"):
        choose_cached("cpu", full.OFFERED, wide, keys)


def test_a_backend_full_attention_lacks_is_a_one_line_error():
    message = "^attention.full.backend: 'flex' is not one of 'auto', 'torch', 'cpu', 'triton'$"
    with pytest.raises(ConfigError, match=message):
        variant_config("full", attention={"kind": "full", "full": {"backend": "flex"}})


def test_an_operator_library_that_does_not_build_says_so_once(tmp_path, monkeypatch, caplog):
    """kernels/cpu.py's OperatorLibrary (the decode and sampling operators' loader): a source that does
    not compile leaves it unloaded, with one warning naming what serves instead; no second try."""
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++;\n")
    library = OperatorLibrary("attnlab_broken", broken, lambda: None, "using torch's path")
    assert not library.loaded() and not library.loaded()
    assert len(caplog.records) == 1 and "attnlab_broken unavailable, using torch's path" in caplog.text
    monkeypatch.setenv("ATTNLAB_CPU_KERNELS", "0")
    assert not OperatorLibrary("attnlab_off", broken, lambda: None, "").loaded() and len(caplog.records) == 1


def test_concurrent_builds_of_one_library_compile_it_once(tmp_path, monkeypatch):
    """Two builds of one library at once (the ranks of a job started together, test workers): the
    second waits for the first's (kernels/cpu.py's build lock) and loads it; the compiler runs once."""
    import ctypes
    import subprocess
    import threading
    import time

    from attnlab.attention.kernels import cpu

    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int attnlab_tiny() { return 7; }\n')
    compiles, paths = [], []
    run = subprocess.run

    def counting_builds(command, *arguments, **options):
        if "-o" in command:  # a build, not the compiler's version
            compiles.append(1)
            time.sleep(0.5)  # the other build asks meanwhile
        return run(command, *arguments, **options)

    monkeypatch.setattr(cpu.subprocess, "run", counting_builds)
    builds = [threading.Thread(target=lambda: paths.append(cpu.compile_library("attnlab_tiny", (source,), [])))
              for _ in range(2)]
    for build in builds:
        build.start()
    for build in builds:
        build.join()
    assert len(compiles) == 1 and len(paths) == 2 and paths[0] == paths[1]
    assert ctypes.CDLL(str(paths[0])).attnlab_tiny() == 7
