"""Checkpoints written before the lean attention core (format 1) keep loading: attention weights
renamed to the shared `heads.*` projections (NSA's fused key/value projection split), "torch"
back-ends read as "auto", and the model gives the logits it gave when it was saved.

tests/data/version-1-checkpoints/ holds tiny models of the attention types whose weight names
changed, saved by attnlab at b9d0d73 (format 1) with their logits on fixed tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab.train.checkpoint import FORMAT_VERSION, load_model, read_checkpoint, save_checkpoint

SAVED = Path(__file__).parent / "data" / "version-1-checkpoints"


@pytest.mark.parametrize("name", ["routing", "sinkhorn", "nsa", "nsa-separate"])
def test_version_1_checkpoint_gives_its_logits(name, tmp_path):
    path = SAVED / f"{name}.pt"
    state = read_checkpoint(path)
    assert state["format_version"] == 1
    assert any(".attention.to_q.weight" in key for key in state["model"])  # the old names
    kind = state["config"]["model"]["attention"]["kind"]
    assert state["config"]["model"]["attention"][kind]["backend"] == "auto"  # "torch" then meant auto
    model = load_model(path)
    with torch.no_grad():
        torch.testing.assert_close(model(state["tokens"]).logits, state["logits"], atol=1e-5, rtol=1e-5)
    # written again, in today's format, with today's names
    resaved = tmp_path / "resaved.pt"
    save_checkpoint(resaved, {"config": state["config"], "model": model.state_dict(), "step": 0})
    again = read_checkpoint(resaved)
    assert again["format_version"] == FORMAT_VERSION
    assert not any(".attention.to_q.weight" in key or "to_kv" in key for key in again["model"])
    with torch.no_grad():
        torch.testing.assert_close(load_model(resaved)(state["tokens"]).logits, state["logits"], atol=1e-5, rtol=1e-5)


def test_unknown_format_refused(tmp_path):
    path = tmp_path / "future.pt"
    torch.save({"format_version": FORMAT_VERSION + 1, "model": {}, "config": {}}, path)
    with pytest.raises(Exception, match="format"):
        read_checkpoint(path)


def test_nsa_checkpoint_of_the_earlier_defaults_keeps_its_shapes(tmp_path):
    """A checkpoint saved before the compressor's default width changed holds its resolved config
    (compress_mlp_mult 1.0, no gate_init_bias or compress_positions keys): it loads with the wide
    compressor it was trained with and gives the same logits."""
    from attnlab.config import ModelConfig, config_from_dict, config_to_dict
    from attnlab.model import Transformer

    values = dict(dim=32, depth=1, heads=4, dim_head=8, kv_heads=2, max_seq_len=64,
                  attention=dict(kind="nsa", nsa=dict(compress_block_size=4, compress_stride=2,
                                                      selection_block_size=4, compress_mlp_mult=1.0)))
    torch.manual_seed(0)
    model = Transformer(config_from_dict(values, ModelConfig)).eval()
    config = {"model": config_to_dict(model.config)}
    for key in ("gate_init_bias", "compress_positions"):  # keys the earlier release did not have
        del config["model"]["attention"]["nsa"][key]
    path = tmp_path / "earlier.pt"
    save_checkpoint(path, {"config": config, "model": model.state_dict(), "step": 0})
    loaded = load_model(path)
    assert loaded.blocks[0].attention.compress_keys.w1.shape == (2, 4 * 8, 4 * 8)  # hidden = block x dim_head
    tokens = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits)
