"""Reading a safetensors file someone else wrote (`attnlab import-hf`): the header is checked first,
so a damaged or hostile file is one ConversionError naming it and what is wrong, not a Rust panic
or a traceback from inside the safetensors library.

The format (https://github.com/huggingface/safetensors): 8 bytes, the little-endian length N of
a JSON header; N bytes of header, an object mapping each tensor name to {"dtype", "shape",
"data_offsets": [begin, end]} (offsets into the byte buffer that follows), plus an optional
"__metadata__" object of strings; then the buffer, which the tensors must cover exactly, without
holes or overlaps. The checks here are the format's own rules, before any tensor is read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from attnlab.errors import ConversionError

MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses larger headers too
ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}


def read_header(path: Path) -> dict[str, Any]:
    """The header of a safetensors file, checked against the format; ConversionError otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{path} {'is not a regular file' if path.exists() else 'does not exist'}")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise _damaged(path, f"{size} bytes, shorter than the 8-byte header length")
        header_bytes = int.from_bytes(prefix, "little")
        if header_bytes > min(MAX_HEADER_BYTES, size - 8):
            raise _damaged(path, f"a header of {header_bytes:,} bytes in a file of {size:,}")
        raw = handle.read(header_bytes)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise _damaged(path, f"the header is not JSON ({type(error).__name__})") from error
    if not isinstance(header, dict):
        raise _damaged(path, "the header is not a JSON object")
    problem = _header_problem(header, size - 8 - header_bytes)
    if problem:
        raise _damaged(path, problem)
    return header


def _header_problem(header: dict[str, Any], buffer_bytes: int) -> str | None:
    """What breaks the format's rules in a parsed header, or None."""
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        return "__metadata__ is not an object of strings"
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in ITEM_BYTES:
            return f"tensor {name[:80]!r} has no known dtype"
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
            return f"tensor {name[:80]!r} has no valid shape"
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(n) for n in offsets):
            return f"tensor {name[:80]!r} has no valid data_offsets"
        begin, end = offsets
        if not begin <= end <= buffer_bytes:
            return f"tensor {name[:80]!r} lies outside the data ({begin}-{end} of {buffer_bytes} bytes)"
        if end - begin != math.prod(shape) * ITEM_BYTES[entry["dtype"]]:
            return f"tensor {name[:80]!r}: {end - begin} bytes for shape {shape} of {entry['dtype']}"
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            return "tensors overlap or leave holes in the data"
        position = end
    if position != buffer_bytes:
        return f"{buffer_bytes - position} bytes of data belong to no tensor"
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _damaged(path: Path, problem: str) -> ConversionError:
    return ConversionError(f"{path} is not a valid safetensors file: {problem}")


def load_file(path: str | Path) -> dict[str, Any]:
    """safetensors.torch.load_file, after the header is checked; ConversionError for a bad file."""
    return load_with_metadata(path)[0]


def load_with_metadata(path: str | Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The file's tensors and its __metadata__ ({} without), the header checked first (read once)."""
    from safetensors.torch import load_file as load

    metadata = read_header(Path(path)).get("__metadata__", {})
    try:
        return load(str(path)), metadata
    except Exception as error:  # SafetensorError (a bare Exception subclass) for what the checks above missed
        raise _damaged(Path(path), f"{type(error).__name__}: {str(error)[:200]}") from error
