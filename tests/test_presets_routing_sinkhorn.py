"""The routing and sinkhorn presets build (on the meta device: no memory) with the parameter count
their header comment states."""

from __future__ import annotations

import re

import pytest
import torch

from attnlab.config import PRESET_DIR, load_config
from attnlab.model import Transformer


@pytest.mark.parametrize("name", ["enwik8-routing", "enwik8-sinkhorn", "routing-small", "sinkhorn-small"])
def test_parameter_count_matches_header(name):
    header = (PRESET_DIR / f"{name}.yaml").read_text()
    stated = int(re.search(r"^# .*Parameters: ([\d,]+)", header, re.MULTILINE).group(1).replace(",", ""))
    config = load_config(name)
    with torch.device("meta"):
        model = Transformer(config.model)
    assert model.num_parameters() == stated
    assert config.model.reversible


def test_enwik8_presets_reproduce_the_seeds():
    routing, sinkhorn = load_config("enwik8-routing").model, load_config("enwik8-sinkhorn").model
    for model in (routing, sinkhorn):
        assert (model.dim, model.depth, model.heads, model.max_seq_len) == (512, 8, 8, 4096)
        assert model.attention.dropout == 0.1
    assert routing.attention.routing.n_local_heads == (8, 8, 8, 8, 4, 4, 2, 2)
    assert (routing.attention.routing.window_size, routing.ff_chunks) == (128, 2)
    assert (sinkhorn.attention.sinkhorn.bucket_size, sinkhorn.ff_chunks, sinkhorn.emb_dim) == (128, 10, 128)
    assert sinkhorn.attention.sinkhorn.n_local_heads == 4
