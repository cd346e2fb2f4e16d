"""Every preset whose header states a parameter count (the routing, sinkhorn, NSA and MiniMind ones)
builds with that count on the meta device (no memory); the enwik8 ones carry their seed's
hyperparameters."""

from __future__ import annotations

import re

import pytest
import torch

from attnlab.config import PRESET_DIR, load_config
from attnlab.model import Transformer

STATED = re.compile(r"^# .*Parameters: ([\d,]+)", re.MULTILINE)
COUNTED = sorted(path.stem for path in PRESET_DIR.glob("*.yaml") if STATED.search(path.read_text()))


def test_the_seed_presets_state_their_count():
    for name in ["enwik8-routing", "enwik8-sinkhorn", "routing-small", "sinkhorn-small", "enwik8-nsa", "nsa-small",
                 "minimind-pretrain", "minimind-moe", "minimind-demo"]:
        assert name in COUNTED, name


@pytest.mark.parametrize("name", COUNTED)
def test_parameter_count_matches_header(name):
    stated = int(STATED.search((PRESET_DIR / f"{name}.yaml").read_text()).group(1).replace(",", ""))
    config = load_config(name)
    with torch.device("meta"):
        model = Transformer(config.model)
    assert model.num_parameters() == stated
    if config.model.attention.kind in ("routing", "sinkhorn", "nsa"):
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


@pytest.mark.parametrize("name", sorted(path.stem for path in PRESET_DIR.glob("*.yaml")))
def test_nsa_compressors_smaller_than_the_projections(name):
    """Every NSA preset's compression networks hold at most its attention projections' parameters,
    but enwik8-nsa, which reproduces seed 002's compressor (as wide as its input)."""
    config = load_config(name)
    if config.model.attention.kind != "nsa":
        return
    with torch.device("meta"):
        attention = Transformer(config.model).blocks[0].attention
    compressors = sum(p.numel() for key, p in attention.named_parameters() if key.startswith("compress_"))
    projections = sum(p.numel() for p in attention.heads.parameters())
    assert (compressors <= projections) == (name != "enwik8-nsa"), (compressors, projections)
