"""Data a user hands attnlab, good and bad (issue 27, items 8, 9 and 11): malformed jsonl lines with
and without --skip-bad, damaged archives and token folders, bad safetensors headers, tokenizers other
than MiniMind's, a `data prepare` that never loses the data already there, and progress bars."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.cli.main import main
from attnlab.config import DataConfig
from attnlab.data.corpus import load_corpus
from attnlab.data.pretrain import load_token_corpus
from attnlab.data.shards import TokenShards, prepare_token_shards
from attnlab.data.tokenizer import Tokenizer, train_tokenizer
from attnlab.errors import ConversionError, DataError

TEXTS = [f"document {index} says " + "hello world " * (index % 5 + 1) for index in range(60)]


def write_jsonl(path: Path, texts: list[str], extra: bytes = b"") -> Path:
    path.write_bytes("".join(json.dumps({"text": text}) + "\n" for text in texts).encode() + extra)
    return path


def refused(argv: list[str], capsys) -> str:
    """A command that must end with one line on stderr and a non-zero exit; -> the line."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    error = capsys.readouterr().err.strip()
    assert code not in (0, None) and len(error.splitlines()) == 1 and "Traceback" not in error, error
    return error


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("inputs")


@pytest.fixture(scope="module")
def tokenizer_dir(folder) -> Path:
    return train_tokenizer([write_jsonl(folder / "train.jsonl", TEXTS)], vocab_size=300, out_dir=folder / "tok")


@pytest.fixture(scope="module")
def prepared(folder, tokenizer_dir) -> Path:
    prepare_token_shards([write_jsonl(folder / "good.jsonl", TEXTS)], tokenizer_dir, folder / "data",
                         shard_tokens=300, workers=1)
    return folder / "data"


# --------------------------------------------------------------------------------------------
# Malformed jsonl lines: one line naming file:line, or skipped and counted with --skip-bad

BAD_LINES = {
    "lone surrogate": b'{"text": "a\\ud800b"}',
    "5,000-digit integer": b'{"text": "x", "n": ' + b"9" * 5000 + b"}",
    "100k-deep nesting": b'{"text": "x", "d": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "deep array": b"[" * 100_000,
    "not JSON": b'{"text": "unterminated',
    "byte-order mark": '\ufeff{"text": "x"}'.encode(),
    "not UTF-8": b'{"text": "caf\xe9"}',
    "control character": b'{"text": "a\x00b"}',
    "an array": b"[1, 2]",
    "a number": b"17",
    "text not a string": b'{"text": 5}',
    "text null": b'{"text": null}',
    "no text": b'{"body": "x"}',
    "NaN text": b'{"text": NaN}',
    "nested text": b'{"text": {"text": "x"}}',
}


@pytest.mark.parametrize("name", list(BAD_LINES))
def test_bad_jsonl_line(name, folder, tokenizer_dir, capsys):
    path = write_jsonl(folder / f"bad-{len(name)}-{name.split()[0]}.jsonl", TEXTS[:5], BAD_LINES[name] + b"\n")
    with pytest.raises(DataError, match=rf"{path}:6: "):
        prepare_token_shards([path], tokenizer_dir, folder / "out-bad", workers=1)
    meta = prepare_token_shards([path], tokenizer_dir, folder / "out-bad", workers=1, skip_bad=True).meta
    assert meta["skipped_lines"] == 1 and meta["n_documents"] == 5
    base = ["data", "prepare", "--input", str(path), "--tokenizer", str(tokenizer_dir), "--out", str(folder / "o")]
    assert f"{path}:6: " in refused([*base, "--workers", "2"], capsys)  # from a worker process too
    assert main([*base, "--workers", "2", "--skip-bad"]) == 0


def test_a_byte_order_mark_opening_the_file_is_not_part_of_its_first_line(folder, tokenizer_dir):
    """Some editors and Windows tools open a UTF-8 file with a byte-order mark: the file's first
    document is read as any other (a mark inside the file stays a malformed line: BAD_LINES)."""
    path = folder / "marked.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + write_jsonl(folder / "plain.jsonl", TEXTS[:5]).read_bytes())
    marked = prepare_token_shards([path], tokenizer_dir, folder / "out-marked", workers=1).meta
    plain = prepare_token_shards([folder / "plain.jsonl"], tokenizer_dir, folder / "out-plain", workers=1).meta
    assert marked["n_documents"] == 5 and marked["skipped_lines"] == 0
    assert marked["n_tokens"] == plain["n_tokens"]


# --------------------------------------------------------------------------------------------
# Damaged archives and token folders: one line naming the file


def gzip_damaged(kind: str, path: Path) -> Path:
    data = gzip.compress(b"some bytes to train on\n" * 500)
    damaged = {"truncated": data[: len(data) // 2], "bad block": data[:20] + bytes([data[20] ^ 0x55]) + data[21:],
               "bad checksum": data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:], "not gzip": b"plain text, no gzip",
               "empty archive": gzip.compress(b"")}[kind]
    path.write_bytes(damaged)
    return path


@pytest.mark.parametrize("kind", ["truncated", "bad block", "bad checksum", "not gzip", "empty archive"])
def test_damaged_gzip(kind, tmp_path, capsys):
    path = gzip_damaged(kind, tmp_path / "corpus.gz")
    with pytest.raises(DataError, match=str(path)):
        load_corpus(DataConfig(source="file", path=str(path)))
    assert str(path) in refused(["data", "info", "data.source=file", f"data.path={path}"], capsys)


def meta_edit(**changes) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        meta.update(changes)
        (folder / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if v is not None}))

    return edit


DAMAGE: dict[str, Callable[[Path], object]] = {
    "shard missing": lambda f: (f / "shard-00000.tokens.bin").unlink(),
    "shard truncated": lambda f: os.truncate(f / "shard-00000.tokens.bin", 10),
    "shard a folder": lambda f: ((f / "shard-00001.tokens.bin").unlink(), (f / "shard-00001.tokens.bin").mkdir()),
    "offsets missing": lambda f: (f / "shard-00000.offsets.npy").unlink(),
    "offsets truncated": lambda f: os.truncate(f / "shard-00000.offsets.npy", 100),
    "offsets garbage": lambda f: (f / "shard-00000.offsets.npy").write_bytes(b"garbage" * 20),
    "offsets pickled": lambda f: np.save(f / "shard-00000.offsets.npy", np.array([object()]), allow_pickle=True),
    "offsets float": lambda f: np.save(f / "shard-00000.offsets.npy",
                                       np.load(f / "shard-00000.offsets.npy").astype(np.float64)),
    "offsets decreasing": lambda f: np.save(f / "shard-00000.offsets.npy",
                                            np.load(f / "shard-00000.offsets.npy")[::-1].copy()),
    "meta not JSON": lambda f: (f / "meta.json").write_text("{not json"),
    "meta empty": lambda f: (f / "meta.json").write_text(""),
    "meta a list": lambda f: (f / "meta.json").write_text("[]"),
    "meta missing": lambda f: (f / "meta.json").unlink(),
    "meta without shards": meta_edit(shards=None),
    "meta shards empty": meta_edit(shards=[]),
    "meta dtype": meta_edit(dtype="float99"),
    "meta counts": meta_edit(n_tokens=10**9),
    "meta pad missing": meta_edit(pad_id=None),
    "meta id beyond vocabulary": meta_edit(eos_id=10**6),
    "meta shard path outside": lambda f: meta_edit(shards=[{**json.loads((f / "meta.json").read_text())["shards"][0],
                                                           "tokens": "../../etc/passwd"}])(f),
    "tokenizer missing": lambda f: shutil.rmtree(f / "tokenizer"),
    "tokenizer garbage": lambda f: (f / "tokenizer" / "tokenizer.json").write_text("garbage"),
    "tokenizer replaced": lambda f: (f / "tokenizer" / "tokenizer.json").write_text(
        (f / "tokenizer" / "tokenizer.json").read_text() + "\n"),  # still a tokenizer, not the shards' one
    "tokenizer special tokens changed": lambda f: (f / "tokenizer" / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>"})),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_damaged_token_folder(name, prepared, tmp_path, capsys):
    damaged = tmp_path / "data"
    shutil.copytree(prepared, damaged)
    DAMAGE[name](damaged)
    with pytest.raises(DataError):
        load_token_corpus(DataConfig(source="tokens", path=str(damaged)))
    refused(["data", "info", "data.source=tokens", f"data.path={damaged}"], capsys)


def test_a_flipped_token_is_caught_when_read(prepared, tmp_path):
    damaged = tmp_path / "data"
    shutil.copytree(prepared, damaged)
    tokens = np.memmap(damaged / "shard-00000.tokens.bin", dtype=np.uint16, mode="r+")
    tokens[3] = 60_000  # beyond the 300-token vocabulary
    tokens.flush()
    shards = TokenShards(damaged)
    with pytest.raises(DataError, match="token id 60000, beyond the vocabulary of 300"):
        shards.document(0)
    with pytest.raises(DataError, match="beyond the vocabulary"):
        shards.gather(np.arange(10))
    assert len(shards.document(1))  # the rest reads


# --------------------------------------------------------------------------------------------
# `data prepare` into an existing folder: the old data stays until the new data is complete


def prepared_documents(folder: Path) -> int:
    return TokenShards(folder).n_documents


def test_a_failed_prepare_keeps_the_data_there(tmp_path, tokenizer_dir, capsys):
    out = tmp_path / "data"
    prepare_token_shards([write_jsonl(tmp_path / "a.jsonl", TEXTS)], tokenizer_dir, out, workers=1)
    before = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    bad = write_jsonl(tmp_path / "b.jsonl", TEXTS[:10], b"not json\n")
    line = refused(["data", "prepare", "--input", str(bad), "--tokenizer", str(tokenizer_dir), "--out", str(out),
                    "--workers", "1"], capsys)
    assert "b.jsonl:11" in line
    assert {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()} == before
    assert prepared_documents(out) == len(TEXTS)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left


def test_an_interrupted_prepare_keeps_the_data_there(tmp_path, tokenizer_dir, monkeypatch):
    import attnlab.data.shards as shards

    out = tmp_path / "data"
    prepare_token_shards([write_jsonl(tmp_path / "a.jsonl", TEXTS)], tokenizer_dir, out, workers=1)
    flush = shards.ShardWriter.flush

    def interrupted(self):
        flush(self)
        if len(self.shards) == 2:  # Ctrl-C with two new shards written
            raise KeyboardInterrupt

    monkeypatch.setattr(shards.ShardWriter, "flush", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_token_shards([write_jsonl(tmp_path / "b.jsonl", TEXTS * 3)], tokenizer_dir, out, shard_tokens=100,
                             workers=1)
    assert prepared_documents(out) == len(TEXTS)
    monkeypatch.undo()
    prepare_token_shards([tmp_path / "b.jsonl"], tokenizer_dir, out, shard_tokens=100, workers=1)
    assert prepared_documents(out) == 3 * len(TEXTS)  # replaced once complete
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_prepare_into_its_own_tokenizer_and_stale_folders(tmp_path, tokenizer_dir):
    out = tmp_path / "data"
    documents = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    prepare_token_shards([documents], tokenizer_dir, out, workers=1)
    stale = tmp_path / ".data.partial-999999999"  # from a killed run: no such process
    stale.mkdir()
    prepare_token_shards([documents], out / "tokenizer", out, workers=1)  # its own copy of the tokenizer
    assert prepared_documents(out) == len(TEXTS) and not stale.exists()
    load_token_corpus(DataConfig(source="tokens", path=str(out)))


def test_prepare_never_replaces_a_folder_of_other_files(tmp_path, tokenizer_dir, capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    documents = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    with pytest.raises(DataError, match="holds files that are not prepared data .thesis.tex"):
        prepare_token_shards([documents], tokenizer_dir, home, workers=1)
    assert (home / "thesis.tex").read_text() == "years of work"
    (tmp_path / "file").write_text("x")
    assert "is a file" in refused(["data", "prepare", "--input", str(documents), "--tokenizer", str(tokenizer_dir),
                                   "--out", str(tmp_path / "file")], capsys)


@pytest.mark.parametrize("out", [".", "./", "..", "inner/.."])
def test_prepare_refuses_the_folder_it_runs_in(out, tmp_path, tokenizer_dir, capsys, monkeypatch):
    """`--out .` (or a folder above) said ValueError: PosixPath('.') has an empty name, a traceback;
    replacing the working folder would pull it from under the process and the user's shell."""
    documents = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    working = tmp_path / "empty" / "inner"
    working.mkdir(parents=True)
    monkeypatch.chdir(working)
    line = refused(["data", "prepare", "--input", str(documents), "--tokenizer", str(tokenizer_dir), "--out", out,
                    "--workers", "1"], capsys)
    assert "is the current folder or one above it" in line
    assert working.is_dir() and list(working.iterdir()) == []
    result = prepare_token_shards([documents], tokenizer_dir, "data/../data", workers=1)  # a name once normalised
    assert result.out_dir == working / "data" and prepared_documents(working / "data") == len(TEXTS)


# --------------------------------------------------------------------------------------------
# Tokenizers other than MiniMind's: special tokens from the folder, known names, or the command line


def hf_tokenizer(folder: Path, special: list[str], byte_level: bool = True, files: dict | None = None) -> Path:
    """A small Hugging Face tokenizer.json trained here with these special tokens (no MiniMind names)."""
    import tokenizers

    if byte_level:
        tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False,
                                                 initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    else:  # SentencePiece-like (Llama's): Metaspace pieces, the 256 byte pieces <0xNN> in the vocabulary
        tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=special[0]))
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
        trainer = tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=special, show_progress=False)
    tokenizer.train_from_iterator(TEXTS, trainer=trainer)
    if not byte_level:
        state = json.loads(tokenizer.model.__getstate__())
        vocab = state["vocab"] | {f"<0x{byte:02X}>": len(state["vocab"]) + byte for byte in range(256)}
        merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in state["merges"]]
        tokenizer.model = tokenizers.models.BPE(vocab, merges, unk_token=special[0], byte_fallback=True)
        tokenizer.decoder = tokenizers.decoders.Sequence([tokenizers.decoders.ByteFallback(),
                                                          tokenizers.decoders.Metaspace()])
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    for name, values in (files or {}).items():
        (folder / name).write_text(json.dumps(values))
    return folder


@pytest.mark.parametrize("case", ["gpt2", "named", "config", "sentencepiece"])
def test_tokenizers_without_minimind_tokens(case, tmp_path, capsys):
    tokenizer_dir = {
        "gpt2": lambda: hf_tokenizer(tmp_path / "tok", ["<|endoftext|>"]),
        "named": lambda: hf_tokenizer(tmp_path / "tok", ["<pad>", "<s>", "</s>"]),
        "config": lambda: hf_tokenizer(tmp_path / "tok", ["[P]", "[B]", "[E]"], files={"tokenizer_config.json": {
            "bos_token": {"content": "[B]"}, "eos_token": "[E]", "pad_token": "[P]"}}),
        "sentencepiece": lambda: hf_tokenizer(tmp_path / "tok", ["<unk>", "<s>", "</s>"], byte_level=False),
    }[case]()
    tokenizer = Tokenizer(tokenizer_dir)
    expected = {"gpt2": ("<|endoftext|>",) * 3, "named": ("<pad>", "<s>", "</s>"), "config": ("[P]", "[B]", "[E]"),
                "sentencepiece": ("</s>", "<s>", "</s>")}[case]
    assert tuple(tokenizer.special_tokens[role] for role in ("pad", "bos", "eos")) == expected
    documents = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    assert main(["data", "prepare", "--input", str(documents), "--tokenizer", str(tokenizer_dir), "--out",
                 str(tmp_path / "data"), "--workers", "1"]) == 0
    corpus = load_token_corpus(DataConfig(source="tokens", path=str(tmp_path / "data")))
    assert corpus.train.eos_id == tokenizer.eos_id and corpus.tokenizer.special_tokens == tokenizer.special_tokens
    text = "hello world, héllo"
    assert corpus.decode(corpus.encode(text)[1:]).strip() == text  # BOS first, then the text
    assert corpus.train.token_bytes[tokenizer.eos_id] == 0 and corpus.train.token_bytes.sum() > 0


def test_a_tokenizer_without_an_end_token_is_told_how_to_name_one(tmp_path, capsys):
    tokenizer_dir = hf_tokenizer(tmp_path / "tok", ["[X]", "[Y]"])
    documents = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    base = ["data", "prepare", "--input", str(documents), "--tokenizer", str(tokenizer_dir), "--out",
            str(tmp_path / "data"), "--workers", "1"]
    assert "name it with --eos-token TOKEN" in refused(base, capsys)
    assert "the eos token '[Z]' is not in its vocabulary" in refused([*base, "--eos-token", "[Z]"], capsys)
    assert main([*base, "--eos-token", "[Y]", "--pad-token", "[X]"]) == 0
    corpus = load_token_corpus(DataConfig(source="tokens", path=str(tmp_path / "data")))  # the copy remembers them
    assert corpus.tokenizer.special_tokens == {"pad": "[X]", "bos": "[Y]", "eos": "[Y]"}


def test_bad_tokenizer_inputs_one_line(tokenizer_dir, tmp_path, capsys):
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "tokenizer.json").write_text("{not a tokenizer")
    (tmp_path / "empty.txt").write_text("")
    cases = [
        (["tokenizer", "decode", "--tokenizer", str(tokenizer_dir), "5", "300"], "token id 300 is not in the vocab"),
        (["tokenizer", "encode", "--tokenizer", str(tmp_path / "garbage"), "hi"], "not a tokenizer the tokenizers"),
        (["tokenizer", "encode", "--tokenizer", str(tmp_path), "hi"], "no tokenizer.json in"),
        (["tokenizer", "train", "--input", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "t")], "no documents"),
        (["tokenizer", "train", "--input", str(tmp_path), "--out", str(tmp_path / "t")], "is not a regular file"),
        (["tokenizer", "train", "--input", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "empty.txt")],
         "is a file, not a folder"),
    ]
    for argv, message in cases:
        assert message in refused(argv, capsys), argv


# --------------------------------------------------------------------------------------------
# Bad safetensors headers in `import-hf`: one line naming the file


def safetensors_file(header: object, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


TENSOR = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
HEADERS = {
    "shorter than 8 bytes": b"\x01\x02",
    "header longer than the file": safetensors_file({}, length=10**6),
    "header length absurd": safetensors_file({}, length=2**63),
    "header not JSON": safetensors_file(b"{not json"),
    "header not UTF-8": safetensors_file(b'{"\xff": 1}'),
    "header an array": safetensors_file([1, 2]),
    "deeply nested header": safetensors_file(b"[" * 100_000 + b"]" * 100_000),
    "unknown dtype": safetensors_file({"w": {**TENSOR, "dtype": "F99"}}, bytes(16)),
    "negative shape": safetensors_file({"w": {**TENSOR, "shape": [-2, -2]}}, bytes(16)),
    "shape and bytes disagree": safetensors_file({"w": {**TENSOR, "shape": [3, 3]}}, bytes(16)),
    "offsets past the data": safetensors_file({"w": {**TENSOR, "data_offsets": [0, 16]}}, bytes(8)),
    "offsets reversed": safetensors_file({"w": {**TENSOR, "data_offsets": [16, 0]}}, bytes(16)),
    "overlapping tensors": safetensors_file({"a": TENSOR, "b": TENSOR}, bytes(16)),
    "a hole in the data": safetensors_file({"w": {**TENSOR, "data_offsets": [16, 32]}}, bytes(32)),
    "metadata not strings": safetensors_file({"__metadata__": {"a": 1}, "w": TENSOR}, bytes(16)),
}


def llama_folder(tmp_path: Path) -> Path:
    """A folder with a small Llama config.json and no weights yet."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "intermediate_size": 32}))
    return folder


@pytest.mark.parametrize("name", list(HEADERS))
def test_bad_safetensors_header(name, tmp_path, capsys):
    folder = llama_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(HEADERS[name])
    line = refused(["import-hf", str(folder), "--out", str(tmp_path / "run")], capsys)
    assert f"{folder / 'model.safetensors'} is not a valid safetensors file" in line


INDEXES = {
    "not JSON": b"{not json",
    "no weight_map": json.dumps({"metadata": {}}).encode(),
    "weight_map a list": json.dumps({"weight_map": ["a"]}).encode(),
    "a shard outside the folder": json.dumps({"weight_map": {"w": "../model.safetensors"}}).encode(),
}


@pytest.mark.parametrize("name", list(INDEXES))
def test_damaged_sharded_index(name, tmp_path, capsys):
    folder = llama_folder(tmp_path)
    (folder / "model.safetensors.index.json").write_bytes(INDEXES[name])
    line = refused(["import-hf", str(folder), "--out", str(tmp_path / "run")], capsys)
    assert str(folder / "model.safetensors.index.json") in line


def test_valid_safetensors_pass_the_header_check(tmp_path):
    from safetensors.torch import save_file

    from attnlab.safetensors_file import load_file, read_header

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.zeros(0, 4)}
    save_file(tensors, str(tmp_path / "w.safetensors"), metadata={"format": "pt"})
    assert set(read_header(tmp_path / "w.safetensors")) == {"a", "b", "c", "__metadata__"}
    loaded = load_file(tmp_path / "w.safetensors")
    assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)
    with pytest.raises(ConversionError, match="does not exist"):
        read_header(tmp_path / "nosuch.safetensors")


# --------------------------------------------------------------------------------------------
# Progress bars: data preparation, tokenizer training, evaluation, the bench suite


def test_progress_bars(tmp_path, tokenizer_dir, prepared, capsys, monkeypatch):
    documents = write_jsonl(tmp_path / "a.jsonl", TEXTS)
    capsys.readouterr()
    prepare_token_shards([documents], tokenizer_dir, tmp_path / "data", workers=1, progress=True)
    assert "tokenizing: 100%" in capsys.readouterr().err
    train_tokenizer([documents], 280, tmp_path / "tok", progress=True)
    error = capsys.readouterr().err
    assert "reading documents: " in error and "60 documents" in error

    from attnlab.config import ModelConfig
    from attnlab.evaluate import evaluate
    from attnlab.model import Transformer

    corpus = load_token_corpus(DataConfig(source="tokens", path=str(prepared)))
    model = Transformer(ModelConfig(num_tokens=300, dim=16, depth=1, heads=2, dim_head=8, max_seq_len=32))
    evaluate(model, corpus.val, 16, n_windows=6, batch_size=4, progress=True)
    assert "evaluating: 100%" in capsys.readouterr().err

    import attnlab.bench.suite as suite

    monkeypatch.setattr(suite, "run_isolated", lambda task, arguments, threads: {"kind": task, "attention": "full"})
    monkeypatch.setattr(suite, "write_report", lambda *args: None)
    plan = suite.SuitePlan(attention=["full", "local"], lengths=[8], contexts=[8])
    assert len(suite.run_suite(plan, tmp_path / "bench", "attnlab bench suite", progress=True)) == 6
    assert "bench suite: 100%" in capsys.readouterr().err
