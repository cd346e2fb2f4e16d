"""Portable run folders (train/portable.py): a tokenized run keeps its tokenizer and final weights, so
a copy samples, decodes speculatively and exports with its data gone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from attnlab.cli.main import main
from attnlab.config import load_config
from attnlab.data.shards import prepare_token_shards
from attnlab.data.tokenizer import train_tokenizer
from attnlab.train.checkpoint import load_model
from attnlab.train.loop import train

TEXTS = [f"def function_{index}(value):\n    return value * {index} + {index % 7}\n" for index in range(60)]


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


def test_a_copied_tokenized_run_samples_without_its_data(tmp_path, capsys):
    from safetensors.torch import load_file

    run_dir = tokenized_run(tmp_path)
    source_tokenizer = tmp_path / "data" / "shards" / "tokenizer" / "tokenizer.json"
    assert (run_dir / "tokenizer" / "tokenizer.json").read_bytes() == source_tokenizer.read_bytes()
    weights = load_file(str(run_dir / "model.safetensors"))  # the final weights alone
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
