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
    "local": dict(attention={"kind": "local", "local": {"window_size": 8, "max_rollback": 16}}),
}

# variants that must never build a T x T tensor
SPARSE = ["local"]


def variant_config(name: str, **overrides: Any) -> ModelConfig:
    values = {**BASE, **VARIANTS[name], **overrides}
    return config_from_dict(values, ModelConfig)
