"""Byte corpora and the window sampler."""

from __future__ import annotations

import ast
import gzip
import hashlib
import http.server
import json
import os
import shutil
import threading
import zipfile
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.cli.main import main
from attnlab.config import DataConfig
from attnlab.data.byte_corpus import download_enwik8, prepare_builtin
from attnlab.data.corpus import load_corpus
from attnlab.data.files import stdlib_sources, write_atomic
from attnlab.data.sampler import Batch, RandomWindowSampler, eval_windows, randomly_truncate
from attnlab.errors import DataError

CONTENT = bytes(range(256)) * 40 + "héllo wörld\n".encode() * 50


@pytest.fixture(scope="module")
def builtin(tmp_path_factory) -> Path:
    return prepare_builtin(tmp_path_factory.mktemp("cache-a"))


def test_builtin_corpus_is_deterministic_and_complete(builtin, tmp_path):
    meta = json.loads((builtin / "meta.json").read_text())
    train, val = (builtin / "train.bin").read_bytes(), (builtin / "val.bin").read_bytes()
    assert hashlib.sha256(train + val).hexdigest() == meta["sha256"]
    assert len(val) == int(meta["total_bytes"] * 0.05) and meta["n_files"] > 500
    again = prepare_builtin(tmp_path)  # a second, independent build gives the same bytes
    assert json.loads((again / "meta.json").read_text())["sha256"] == meta["sha256"]
    files = stdlib_sources()
    assert not any("site-packages" in path.parts or "dist-packages" in path.parts for path in files)
    assert sum(path.stat().st_size for path in files) == meta["total_bytes"]


def test_builtin_reused_not_rebuilt(builtin):
    stamp = (builtin / "train.bin").stat().st_mtime_ns
    prepare_builtin(builtin.parent)
    assert (builtin / "train.bin").stat().st_mtime_ns == stamp


def test_load_builtin(builtin):
    corpus = load_corpus(DataConfig(source="builtin", cache_dir=str(builtin.parent)))
    assert corpus.train.dtype == np.uint8 and len(corpus.val) > 100_000
    assert b"def " in bytes(corpus.train[:100_000])


@pytest.mark.parametrize("damage", [
    lambda text: text[:40],  # truncated
    lambda text: text.replace('"python": "', '"python": 3, "x": "'),  # a field of the wrong type
    lambda text: "[1]",  # not an object
])
def test_a_damaged_builtin_meta_is_named_and_the_corpus_built_again(builtin, tmp_path, caplog, damage):
    folder = tmp_path / builtin.name
    shutil.copytree(builtin, folder)
    meta = folder / "meta.json"
    meta.write_text(damage(meta.read_text()))
    corpus = load_corpus(DataConfig(source="builtin", cache_dir=str(tmp_path)))
    assert f"{meta} is damaged" in caplog.text and "building the built-in corpus again" in caplog.text
    assert json.loads(meta.read_text()) == json.loads((builtin / "meta.json").read_text())
    assert len(corpus.train) == (builtin / "train.bin").stat().st_size


def test_a_damaged_builtin_jsonl_meta_is_named_and_the_corpus_built_again(tmp_path, caplog, monkeypatch):
    from attnlab.data import pretrain

    monkeypatch.setattr(pretrain, "stdlib_documents", lambda: ["one document", "another"])
    config = DataConfig(cache_dir=str(tmp_path))
    path = pretrain.write_builtin_jsonl(config)
    meta = path.with_name("documents.meta.json")
    meta.write_text(meta.read_text()[:20])
    assert pretrain.write_builtin_jsonl(config) == path
    assert f"{meta} is damaged" in caplog.text and json.loads(meta.read_text())["bytes"] == path.stat().st_size


@pytest.mark.parametrize("kind", ["txt", "gz", "zip", "raw"])
def test_file_formats_give_the_same_bytes(tmp_path, kind):
    path = tmp_path / {"txt": "a.txt", "gz": "a.txt.gz", "zip": "a.zip", "raw": "a.bin"}[kind]
    if kind == "gz":
        path.write_bytes(gzip.compress(CONTENT))
    elif kind == "zip":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("part-b", CONTENT[5000:])
            archive.writestr("part-a", CONTENT[:5000])
    else:
        path.write_bytes(CONTENT)
    corpus = load_corpus(DataConfig(source="file", path=str(path), val_fraction=0.1))
    assert bytes(corpus.train) + bytes(corpus.val) == CONTENT
    assert len(corpus.val) == int(len(CONTENT) * 0.1)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="nothere.txt does not exist"):
        load_corpus(DataConfig(source="file", path=str(tmp_path / "nothere.txt")))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty.txt is empty"):
        load_corpus(DataConfig(source="file", path=str(tmp_path / "empty.txt")))


def make_enwik8_zip(path: Path, size: int = 3000) -> bytes:
    content = (b"<page>wiki text</page>\n" * (size // 23 + 1))[:size]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("enwik8", content)
    return content


def test_enwik8_split_exact(tmp_path):
    content = make_enwik8_zip(tmp_path / "enwik8.zip")
    config = DataConfig(source="enwik8", path=str(tmp_path / "enwik8.zip"), enwik8_train_bytes=2000,
                        enwik8_val_bytes=500)
    corpus = load_corpus(config)
    assert bytes(corpus.train) == content[:2000] and bytes(corpus.val) == content[2000:2500]
    with pytest.raises(DataError, match="has 3,000 bytes; the enwik8 split needs 95,000,000"):
        load_corpus(DataConfig(source="enwik8", path=str(tmp_path / "enwik8.zip")))


@pytest.fixture
def served(tmp_path):
    """A small enwik8.zip served over HTTP on 127.0.0.1 (an ephemeral port)."""
    root = tmp_path / "site"
    root.mkdir()
    make_enwik8_zip(root / "enwik8.zip")
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/enwik8.zip", root / "enwik8.zip"
    server.shutdown()


def test_download_verifies_checksum(served, tmp_path):
    url, source = served
    checksum = hashlib.sha256(source.read_bytes()).hexdigest()
    path = download_enwik8(tmp_path / "dest", url=url, sha256=checksum)
    assert path.read_bytes() == source.read_bytes()
    with pytest.raises(DataError, match="checksum mismatch"):
        download_enwik8(tmp_path / "bad", url=url, sha256="0" * 64)
    assert list((tmp_path / "bad").iterdir()) == []  # nothing left behind


def test_download_takes_a_checksum_in_either_case(served, tmp_path, monkeypatch):
    """A checksum pasted in capitals is the same checksum: the archive is kept, not fetched again and
    refused; one that is no sha256 at all is one line before anything is fetched."""
    url, source = served
    checksum = hashlib.sha256(source.read_bytes()).hexdigest().upper()
    path = download_enwik8(tmp_path / "dest", url=url, sha256=checksum)
    monkeypatch.setattr("urllib.request.urlopen", lambda *arguments, **keywords: pytest.fail("fetched again"))
    assert download_enwik8(tmp_path / "dest", url=url, sha256=f" {checksum} ") == path
    with pytest.raises(DataError, match="64 hexadecimal digits"):
        download_enwik8(tmp_path / "other", url=url, sha256="abc")


def test_download_file_url_and_cli(served, tmp_path, capsys):
    _, source = served
    checksum = hashlib.sha256(source.read_bytes()).hexdigest()
    dest = tmp_path / "dest"
    assert main(["data", "download", "enwik8", "--dest", str(dest), "--url", source.as_uri(),
                 "--sha256", checksum]) == 0
    assert (dest / "enwik8.zip").read_bytes() == source.read_bytes()
    assert main(["data", "download", "enwik8", "--dest", str(tmp_path / "x"), "--url",
                 (tmp_path / "missing.zip").as_uri()]) == 2
    assert "cannot download" in capsys.readouterr().err


def test_cli_prepare_builtin(builtin, capsys):
    assert main(["data", "prepare", "builtin", "--cache-dir", str(builtin.parent)]) == 0
    assert "sha256" in capsys.readouterr().out


def test_sampler_resume_and_ranks():
    data = np.arange(10_000) % 256
    whole = RandomWindowSampler(len(data), 16, 4, seed=3)
    batches = [whole.next_batch(data).tokens for _ in range(6)]
    resumed = RandomWindowSampler(len(data), 16, 4, seed=3)
    [resumed.next_batch(data) for _ in range(3)]
    state = resumed.state_dict()
    fresh = RandomWindowSampler(len(data), 16, 4, seed=3)
    fresh.load_state_dict(state)
    for expected in batches[3:]:
        assert np.array_equal(fresh.next_batch(data).tokens.numpy(), expected.numpy())
    ranks = [RandomWindowSampler(len(data), 16, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    assert np.array_equal(np.concatenate([r.starts(0) for r in ranks]), whole.starts(0))
    assert batches[0].shape == (4, 17) and int(batches[0].max()) < 256
    window = batches[0][0].numpy()
    assert np.array_equal(np.diff(window) % 256, np.ones(16))  # contiguous windows


def test_sampler_rejects_mismatched_state_and_short_data():
    sampler = RandomWindowSampler(1000, 16, 4, seed=3)
    with pytest.raises(DataError, match="batch_size=8"):
        sampler.load_state_dict({**sampler.state_dict(), "batch_size": 8})
    with pytest.raises(DataError, match="at least 18"):
        RandomWindowSampler(10, 16, 4, seed=0)


def test_a_resume_over_other_data_says_its_batches_differ(caplog):
    """Data prepared again (grown, split otherwise, another layout) may be a choice: the resume goes
    on, saying its batches are no longer an uninterrupted run's (it went on silently)."""
    from attnlab.data.pretrain import PaddedDocumentSampler

    state = RandomWindowSampler(1000, 16, 4, seed=3).state_dict()
    RandomWindowSampler(1000, 16, 4, seed=3).load_state_dict(state)
    legacy = {key: value for key, value in state.items() if key != "split"}  # a checkpoint of before
    RandomWindowSampler(1200, 16, 4, seed=3).load_state_dict(legacy)
    assert caplog.text == ""
    caplog.set_level("WARNING", logger="attnlab.data.sampler")
    RandomWindowSampler(1200, 16, 4, seed=3).load_state_dict(state)
    assert "the training split has 1200 tokens where the checkpoint's had 1000 tokens" in caplog.text
    caplog.clear()
    PaddedDocumentSampler(1000, 16, 4, seed=3).load_state_dict(state)
    assert "1000 documents where the checkpoint's had 1000 tokens" in caplog.text
    caplog.clear()  # a distributed run says it once, by rank 0 (each rank said it)
    state = RandomWindowSampler(1000, 16, 4, seed=3, world_size=2).state_dict()
    for rank in (0, 1):
        RandomWindowSampler(1200, 16, 4, seed=3, rank=rank, world_size=2).load_state_dict(state)
    assert caplog.text.count("the training split has 1200 tokens") == 1


def test_a_byte_model_s_ids_past_the_bytes_decode_as_the_replacement_character():
    """Training's samples of a byte model with model.num_tokens > 256 (decode_bytes) show an id past
    255 as U+FFFD, as `sample` does (bytes() refused it: a ValueError traceback at the first sample)."""
    from attnlab.data.byte_corpus import decode_bytes

    assert decode_bytes([104, 105, 299, 0xC3, 0xA9, 0xFF]) == "hi\ufffd\u00e9\ufffd"


def test_short_splits_are_named():
    """A packed token corpus can hold a long training split and a validation split of a few tokens:
    the error said "data has 6 tokens", which the user's 3,000-token data contradicts."""
    with pytest.raises(DataError, match="the training split has 10 tokens"):
        RandomWindowSampler(10, 16, 4, seed=0)
    with pytest.raises(DataError, match="the validation split has 6 tokens.*data.val_fraction"):
        eval_windows(np.arange(6), 64, 2)


def test_eval_windows_deterministic():
    data = np.arange(5000) % 256
    assert np.array_equal(eval_windows(data, 32, 5).numpy(), eval_windows(data, 32, 5).numpy())


def test_random_truncation_is_seeded_and_occasional():
    batch = Batch(tokens=torch.arange(2 * 33).reshape(2, 33))
    lengths = [randomly_truncate(batch, seed=0, index=i).tokens.shape[1] for i in range(400)]
    assert lengths == [randomly_truncate(batch, seed=0, index=i).tokens.shape[1] for i in range(400)]
    truncated = [n for n in lengths if n < 33]
    assert 15 <= len(truncated) <= 70 and min(truncated) >= 2  # about 10% of batches, never empty
    cut = next(randomly_truncate(batch, 0, i) for i in range(400) if lengths[i] < 33)
    assert torch.equal(cut.tokens, batch.tokens[:, : cut.tokens.shape[1]])  # a prefix of every row


# --------------------------------------------------------------------------------------------
# The package's import graph


def data_imports(folder: Path) -> dict[str, set[str]]:
    """{module: the attnlab.data modules it imports}, for every module in `folder` (attnlab/data),
    counting every import statement: at the top, inside functions (lazy) and under TYPE_CHECKING."""
    graph: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        name = "attnlab.data" if path.stem == "__init__" else f"attnlab.data.{path.stem}"
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from .x import y
                    base = ".".join(["attnlab", "data"][: 3 - node.level] + ([base] if base else []))
                imported |= {base} | {f"{base}.{alias.name}" for alias in node.names}
        graph[name] = {module for module in imported if module.startswith("attnlab.data.")} - {name}
    return {name: {module for module in imported if module in graph} for name, imported in graph.items()}


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the search path, "done" after

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state and (cycle := visit(imported, [*path, imported])):
                return cycle
        state[module] = "done"
        return None

    return next((cycle for module in sorted(graph) if module not in state and (cycle := visit(module, [module]))),
                None)


DATA_FOLDER = Path(__file__).resolve().parent.parent / "src" / "attnlab" / "data"


def test_data_package_has_no_import_cycle():
    graph = data_imports(DATA_FOLDER)
    assert {"attnlab.data.files", "attnlab.data.corpus", "attnlab.data.pretrain"} <= set(graph)
    assert graph["attnlab.data.files"] == set()  # the leaf every corpus builds on
    assert import_cycle(graph) is None, " -> ".join(import_cycle(graph))


def test_import_cycle_check_sees_lazy_imports(tmp_path):
    """The check fails on the old circle: byte corpora importing the token corpus inside a function,
    the token corpus importing them back."""
    folder = tmp_path / "data"
    shutil.copytree(DATA_FOLDER, folder)
    source = (folder / "byte_corpus.py").read_text()
    lazy = "\n\ndef load_tokens(config):\n    from attnlab.data.pretrain import load_token_corpus\n\n" \
           "    return load_token_corpus(config)\n"
    (folder / "byte_corpus.py").write_text(source + lazy)
    (folder / "pretrain.py").write_text("from attnlab.data.byte_corpus import encode_text\n"
                                        + (folder / "pretrain.py").read_text())
    cycle = import_cycle(data_imports(folder))
    assert cycle is not None and {"attnlab.data.byte_corpus", "attnlab.data.pretrain"} <= set(cycle)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_file_written_atomically_has_the_mode_of_one_written_in_place(tmp_path, umask):
    """write_atomic's file (a run's config.yaml, an export's config.json, a tokenizer copy) is as
    readable to others as open() would make it: the umask decides, not a private temporary file."""
    previous = os.umask(umask)
    try:
        write_atomic(tmp_path / "config.yaml", b"model: {}\n")
        (tmp_path / "in_place.yaml").write_bytes(b"model: {}\n")
    finally:
        os.umask(previous)
    mode_of = {path.name: path.stat().st_mode & 0o777 for path in tmp_path.iterdir()}
    assert mode_of == {"config.yaml": 0o666 & ~umask, "in_place.yaml": 0o666 & ~umask}
    assert (tmp_path / "config.yaml").read_bytes() == b"model: {}\n"
