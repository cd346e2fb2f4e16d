"""Small configurations of every attention variant, used by the shared contract tests.

Adding a variant to the contract suite is one entry here.
"""

from __future__ import annotations

from typing import Any

from attnlab.config import ModelConfig, config_from_dict

BASE: dict[str, Any] = dict(
    num_tokens=61, dim=32, depth=2, heads=4, dim_head=8, kv_heads=2, max_seq_len=128
)

VARIANTS: dict[str, dict[str, Any]] = {
    "full": dict(attention={"kind": "full"}),
    "full-learned-positions": dict(position="learned", norm="rmsnorm", feed_forward="swiglu"),
    "full-tied-factorised": dict(tie_embeddings=True, emb_dim=16, ff_chunks=3, kv_heads=None),
    "local-no-positions": dict(position="none", attention={"kind": "local", "local": {"window_size": 5}}),
    "local": dict(attention={"kind": "local", "local": {"window_size": 8}}),
    # heads wide enough for the cpu back-end's operator, which auto takes for calls through a cache
    # (kernels/decode_cpu.py; torch's attention where it cannot be built: tests/test_decode_cpu.py checks it runs)
    "full-cpu-decode": dict(dim_head=16, attention={"kind": "full"}),
    "local-cpu-decode": dict(dim_head=16, attention={"kind": "local", "local": {"window_size": 8}}),
    # routing's and sinkhorn's cached calls through it too (its listed blocks): the settings below, wider heads
    "routing-cpu-decode": dict(dim_head=16, attention={"kind": "routing", "routing": {
        "window_size": 4, "n_clusters": 3, "n_local_heads": [1, 0]}}),
    "sinkhorn-cpu-decode": dict(dim_head=16, attention={"kind": "sinkhorn", "sinkhorn": {
        "bucket_size": 6, "n_sortcut": 2, "n_local_heads": 1, "sinkhorn_iter": 3}}),
    # routing: windows and clusters small enough that length 45 overflows both; layer 0 mixes
    # 1 local head with 3 routed ones (not aligned with the 2 kv groups), layer 1 has 2 and 2
    "routing": dict(attention={"kind": "routing", "routing": {
        "window_size": 4, "n_clusters": 3, "n_local_heads": [1, 2], "commitment_weight": 0.1}}),
    "routing-reversible": dict(reversible=True, dropout=0.1, attention={"kind": "routing", "dropout": 0.1,
        "routing": {"window_size": 4, "n_clusters": 3, "n_local_heads": 2, "commitment_weight": 0.1}}),
    # sinkhorn: 45 tokens make 7 buckets of 6 and a partial one, each choosing 2 past ones; one local head
    "sinkhorn": dict(attention={"kind": "sinkhorn", "sinkhorn": {
        "bucket_size": 6, "n_sortcut": 2, "n_local_heads": 1, "sinkhorn_iter": 3}}),
    # buckets of 16: the (T / bucket)^2 sorting matrix stays below the scores at the memory test's lengths
    "sinkhorn-reversible": dict(reversible=True, emb_dim=16, attention={"kind": "sinkhorn", "dropout": 0.1,
        "sinkhorn": {"bucket_size": 16, "n_sortcut": 1}}),
    # nsa (each branch its own keys/values, the default): overlapping compression (block 4, stride 2),
    # selection blocks of 6 != compression block, chunks of 16 queries so 45 tokens span three chunks;
    # diff top-k gates; a compressor as wide as its input (the default's 1/64 would be one unit wide at
    # these widths, its compressed keys near ties)
    "nsa": dict(attention={"kind": "nsa", "nsa": {
        "compress_block_size": 4, "compress_stride": 2, "selection_block_size": 6, "num_selected": 3,
        "sliding_window_size": 5, "use_diff_topk": True, "query_chunk_size": 16, "compress_mlp_mult": 1.0}}),
    # the nsa settings above with heads wide enough for the cpu back-end's cached calls (selected and sliding branches)
    "nsa-cpu-decode": dict(dim_head=16, attention={"kind": "nsa", "nsa": {
        "compress_block_size": 4, "compress_stride": 2, "selection_block_size": 6, "num_selected": 3,
        "sliding_window_size": 5, "query_chunk_size": 16, "compress_mlp_mult": 1.0}}),
    # nsa with one key/value projection shared by its branches, attention-pool compressor, one key/value head
    "nsa-shared": dict(kv_heads=1, attention={"kind": "nsa", "nsa": {
        "compress_block_size": 8, "compress_stride": 4, "selection_block_size": 4, "num_selected": 4,
        "sliding_window_size": 3, "compressor": "attention", "separate_branch_kv": False, "query_chunk_size": 7}}),
}

# variants that must never build a T x T tensor
SPARSE = ["local", "routing", "sinkhorn-reversible", "nsa"]


def variant_config(name: str, **overrides: Any) -> ModelConfig:
    values = {**BASE, **VARIANTS[name], **overrides}
    return config_from_dict(values, ModelConfig)


def random_selection(batch: int, groups: int, positions, block: int, n_selected: int):
    """NSA selections as choose_blocks makes them from random importances (block 0 and each query's
    own block forced in), for queries at `positions` (consecutive) -> indices, valid [B, G, T, n]."""
    import torch

    from attnlab.attention.nsa import choose_blocks
    from attnlab.config import NSAAttentionConfig

    config = NSAAttentionConfig(selection_block_size=block, num_selected=n_selected, compress_block_size=block,
                                compress_stride=block)
    n_blocks = -(-(int(positions[-1]) + 1) // block)
    importance = torch.rand(batch, groups, positions.numel(), n_blocks, device=positions.device)
    return choose_blocks(importance, positions, config)


def flex_twin(name: str, section: str):
    """Two models with the same weights, in eval mode: variant `name` as is (the torch path) and with
    `attention.<section>.backend = "flex"`."""
    import torch

    from attnlab.model.transformer import Transformer

    torch.manual_seed(0)
    reference = Transformer(variant_config(name)).eval()
    flex_config = variant_config(name)
    getattr(flex_config.attention, section).backend = "flex"
    flex = Transformer(flex_config).eval()
    flex.load_state_dict(reference.state_dict())
    return reference, flex


def visible_keys(positions, length: int, window: int):
    """[B, 1, T, L]: key j is seen by the query at position p when p - window < j <= p (no window: j <= p);
    the mask the decode kernels' oracle (naive_attention) takes."""
    import torch

    keys = torch.arange(length)
    seen = keys <= positions[..., None]
    if window:
        seen &= keys > positions[..., None] - window
    return seen[:, None]


def decode_case(batch, heads, groups, queries, length, width, dtype, seed=0, storage_dtype=None):
    """A decode kernel's inputs: queries [B, H, T, D], a storage's keys and values [B, G, L, D] and
    each row's own consecutive positions [B, T] (a verification window), the last row's at the
    storage's end."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, queries, width, generator=generator).to(dtype)
    keys, values = (torch.randn(batch, groups, length, width, generator=generator).to(storage_dtype or dtype)
                    for _ in range(2))
    starts = torch.randint(0, length - queries + 1, (batch, 1), generator=generator)
    starts[-1] = length - queries
    return q, keys, values, starts + torch.arange(queries)


def decode_with_rollback(model, tokens):
    """A model's logits over tokens [2, 30] through its cache: a prefill of 20, a chunk of 6, each
    row rolled back to its own length (23, 21), then one token -> [2, 27, V]."""
    import torch

    cache = model.new_cache(2, 40)
    chunks = [model(tokens[:, :20], cache=cache).logits, model(tokens[:, 20:26], cache=cache).logits]
    cache.truncate_rows(torch.tensor([23, 21]))
    return torch.cat([*chunks, model(tokens[:, 26:27], cache=cache).logits], dim=1)


def counted(monkeypatch, module, function_name: str) -> list[int]:
    """Calls of the function `function_name` of `module` (a kernel's entry, an attention variant's
    operator), counted from now on: one entry a call."""
    calls = []
    function = getattr(module, function_name)

    def counting(*arguments):
        calls.append(1)
        return function(*arguments)

    monkeypatch.setattr(module, function_name, counting)
    return calls
