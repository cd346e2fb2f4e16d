"""Files the data pipeline writes and reads: atomic writes, content hashes, the cache directory, and
the standard library's sources (the input of both built-in corpora).

This module imports no other module of `attnlab.data`: every corpus builds on it, so it is the leaf
that keeps the package's import graph free of cycles (tests/test_data.py checks the graph).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path
from typing import Any

from attnlab.config import DataConfig
from attnlab.errors import DataError

EXCLUDED_FOLDERS = {"site-packages", "dist-packages", "__pycache__"}


def default_cache_dir() -> Path:
    return Path(os.environ.get("ATTNLAB_CACHE") or Path.home() / ".cache" / "attnlab")


def cache_dir(config: DataConfig) -> Path:
    """Where a run's prepared corpora live: data.cache_dir, else the default cache."""
    return Path(config.cache_dir) if config.cache_dir else default_cache_dir()


def staging_file(path: Path) -> tuple[Path, int]:
    """A new file to stage `path`'s next content in: (its path, a descriptor open for writing). Its
    name, `.NAME.tmp-PID` beside `path`, is the one a run's start clears when a killed write left it
    (train/timeline.py). It is made as open() makes a file, mode 0o666 less the umask, so what is
    renamed over `path` is as readable to others as a file written in place (a private staging
    file would keep its mode: an export or a run's config shared with others, unreadable to them)."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.unlink(missing_ok=True)  # a killed write's, by an earlier process of this number
    return temporary, os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a staging file beside `path`, fsync it and rename it: readers see the old file or
    the whole new one, never a part, and a write that fails leaves the old one alone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary, descriptor = staging_file(path)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)  # a write that failed leaves nothing beside the file


def copy_atomic(source: Path, target: Path) -> None:
    """Copy a (small) file as write_atomic writes: `target` is the old file or the whole copy."""
    write_atomic(Path(target), Path(source).read_bytes())


def read_meta_fields(path: Path, fields: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """A prepared corpus's meta.json, checked: a JSON object holding each of `fields` with a value of
    its type (a bool is no count). A DataError naming the file and what is wrong, if not."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:  # not JSON, or not UTF-8 (UnicodeDecodeError is a ValueError)
        raise DataError(f"{path} is damaged (not valid JSON: {error})") from error
    if not isinstance(meta, dict):
        raise DataError(f"{path} is damaged (not a JSON object)")
    for key, kind in fields.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            problem = "missing" if key not in meta else f"a {type(value).__name__}, not the expected type"
            raise DataError(f"{path} is damaged ({key!r} is {problem})")
    return meta


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, sorted by their path relative to the library root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path for path in root.rglob("*.py")
        if path.is_file() and not EXCLUDED_FOLDERS.intersection(path.relative_to(root).parts)
    ]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())
