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
    "local": dict(attention={"kind": "local", "local": {"window_size": 8, "max_rollback": 16}}),
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
}

# variants that must never build a T x T tensor
SPARSE = ["local", "routing", "sinkhorn-reversible"]


def variant_config(name: str, **overrides: Any) -> ModelConfig:
    values = {**BASE, **VARIANTS[name], **overrides}
    return config_from_dict(values, ModelConfig)
