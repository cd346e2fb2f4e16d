"""Sharded (torch.distributed.checkpoint) checkpoints: full tensors rebuilt in one process, and a
crafted metadata file cannot run code."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from attnlab.errors import CheckpointError
from attnlab.train.sharded import load_full_tensors, load_sharded


def write(folder, state):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def test_full_tensors_round_trip(tmp_path):
    model = {"layer.weight": torch.randn(5, 3), "layer.centroids": torch.randn(2, 4).double()}
    ema = {"layer.weight": torch.randn(5, 3)}
    write(tmp_path / "ckpt", {"model": model, "ema": ema, "optimizer": {"param_groups": [{"lr": 0.1}]}})
    full = load_full_tensors(tmp_path / "ckpt", ["model", "ema"])
    assert set(full) == {"model", "ema"}
    for name, value in model.items():
        torch.testing.assert_close(full["model"][name], value)
    torch.testing.assert_close(full["ema"]["layer.weight"], ema["layer.weight"])


class Exploit:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


def test_crafted_metadata_cannot_run_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "ckpt", {"model": {"w": torch.ones(2)}})
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match="unsafe to load"):
        load_full_tensors(tmp_path / "ckpt", ["model"])
    with pytest.raises(CheckpointError, match="unsafe to load"):
        load_sharded({"model": {"w": torch.zeros(2)}}, tmp_path / "ckpt")
    assert not (tmp_path / "pwned").exists()


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="missing or incomplete"):
        load_sharded({"model": {}}, tmp_path / "nothing")
