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
