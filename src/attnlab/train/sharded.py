"""Sharded checkpoints through torch.distributed.checkpoint (DCP), read without unsafe unpickling.

Under FSDP2 every rank writes its own shards of the model, optimiser and EMA state into
`RUN/fsdp/step-NNNNNNN/` (nothing is gathered on one rank), and reads them back on resume. DCP's
stock reader unpickles the checkpoint's `.metadata` file and its non-tensor items with plain
pickle, which would let a crafted checkpoint run code; attnlab reads them with a restricted
unpickler that accepts DCP's own metadata classes and nothing else, and loads non-tensor items
with `torch.load(weights_only=True)`, as it does for its single-file checkpoints.

`load_full_tensors` rebuilds full, unsharded tensors from such a folder in one process (no process
group needed): that is how the single-file checkpoint `attnlab sample`/`eval`/`export` read is made.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from attnlab.errors import CheckpointError

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                  torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is unpickled by an allow-list of DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} does not hold checkpoint metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor items (optimiser hyperparameters) loaded with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def save_sharded(state: dict[str, Any], folder: Path) -> None:
    """Every rank calls this with its sharded state dicts; each writes its own shards."""
    dcp.save(state, checkpoint_id=str(folder))


def load_sharded(state: dict[str, Any], folder: Path) -> None:
    """Fill `state` (sharded state dicts laid out like the ones saved) in place, on every rank."""
    if not (folder / ".metadata").is_file():
        raise CheckpointError(f"sharded checkpoint {folder} is missing or incomplete (no .metadata)")
    try:
        dcp.load(state, checkpoint_id=str(folder), storage_reader=SafeReader(folder), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as error:  # DCP's own exception is a BaseException
        raise CheckpointError(f"sharded checkpoint {folder} is corrupt or unsafe to load ({_reason(error)})") from error


def _reason(error: BaseException) -> str:
    """One line out of DCP's per-rank tracebacks: the refusal of a forbidden class if there was one."""
    text = str(error)
    refused = re.search(r"[\w.]+ is not allowed in checkpoint metadata", text)
    if refused:
        return refused.group(0)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else type(error).__name__


def load_full_tensors(folder: Path, prefixes: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Full (unsharded) tensors of the state dicts named `prefixes` (e.g. ["model", "ema"]), in this
    one process: DCP reassembles each tensor from every rank's shards."""
    reader = SafeReader(folder)
    try:
        metadata = reader.read_metadata()
    except (OSError, pickle.UnpicklingError, EOFError) as error:
        raise CheckpointError(f"sharded checkpoint {folder} is corrupt or unsafe to load ({error})") from error
    state: dict[str, dict[str, torch.Tensor]] = {prefix: {} for prefix in prefixes}
    for key, item in metadata.state_dict_metadata.items():
        prefix, _, name = key.partition(".")
        if prefix in state and isinstance(item, TensorStorageMetadata):
            state[prefix][name] = torch.empty(item.size, dtype=item.properties.dtype)
    dcp.load(state, checkpoint_id=str(folder), storage_reader=SafeReader(folder), planner=SafeLoadPlanner(),
             no_dist=True)
    return state
