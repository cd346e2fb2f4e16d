"""Byte corpora: the built-in corpus, any text/.gz/.zip/raw file, and enwik8 (data.source builtin,
file, enwik8; data/corpus.py picks the source).

Every corpus is a pair of uint8 arrays (train, validation) whose values are the tokens 0..255.

The built-in corpus needs no download: the `.py` sources of the running interpreter's standard
library (site-packages excluded), concatenated in sorted path order. It is the same bytes for the
same Python version; its sha256 is recorded in `meta.json` beside the prepared files.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import platform
import re
import sysconfig
import urllib.error
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attnlab.config import DataConfig
from attnlab.data.files import cache_dir, default_cache_dir, read_meta_fields, sha256_of, stdlib_sources, write_atomic
from attnlab.errors import DataError

log = logging.getLogger(__name__)

ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
# sha256 of enwik8.zip (36,445,475 bytes) as published with the archive and pinned by many projects
ENWIK8_SHA256 = "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc"
ENWIK8_BYTES = 100_000_000  # the unzipped file
# the built-in corpus's meta.json: each field and its type
BUILTIN_META_FIELDS = {
    "python": str, "n_files": int, "total_bytes": int, "train_bytes": int, "val_bytes": int,
    "val_fraction": (int, float), "sha256": str,
}


@dataclass
class ByteCorpus:
    """A byte corpus as the Corpus interface (data/corpus.py) serves it: the tokens are the bytes."""

    train: np.ndarray  # uint8, possibly memory-mapped
    val: np.ndarray
    description: str

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return byte_prompt(text)

    def decode(self, tokens) -> str:
        return decode_bytes(tokens)


def encode_text(text: str) -> list[int]:
    """The text's UTF-8 bytes; a command line's bytes that are not UTF-8 (surrogate-escaped) as they were."""
    return list(text.encode("utf-8", "surrogateescape"))


def byte_prompt(text: str) -> list[int]:
    """Prompt ids for generation from a byte-level model: the text's bytes (a newline if the text is
    empty: generation needs one token to start from)."""
    return encode_text(text) or [ord("\n")]


REPLACEMENT = "\ufffd".encode()  # the bytes of U+FFFD, the character shown for what stands for no text


def byte_model_bytes(token_ids: list[int]) -> bytes:
    """The bytes a byte-level model's tokens stand for: each id its byte. An id past 255 stands for
    none (a vocabulary larger than the bytes, model.num_tokens > 256, can still draw one) and comes
    out as U+FFFD, as a byte that is not UTF-8 does."""
    return b"".join(bytes([token]) if token < 256 else REPLACEMENT for token in token_ids)


def decode_bytes(tokens) -> str:
    """A byte-level model's tokens as text: bytes that are not UTF-8, and ids past 255, as U+FFFD."""
    return byte_model_bytes([int(token) for token in tokens]).decode("utf-8", errors="replace")


def prepare_builtin(cache_dir: Path | None = None, val_fraction: float = 0.05) -> Path:
    """Build the built-in corpus once; return its folder (train.bin, val.bin, meta.json)."""
    folder = (cache_dir or default_cache_dir()) / f"builtin-py{platform.python_version()}"
    meta_path = folder / "meta.json"
    if meta_path.is_file() and (folder / "train.bin").is_file() and (folder / "val.bin").is_file():
        try:
            meta = builtin_meta(folder)
        except DataError as error:  # a cache: built again from the standard library, as a token cache is
            log.warning("%s; building the built-in corpus again", error)
            meta = {}
        sizes_match = (folder / "train.bin").stat().st_size == meta.get("train_bytes") and (
            folder / "val.bin"
        ).stat().st_size == meta.get("val_bytes")
        if sizes_match and meta.get("val_fraction") == val_fraction:
            return folder
    files = stdlib_sources()
    if not files:
        raise DataError(f"no standard-library sources found under {sysconfig.get_paths()['stdlib']}")
    corpus = b"".join(path.read_bytes() for path in files)
    n_val = int(len(corpus) * val_fraction)
    write_atomic(folder / "train.bin", corpus[: len(corpus) - n_val])
    write_atomic(folder / "val.bin", corpus[len(corpus) - n_val :])
    meta = {
        "python": platform.python_version(),
        "n_files": len(files),
        "total_bytes": len(corpus),
        "train_bytes": len(corpus) - n_val,
        "val_bytes": n_val,
        "val_fraction": val_fraction,
        "sha256": hashlib.sha256(corpus).hexdigest(),
    }
    write_atomic(meta_path, (json.dumps(meta, indent=2) + "\n").encode())  # written last: marks completion
    log.info("built-in corpus: %d files, %d bytes -> %s", len(files), len(corpus), folder)
    return folder


def builtin_meta(folder: Path) -> dict:
    """The prepared built-in corpus's meta.json, checked (a DataError naming it if damaged)."""
    return read_meta_fields(folder / "meta.json", BUILTIN_META_FIELDS)


def read_bytes(path: Path) -> bytes:
    """A file's bytes: gzip and zip archives are unpacked (zip members concatenated by name)."""
    path = Path(path)
    if not path.is_file():
        kind = "is a folder, not a file" if path.is_dir() else "is not a regular file" if path.exists() \
            else "does not exist"
        raise DataError(f"data file {path} {kind}")
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as handle:
                data = handle.read()
        elif path.suffix == ".zip":
            with zipfile.ZipFile(path) as archive:
                names = sorted(name for name in archive.namelist() if not name.endswith("/"))
                data = b"".join(archive.read(name) for name in names)
        else:
            data = path.read_bytes()
    except (OSError, zipfile.BadZipFile, EOFError, zlib.error) as error:  # a damaged archive: gzip raises all four
        raise DataError(f"cannot read data file {path}: {error or type(error).__name__}") from error
    if not data:
        raise DataError(f"data file {path} is empty")
    return data


def split_bytes(data: bytes, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    array = np.frombuffer(data, dtype=np.uint8)
    n_val = max(1, int(len(array) * val_fraction))
    return array[: len(array) - n_val], array[len(array) - n_val :]


def load_byte_corpus(config: DataConfig) -> ByteCorpus:
    """The byte corpus of data.source builtin, file or enwik8 (data/corpus.py picks the source)."""
    cache = cache_dir(config)
    if config.source == "builtin":
        folder = prepare_builtin(cache, config.val_fraction)
        meta = builtin_meta(folder)
        return ByteCorpus(
            train=np.memmap(folder / "train.bin", dtype=np.uint8, mode="r"),
            val=np.memmap(folder / "val.bin", dtype=np.uint8, mode="r"),
            description=f"built-in corpus (Python {meta['python']} standard library, {meta['total_bytes']:,} bytes)",
        )
    if config.source == "file":
        if not config.path:
            raise DataError("data.source=file needs data.path=FILE")
        train, val = split_bytes(read_bytes(Path(config.path)), config.val_fraction)
        return ByteCorpus(train=train, val=val, description=f"{config.path} ({len(train) + len(val):,} bytes)")
    # enwik8 exactly as the seeds use it: the first train + val bytes, train first
    path = Path(config.path) if config.path else cache / "enwik8" / "enwik8.zip"
    if not path.is_file():
        raise DataError(f"enwik8 not found at {path}: run `attnlab data download enwik8` or set data.path")
    data = read_bytes(path)
    needed = config.enwik8_train_bytes + config.enwik8_val_bytes
    if len(data) < needed:
        raise DataError(f"{path} has {len(data):,} bytes; the enwik8 split needs {needed:,}")
    array = np.frombuffer(data, dtype=np.uint8)
    return ByteCorpus(
        train=array[: config.enwik8_train_bytes],
        val=array[config.enwik8_train_bytes : needed],
        description=f"enwik8 ({config.enwik8_train_bytes:,} train / {config.enwik8_val_bytes:,} validation bytes)",
    )


def download_enwik8(
    dest_dir: Path | None = None, url: str = ENWIK8_URL, sha256: str | None = ENWIK8_SHA256
) -> Path:
    """Fetch enwik8.zip into dest_dir (default: the cache), verify its checksum, return its path.

    The archive is downloaded to a temporary file and renamed only after the checksum matches, so a
    failed or tampered download leaves nothing behind.
    """
    if sha256 is not None:  # hex digits in either case, as checksums are published
        sha256 = sha256.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise DataError(f"a sha256 checksum is 64 hexadecimal digits; got {sha256!r}")
    folder = Path(dest_dir) if dest_dir else default_cache_dir() / "enwik8"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "enwik8.zip"
    if target.is_file() and (sha256 is None or sha256_of(target) == sha256):
        return target
    temporary = folder / f".enwik8.zip.download-{os.getpid()}"
    try:
        try:
            with urllib.request.urlopen(url, timeout=60) as response, open(temporary, "wb") as handle:
                for block in iter(lambda: response.read(1 << 20), b""):
                    handle.write(block)
        except (urllib.error.URLError, OSError) as error:
            raise DataError(f"cannot download {url}: {error}") from error
        if sha256 is not None:
            actual = sha256_of(temporary)
            if actual != sha256:
                raise DataError(f"checksum mismatch for {url}: expected {sha256}, got {actual}")
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    log.info("downloaded %s -> %s", url, target)
    return target
