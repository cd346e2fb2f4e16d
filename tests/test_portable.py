"""Portable run folders and retrofitting (train/portable.py, train/retrofit.py): a tokenized run keeps
its tokenizer and final weights, so a copy samples, decodes speculatively and exports with its data
gone; train.init_from starts a model with another attention from a trained one's matching tensors."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from attnlab.cli.main import main
from attnlab.config import load_config
from attnlab.data.shards import prepare_token_shards
from attnlab.data.tokenizer import train_tokenizer
from attnlab.errors import ConfigError
from attnlab.train import retrofit
from attnlab.train.checkpoint import load_model
from attnlab.train.checksum import SAFETENSORS_KEY, load_safetensors
from attnlab.train.loop import train
from attnlab.train.metrics import read_metrics

TEXTS = [f"def function_{index}(value):\n    return value * {index} + {index % 7}\n" for index in range(60)]
NSA = ["model.attention.kind=nsa", "model.attention.nsa.compress_block_size=4", "model.attention.nsa.compress_stride=2",
       "model.attention.nsa.selection_block_size=4", "model.attention.nsa.num_selected=2",
       "model.attention.nsa.sliding_window_size=8"]


def tokenized_run(tmp_path: Path) -> Path:
    """A tokenizer, token shards made with it, and a few steps of a tiny model trained on them."""
    corpus = tmp_path / "data" / "documents.jsonl"
    corpus.parent.mkdir()
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    train_tokenizer([corpus], vocab_size=300, out_dir=tmp_path / "data" / "tokenizer-source")
    prepare_token_shards([corpus], tmp_path / "data" / "tokenizer-source", tmp_path / "data" / "shards", workers=1)
    config = load_config("minimind-demo", [
        "name=tokens", f"out_dir={tmp_path / 'runs'}", "model.num_tokens=300", "model.dim=32", "model.depth=1",
        "model.heads=2", "model.kv_heads=1", "model.dim_head=16", "model.ff_hidden=64", "model.max_seq_len=64",
        "data.source=tokens", f"data.path={tmp_path / 'data' / 'shards'}", "train.seq_len=32",
        "train.batch_size=4", "train.max_steps=4", "train.eval_every=0", "train.sample_every=0",
        "train.save_every=4", "log.progress=false",
    ])
    return train(config).run_dir


def test_a_failed_tokenizer_copy_leaves_the_run_s_copy_whole(tmp_path, monkeypatch):
    """Every start of a run copies the tokenizer into it again: a copy that fails (a full disk, a
    kill) leaves the run's previous copy whole and no staging file beside it."""
    from types import SimpleNamespace

    from attnlab.hf import TOKENIZER_FILES
    from attnlab.train.portable import copy_tokenizer

    source, copy = tmp_path / "source", tmp_path / "run" / "tokenizer"
    for folder, content in ((source, "new"), (copy, "old")):
        folder.mkdir(parents=True)
        for name in TOKENIZER_FILES:
            (folder / name).write_text(f"{content} {name}")

    def full_disk(*arguments, **keywords):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        copy_tokenizer(SimpleNamespace(tokenizer=SimpleNamespace(folder=source)), tmp_path / "run")
    assert {path.name: path.read_text() for path in copy.iterdir()} == {name: f"old {name}" for name in TOKENIZER_FILES}


def test_a_copied_tokenized_run_samples_without_its_data(tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    run_dir = tokenized_run(tmp_path)
    source_tokenizer = tmp_path / "data" / "shards" / "tokenizer" / "tokenizer.json"
    assert (run_dir / "tokenizer" / "tokenizer.json").read_bytes() == source_tokenizer.read_bytes()
    weights = load_file(str(run_dir / "model.safetensors"))  # the final weights alone
    with safe_open(str(run_dir / "model.safetensors"), framework="pt") as handle:
        assert SAFETENSORS_KEY in handle.metadata()
    assert load_safetensors(run_dir / "model.safetensors").keys() == weights.keys()  # the checksum holds
    for name, value in load_model(run_dir).state_dict().items():
        assert name == "head.weight" or torch.equal(weights[name], value), name
    greedy = ["--prompt", "def function_", "--max-new-tokens", "12", "--temperature", "0"]
    capsys.readouterr()
    assert main(["sample", str(run_dir), *greedy]) == 0
    expected = capsys.readouterr().out

    moved = shutil.copytree(run_dir, tmp_path / "elsewhere" / "tokens")
    shutil.rmtree(tmp_path / "data")  # the shards and the tokenizer they were made with are gone
    assert main(["sample", str(moved), *greedy]) == 0
    assert capsys.readouterr().out == expected and expected.startswith("def function_")
    assert main(["speculative", "--target", str(moved), "--early-exit", "1", "--prompt", "def", "--max-new-tokens",
                 "4", "--temperature", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["speculative"]["text"]
    assert main(["export", str(moved), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (moved / "tokenizer" / "tokenizer.json").read_bytes()

    shutil.rmtree(moved / "tokenizer")  # now nothing has it: the error names the files looked for
    assert main(["sample", str(moved), *greedy]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and str(moved / "tokenizer" / "tokenizer.json") in error
    assert "train one" not in error  # a run's tokenizer is not replaced by training a new one


# --------------------------------------------------------------------------------------------
# Retrofitting


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_bytes((Path(retrofit.__file__).read_bytes() + Path(json.__file__).read_bytes()) * 3)
    return path


def byte_run(tmp_path: Path, text_file: Path, name: str, *extra: str):
    return load_config("demo", [
        f"name={name}", f"out_dir={tmp_path / 'runs'}", "model.dim=32", "model.depth=2", "model.heads=2",
        "model.dim_head=16", "model.max_seq_len=64", "data.source=file", f"data.path={text_file}",
        "train.seq_len=32", "train.batch_size=8", "train.max_steps=30", "train.warmup_steps=2", "train.lr=3e-3",
        "train.eval_every=10", "train.eval_batches=4", "train.sample_every=0", "train.save_every=30",
        "train.log_every=1", "log.progress=false", *extra,
    ])


def test_a_dense_run_retrofitted_with_nsa_trains_on(tmp_path, text_file, caplog):
    dense = train(byte_run(tmp_path, text_file, "dense"))
    caplog.set_level(logging.INFO)
    retrofitted = train(byte_run(tmp_path, text_file, "nsa", *NSA, "train.max_steps=10",
                                 f"train.init_from={dense.run_dir}"))
    # the table: every dense tensor is loaded, NSA's own are new, nothing is left over
    source = load_model(dense.run_dir).state_dict()
    nsa_names = set(retrofit.model_shapes(byte_run(tmp_path, text_file, "nsa", *NSA).model))
    assert f"{len(source)} tensors loaded, {len(nsa_names - set(source))} new, 0 skipped" in caplog.text
    assert re.search(r"  loaded    2 x blocks\.\*\.attention\.heads\.to_q\.weight +\[32, 32\]", caplog.text)
    assert re.search(r"  new       2 x blocks\.\*\.attention\.to_gates\.weight +\[6, 32\]", caplog.text)
    # it starts where the dense model ended (close to its loss, far below a fresh model's), and learns
    dense_final = [r["val_loss"] for r in read_metrics(dense.run_dir) if "val_loss" in r][-1]
    evaluations = [r["val_loss"] for r in read_metrics(retrofitted.run_dir) if "val_loss" in r]
    assert evaluations[0] < dense_final + 0.5 < math.log(256)
    assert evaluations[-1] < evaluations[0] and all(math.isfinite(value) for value in evaluations)


def test_retrofit_loads_exactly_the_matching_tensors(tmp_path, text_file):
    nsa = train(byte_run(tmp_path, text_file, "nsa-source", *NSA, "train.max_steps=1"))
    dense_config = byte_run(tmp_path, text_file, "back").model  # and back: NSA -> dense skips NSA's own
    loaded = retrofit.initial_weights(nsa.run_dir, dense_config)
    source = load_model(nsa.run_dir).state_dict()
    assert set(loaded) == set(retrofit.model_shapes(dense_config))
    assert all(torch.equal(value, source[name]) for name, value in loaded.items())
    match = retrofit.match_weights(source, retrofit.model_shapes(dense_config))
    assert match.skipped and all(".attention." in name for name in match.skipped)


def test_a_transformers_llama_is_a_retrofit_source(tmp_path):
    """A Llama through `attnlab import-hf` starts an NSA model: every Llama tensor is loaded."""
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                     max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path / "hf")
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    config = load_config(str(tmp_path / "imported" / "config.yaml"), NSA).model
    loaded = retrofit.initial_weights(tmp_path / "imported", config)
    assert set(loaded) == set(load_model(tmp_path / "imported").state_dict())


def test_nothing_matching_is_one_clear_error(tmp_path, text_file):
    source = train(byte_run(tmp_path, text_file, "source", "train.max_steps=1"))
    other = byte_run(tmp_path, text_file, "wider", "model.dim=48", f"train.init_from={source.run_dir}")
    with pytest.raises(ConfigError, match="none of its .* tensors fits this model") as caught:
        train(other)
    assert "\n" not in str(caught.value)
    assert not (other.run_dir / "checkpoints").exists()
