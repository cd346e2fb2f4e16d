"""Reading pretraining documents from jsonl files: one JSON object a line with a "text" string
(MiniMind's `pretrain_hq.jsonl` layout). A malformed line is an error naming the file and the
line, unless the caller asks to skip such lines, in which case they are counted."""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from attnlab.errors import DataError

log = logging.getLogger(__name__)


@dataclass
class SkipCounter:
    """Lines skipped by `read_texts(..., skip_bad=True)`, with the first few reasons kept for the log."""

    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, reason: str) -> None:
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(reason)


def parse_line(line: str, path: Path, line_number: int) -> str:
    """The "text" of one jsonl line, or DataError naming `path:line_number`: also for what the json
    module refuses beyond syntax (an integer of more than 4,300 digits, nesting deeper than the
    recursion limit) and for text that cannot be written as UTF-8 (a lone surrogate, `"\\ud800"`)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{line_number}: not valid JSON ({error.msg} at column {error.colno})") from error
    except ValueError as error:  # int_max_str_digits: a number too long to convert
        raise DataError(f"{path}:{line_number}: not usable JSON ({str(error).split(';')[0]})") from error
    except RecursionError as error:
        raise DataError(f"{path}:{line_number}: nested too deeply to parse") from error
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise DataError(f'{path}:{line_number}: expected an object with a "text" string, got {line.strip()[:80]!r}')
    text = record["text"]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise DataError(f"{path}:{line_number}: the text holds a lone surrogate ({text[error.start]!r}), which "
                        "is not a character") from error
    return text


def parse_raw_line(raw: bytes, path: Path, line_number: int) -> str:
    """The "text" of one undecoded jsonl line, or DataError naming `path:line_number`."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}:{line_number}: not UTF-8 ({error.reason})") from error
    return parse_line(line, path, line_number)


def read_line_batches(path: Path, batch_lines: int) -> Iterator[list[tuple[int, bytes]]]:
    """Lists of up to `batch_lines` (line number, raw line) of a jsonl file, blank lines left out:
    the unit of work when documents are parsed and tokenized in parallel (data/shards.py). A UTF-8
    byte-order mark that opens the file (as some editors and Windows tools write one) is the file's
    encoding mark, not part of its first line; anywhere else it makes a line malformed."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"input file {path} does not exist")
    batch: list[tuple[int, bytes]] = []
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if line_number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            if not raw.strip():
                continue
            batch.append((line_number, raw))
            if len(batch) == batch_lines:
                yield batch
                batch = []
    if batch:
        yield batch


def parse_batch(path: Path, batch: list[tuple[int, bytes]], skip_bad: bool,
                skipped: SkipCounter) -> list[str]:
    """The texts of a batch from read_line_batches; malformed lines raise or are counted in `skipped`."""
    texts = []
    for line_number, raw in batch:
        try:
            texts.append(parse_raw_line(raw, path, line_number))
        except DataError as error:
            if not skip_bad:
                raise
            skipped.add(str(error))
    return texts


def read_texts(path: Path, skip_bad: bool = False, skipped: SkipCounter | None = None) -> Iterator[str]:
    """Yield the "text" of every line of a jsonl file, streaming (blank lines are ignored).

    skip_bad: skip malformed lines (and lines that are not UTF-8), counting them in `skipped`,
    instead of raising DataError at the first one."""
    skipped = skipped if skipped is not None else SkipCounter()
    for batch in read_line_batches(Path(path), 1024):
        yield from parse_batch(Path(path), batch, skip_bad, skipped)
