"""Content checksums (SHA-256) on everything attnlab writes that holds weights, checked on every read.

    single-file checkpoint   the key "checksum": the digest of the rest of its content (every tensor's
                             dtype, shape and bytes, every other value), train/checkpoint.py
    engine checkpoint folder `checksums.sha256` beside the shards (FSDP's DCP files, DeepSpeed's),
                             one `sha256sum` line per file: `sha256sum -c checksums.sha256` checks it too
    exported safetensors     the header's metadata "attnlab_sha256": the digest of its tensors (hf.py)

A mismatch is a CheckpointError naming the file. A flipped bit anywhere in the content changes the
digest; one in a file's framing (zip or safetensors headers) makes it unreadable, which is reported
the same way.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.data.files import staging_file
from attnlab.errors import CheckpointError

MANIFEST = "checksums.sha256"
SAFETENSORS_KEY = "attnlab_sha256"
_BLOCK = 1 << 22


def content_digest(value: Any) -> str:
    """SHA-256 of nested dicts, lists, tensors and plain values, in their order (the order pickle
    keeps): two states with the same content have the same digest."""
    digest = hashlib.sha256()
    _feed(digest, value)
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"tensor {tensor.dtype} {tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, dict):
        digest.update(f"dict {len(value)};".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):
        digest.update(f"list {len(value)};".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(f"{type(value).__name__} {value!r};".encode())


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def folder_files(folder: Path) -> list[Path]:
    """The files of an engine checkpoint folder that its manifest covers, in a fixed order."""
    return sorted(path for path in Path(folder).rglob("*") if path.is_file() and path.name != MANIFEST)


def write_manifest(folder: Path, digests: dict[str, str]) -> None:
    """`checksums.sha256` (relative path -> digest), written atomically."""
    folder = Path(folder)
    temporary = folder / f".{MANIFEST}.tmp-{os.getpid()}"
    temporary.write_text("".join(f"{digests[name]}  {name}\n" for name in sorted(digests)))
    os.replace(temporary, folder / MANIFEST)


def verify_manifest(folder: Path, required: bool = True) -> None:
    """Check every file `checksums.sha256` lists; CheckpointError naming the first that is missing
    or differs. Without a manifest: an error when `required`, else nothing to check (a folder
    written before checksums)."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        if required:
            raise CheckpointError(f"checkpoint folder {folder} has no {MANIFEST}: incomplete or damaged")
        return
    for line in manifest.read_text().splitlines():
        expected, _, name = line.partition("  ")
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        if file_sha256(path) != expected:
            raise CheckpointError(f"checkpoint file {path} is corrupt: its content does not match {manifest}")


def safetensors_metadata(tensors: dict[str, Tensor]) -> dict[str, str]:
    """The metadata entry that carries the checksum of a safetensors file's tensors."""
    return {SAFETENSORS_KEY: content_digest({name: tensors[name] for name in sorted(tensors)})}


def save_safetensors(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of `tensors` (contiguous, sharing no memory) with `metadata` and their
    checksum (read back by load_safetensors), written whole or not at all: staged beside `path` under
    the name a killed write's leftovers have (removed at a run's next start, train/timeline.py),
    synced, then renamed. A failed or interrupted write (a full disk, Ctrl-C) leaves the old file."""
    from safetensors.torch import save_file

    metadata = {"format": "pt", **(metadata or {}), **safetensors_metadata(tensors)}
    temporary, descriptor = staging_file(path)
    try:
        mode = os.fstat(descriptor).st_mode & 0o777  # the umask's; the library makes its files private (0600)
        os.close(descriptor)
        save_file(tensors, str(temporary), metadata=metadata)
        os.chmod(temporary, mode)
        descriptor = os.open(temporary, os.O_RDONLY)
        try:
            os.fsync(descriptor)  # on the disk before it takes the name
        finally:
            os.close(descriptor)
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)


def load_safetensors(path: Path) -> dict[str, Tensor]:
    """A safetensors file's tensors, its header checked against the format first (safetensors_file.py)
    and its tensors against the checksum attnlab wrote into it (files written elsewhere carry none and
    are read as they are); a damaged file is one error naming it."""
    from attnlab.safetensors_file import load_with_metadata

    tensors, metadata = load_with_metadata(path)
    expected = metadata.get(SAFETENSORS_KEY)
    if expected is not None and safetensors_metadata(tensors)[SAFETENSORS_KEY] != expected:
        raise CheckpointError(f"{path} is corrupt: its tensors do not match their checksum")
    return tensors
