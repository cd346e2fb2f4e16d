"""The routing, sinkhorn and NSA presets build (on the meta device: no memory) with the parameter
count their header comment states; the enwik8 ones carry their seed's hyperparameters."""

from __future__ import annotations

import re

import pytest
import torch

from attnlab.config import PRESET_DIR, load_config
from attnlab.model import Transformer


@pytest.mark.parametrize(
    "name", ["enwik8-routing", "enwik8-sinkhorn", "routing-small", "sinkhorn-small", "enwik8-nsa", "nsa-small"]
)
def test_parameter_count_matches_header(name):
    header = (PRESET_DIR / f"{name}.yaml").read_text()
    stated = int(re.search(r"^# .*Parameters: ([\d,]+)", header, re.MULTILINE).group(1).replace(",", ""))
    config = load_config(name)
    with torch.device("meta"):
        model = Transformer(config.model)
    assert model.num_parameters() == stated
    assert config.model.reversible == (config.model.attention.kind != "nsa")


def test_enwik8_presets_reproduce_the_seeds():
    routing, sinkhorn = load_config("enwik8-routing").model, load_config("enwik8-sinkhorn").model
    for model in (routing, sinkhorn):
        assert (model.dim, model.depth, model.heads, model.max_seq_len) == (512, 8, 8, 4096)
        assert model.attention.dropout == 0.1
    assert routing.attention.routing.n_local_heads == (8, 8, 8, 8, 4, 4, 2, 2)
    assert (routing.attention.routing.window_size, routing.ff_chunks) == (128, 2)
    assert (sinkhorn.attention.sinkhorn.bucket_size, sinkhorn.ff_chunks, sinkhorn.emb_dim) == (128, 10, 128)
    assert sinkhorn.attention.sinkhorn.n_local_heads == 4


def test_enwik8_nsa_reproduces_seed_002():
    config = load_config("enwik8-nsa")
    model, nsa, train = config.model, config.model.attention.nsa, config.train
    assert (model.num_tokens, model.dim, model.depth, model.heads, model.dim_head, model.kv_heads) == (
        256, 512, 6, 8, 64, 4)
    assert (nsa.sliding_window_size, nsa.compress_block_size, nsa.compressor, nsa.compress_mlp_mult) == (
        64, 16, "mlp", 1.0)
    assert (nsa.selection_block_size, nsa.num_selected, nsa.use_diff_topk) == (16, 4, True)
    assert (train.seq_len, train.batch_size, train.grad_accum, train.lr, train.grad_clip) == (512, 4, 4, 1e-4, 0.5)
    assert (train.schedule, train.eval_every, train.sample_every, train.sample_length, train.prime_length) == (
        "constant", 100, 500, 512, 64)
    assert config.data.source == "enwik8"
