"""Byte-level BPE tokenizer: training, exact round trips (property tests), CLI, transformers loading."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.cli.main import main
from attnlab.data.tokenizer import SPECIAL_TOKENS, Tokenizer, train_tokenizer
from attnlab.errors import DataError

DOCUMENTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, ünïcödé and 中文字符 and emoji 🙂",
    "import os\nprint(os.path.join('a', 'b'))\n",
] * 20


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS))
    return train_tokenizer([corpus], vocab_size=300, out_dir=folder / "tokenizer")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> Tokenizer:
    return Tokenizer(tokenizer_dir)


def test_special_tokens_and_merges(tokenizer):
    assert [tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id] == [0, 1, 2]
    assert tokenizer.vocab_size == 300
    text = "def add(a, b):"
    assert len(tokenizer.encode(text)) < len(text.encode())  # merges learnt from the corpus
    assert tokenizer.decode([tokenizer.bos_id]) == SPECIAL_TOKENS[1]


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_text_round_trips(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.binary())
def test_any_bytes_round_trip(tokenizer, data):
    assert tokenizer.decode_bytes(tokenizer.encode_bytes(data)) == data


def test_batch_encoding_equals_single(tokenizer):
    assert tokenizer.encode_batch(DOCUMENTS[:4]) == [tokenizer.encode(text) for text in DOCUMENTS[:4]]


def test_cli_encode_decode(tokenizer_dir, capsys):
    assert main(["tokenizer", "encode", "--tokenizer", str(tokenizer_dir), "héllo wörld"]) == 0
    ids = capsys.readouterr().out.split()
    assert main(["tokenizer", "decode", "--tokenizer", str(tokenizer_dir), *ids]) == 0
    assert capsys.readouterr().out == "héllo wörld\n"


def test_cli_train(tmp_path, capsys):
    corpus = tmp_path / "a.txt"
    corpus.write_text("\n".join(DOCUMENTS))
    assert (
        main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "280", "--out", str(tmp_path / "t")]) == 0
    )
    assert "280 tokens" in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "t").iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}


def test_cli_train_warns_when_the_documents_give_fewer_tokens_than_asked(tmp_path, capsys, caplog):
    """--vocab-size 6400 (MiniMind's) on a small corpus stops short: said, with the model.num_tokens
    that fits, since the presets' 6400 would spend parameters on ids that never occur."""
    corpus = tmp_path / "a.txt"
    corpus.write_text("\n".join(DOCUMENTS))
    out = tmp_path / "t"
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "6400", "--out", str(out)]) == 0
    n_tokens = Tokenizer(out).vocab_size
    assert n_tokens < 6400 and f"{n_tokens} tokens" in capsys.readouterr().out
    warned = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert any(f"only {n_tokens} tokens" in message and f"model.num_tokens={n_tokens}" in message
               for message in warned), warned


def full_disk(*arguments, **keywords):
    raise OSError(28, "No space left on device")


def test_a_failed_write_leaves_the_tokenizer_folder_whole(tokenizer_dir, tokenizer, tmp_path, monkeypatch):
    """Training again into a folder, or naming the special tokens in it, writes each file staged and
    renamed: a write that fails (a full disk, a kill) leaves the old files whole, no staging file."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, folder)
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        train_tokenizer([tokenizer_dir.parent / "corpus.jsonl"], vocab_size=280, out_dir=folder)
    with pytest.raises(OSError, match="No space"):
        tokenizer.save_special_tokens(folder)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def test_cli_train_reads_what_data_prepare_reads(tmp_path, tokenizer_dir, capsys):
    """A jsonl file is read as documents whatever the case of its suffix (.JSONL was read as raw
    text, JSON syntax and all), and --skip-bad skips its malformed lines as `data prepare
    --skip-bad` does (a file that command took could not train a tokenizer)."""
    corpus = tmp_path / "CORPUS.JSONL"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS) + '{"text": oops\n')
    command = ["tokenizer", "train", "--input", str(corpus), "--vocab-size", "300", "--out", str(tmp_path / "t")]
    assert main(command) == 2
    assert f"{corpus}:81: not valid JSON" in capsys.readouterr().err
    assert main([*command, "--skip-bad"]) == 0
    assert Tokenizer(tmp_path / "t").encode('{"text": ') == Tokenizer(tokenizer_dir).encode('{"text": ')


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="attnlab tokenizer train"):
        Tokenizer(tmp_path)


def test_transformers_loads_it(tokenizer_dir, tokenizer):
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = DOCUMENTS[2]
    assert loaded(text)["input_ids"] == tokenizer.encode(text)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 0)
    assert loaded.decode(tokenizer.encode(text)) == text


def test_cli_encode_takes_bytes_that_are_not_utf8(tokenizer_dir, tokenizer, capsys, monkeypatch):
    """A command line or standard input that is not UTF-8 (Python surrogate-escapes the bytes) is
    encoded byte for byte, as encode_bytes does, not a traceback from the tokenizers library."""
    data = b"abc \xff\xfe def"
    expected = " ".join(str(index) for index in tokenizer.encode_bytes(data)) + "\n"
    argument = data.decode("utf-8", "surrogateescape")
    assert main(["tokenizer", "encode", "--tokenizer", str(tokenizer_dir), argument]) == 0
    assert capsys.readouterr().out == expected
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="strict"))
    assert main(["tokenizer", "encode", "--tokenizer", str(tokenizer_dir)]) == 0
    assert capsys.readouterr().out == expected
