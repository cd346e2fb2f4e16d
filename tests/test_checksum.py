"""Checksums on engine checkpoint folders and exported safetensors files: a flipped bit is a
one-line error naming the file, and `--resume` falls back past a damaged engine folder."""

from __future__ import annotations

import logging
import struct
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from attnlab.cli.main import main
from attnlab.config import ModelConfig, RunConfig, config_to_dict
from attnlab.errors import CheckpointError
from attnlab.hf import export_model
from attnlab.model import Transformer
from attnlab.train.checkpoint import checkpoint_path, save_checkpoint
from attnlab.train.checksum import MANIFEST, file_sha256, folder_files, verify_manifest, write_manifest
from attnlab.train.resume import choose_checkpoint

MODEL = ModelConfig(num_tokens=256, dim=32, depth=1, heads=2, dim_head=16, max_seq_len=32, norm="rmsnorm",
                    feed_forward="swiglu")


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def sharded_folder(folder: Path, seed: int) -> Path:
    """A DCP folder as FSDP writes it, sealed with its checksums as the strategies seal it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp.save({"model": {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))}},
                 checkpoint_id=str(folder), no_dist=True)
    write_manifest(folder, {str(path.relative_to(folder)): file_sha256(path) for path in folder_files(folder)})
    return folder


def test_engine_folder_checksums(tmp_path):
    folder = sharded_folder(tmp_path / "step-0000003", seed=0)
    verify_manifest(folder)
    shard = next(path for path in folder.iterdir() if path.suffix == ".distcp")
    flip(shard, shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=rf"{shard.name} is corrupt: its content does not match .*{MANIFEST}"):
        verify_manifest(folder)
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name} is missing"):
        verify_manifest(folder)
    (folder / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=f"has no {MANIFEST}"):
        verify_manifest(folder)


def test_resume_skips_a_damaged_engine_folder(tmp_path, caplog):
    config = RunConfig(name="run", out_dir=str(tmp_path), model=MODEL)
    for step in (3, 6):
        save_checkpoint(checkpoint_path(config.run_dir, step), {
            "config": config_to_dict(config), "model": Transformer(MODEL).state_dict(), "step": step})
        sharded_folder(config.run_dir / "fsdp" / f"step-{step:07d}", seed=step)
    shard = next((config.run_dir / "fsdp" / "step-0000006").glob("*.distcp"))
    flip(shard, shard.stat().st_size - 100)
    with caplog.at_level(logging.WARNING):
        path, state = choose_checkpoint(config, "auto", "fsdp")
    assert path.name == "step-0000003.pt" and state["step"] == 3
    assert f"{shard} is corrupt" in caplog.text and "newest intact checkpoint" in caplog.text
    with pytest.raises(CheckpointError, match=f"{shard} is corrupt.*step-0000003.pt is intact"):
        choose_checkpoint(config, str(checkpoint_path(config.run_dir, 6)), "fsdp")


def test_exported_safetensors_carry_a_checksum(tmp_path, capsys):
    torch.manual_seed(0)
    out = export_model(Transformer(MODEL), tmp_path / "hf")
    weights = out / "model.safetensors"
    (header_length,) = struct.unpack("<Q", weights.read_bytes()[:8])
    assert b"attnlab_sha256" in weights.read_bytes()[8 : 8 + header_length]
    assert main(["import-hf", str(out), "--out", str(tmp_path / "back")]) == 0
    flip(weights, 8 + header_length + (weights.stat().st_size - 8 - header_length) // 2 + 3)
    assert main(["import-hf", str(out), "--out", str(tmp_path / "again")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"{weights} is corrupt: its tensors do not match their checksum" in error
