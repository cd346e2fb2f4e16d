"""jsonl documents -> memory-mapped token shards, and reading them back (`attnlab data prepare`).

A prepared folder holds:

    meta.json                     written last, so its presence means the folder is complete
    shard-00000.tokens.bin        raw token ids (uint16 when the vocabulary fits, else uint32)
    shard-00000.offsets.npy       int64 [n_documents + 1]: document d is tokens[offsets[d]:offsets[d + 1]]
    ...
    tokenizer/                    a copy of the tokenizer the ids belong to (its sha256 is in meta.json)

Every document is stored as its tokens followed by the end-of-text token, so the concatenation of
the shards is already the packed stream (documents separated by end tokens) and a document without
its last token is exactly `tokenizer.encode(text)`.

Streaming: input lines are read in batches, parsed and tokenized by a pool of worker processes
(in input order, at most two batches per worker read ahead), and a shard is written as soon as it
holds `shard_tokens` tokens, so memory is bounded by one shard plus the batches in flight whatever
the corpus size. A document never spans two shards (a document longer than `shard_tokens` gets a shard of its own).

Legend: V vocabulary size, N tokens, D documents.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnlab.data.files import sha256_of
from attnlab.data.jsonl import SkipCounter, parse_batch, read_line_batches
from attnlab.data.tokenizer import TOKENIZER_FILE, Tokenizer
from attnlab.errors import DataError

log = logging.getLogger(__name__)

FORMAT = "attnlab-token-shards"
FORMAT_VERSION = 1
META_FILE = "meta.json"
TOKENIZER_FOLDER = "tokenizer"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type holding every id: uint16 up to 65,536 tokens."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# --------------------------------------------------------------------------------------------
# Writing


class ShardWriter:
    """Collects tokenized documents and writes a shard whenever `shard_tokens` are buffered."""

    def __init__(self, out_dir: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.out_dir, self.dtype, self.shard_tokens = out_dir, dtype, shard_tokens
        self.buffer: list[np.ndarray] = []  # documents of the shard being filled
        self.n_buffered = 0
        self.shards: list[dict[str, Any]] = []  # what meta.json lists
        self.n_tokens = self.n_documents = 0

    def add(self, document: np.ndarray) -> None:
        if self.buffer and self.n_buffered + len(document) > self.shard_tokens:
            self.flush()
        self.buffer.append(document)
        self.n_buffered += len(document)
        self.n_tokens += len(document)
        self.n_documents += 1

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f"shard-{len(self.shards):05d}"
        tokens = np.concatenate(self.buffer).astype(self.dtype, copy=False)  # [N_shard]
        offsets = np.zeros(len(self.buffer) + 1, dtype=np.int64)  # [D_shard + 1]
        np.cumsum([len(document) for document in self.buffer], out=offsets[1:])
        _write_array(self.out_dir / f"{name}.tokens.bin", tokens, raw=True)
        _write_array(self.out_dir / f"{name}.offsets.npy", offsets, raw=False)
        self.shards.append({"tokens": f"{name}.tokens.bin", "offsets": f"{name}.offsets.npy",
                            "n_tokens": int(len(tokens)), "n_documents": len(self.buffer)})
        log.debug("wrote %s: %d documents, %d tokens", name, len(self.buffer), len(tokens))
        self.buffer, self.n_buffered = [], 0


def _write_array(path: Path, array: np.ndarray, raw: bool) -> None:
    """Written to a temporary name and renamed: a crash never leaves a half shard under the real name."""
    temporary = path.with_name(f".{path.name}.partial")
    with open(temporary, "wb") as handle:
        if raw:
            array.tofile(handle)
        else:
            np.save(handle, array)
    os.replace(temporary, path)


# Worker processes: each loads the tokenizer once, then parses and tokenizes whole line batches.
_worker_tokenizer: Tokenizer | None = None


def _start_worker(tokenizer_dir: str, in_pool: bool = False) -> None:
    global _worker_tokenizer
    if in_pool:  # one thread per worker process: the workers already use every core between them
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = Tokenizer(Path(tokenizer_dir))


def _tokenize_batch(
    job: tuple[str, list[tuple[int, bytes]], bool, str]
) -> tuple[list[np.ndarray], SkipCounter, int]:
    """(documents as id arrays ending with the end token, skipped lines, input bytes) of one batch."""
    path, batch, skip_bad, dtype = job
    assert _worker_tokenizer is not None
    skipped = SkipCounter()
    texts = parse_batch(Path(path), batch, skip_bad, skipped)
    end = _worker_tokenizer.eos_id
    documents = [np.array([*ids, end], dtype=dtype) for ids in _worker_tokenizer.encode_batch(texts)]
    return documents, skipped, sum(len(raw) for _, raw in batch)


def _jobs(inputs: list[Path], batch_lines: int, skip_bad: bool, dtype: str) -> Iterator[tuple]:
    for path in inputs:
        for batch in read_line_batches(path, batch_lines):
            yield str(path), batch, skip_bad, dtype


def _in_order(pool, jobs: Iterator[tuple], max_in_flight: int) -> Iterator:
    """Results of `jobs` run on `pool`, in input order, with at most `max_in_flight` batches read
    ahead (Pool.imap would read the whole input ahead and queue every result: not bounded)."""
    pending: deque = deque()
    for job in jobs:
        pending.append(pool.apply_async(_tokenize_batch, (job,)))
        if len(pending) >= max_in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


@dataclass
class PrepareResult:
    out_dir: Path
    meta: dict[str, Any]


def _tokenize_into(writer: ShardWriter, jobs: Iterator[tuple], tokenizer_dir: Path, workers: int
                   ) -> tuple[SkipCounter, int]:
    """Tokenize every job's lines (in order) into `writer`, on `workers` processes; -> the skipped
    lines and the input bytes read."""
    skipped = SkipCounter()
    n_input_bytes = 0
    if workers == 1:
        _start_worker(str(tokenizer_dir))
        results: Iterator = map(_tokenize_batch, jobs)
        pool = None
    else:
        # fork: the workers share the parent's imports; each runs the tokenizers library on one thread
        pool = multiprocessing.get_context("fork").Pool(workers, _start_worker, (str(tokenizer_dir), True))
        results = _in_order(pool, jobs, max_in_flight=2 * workers)
    try:
        for documents, batch_skipped, n_bytes in results:
            for reason in batch_skipped.examples:
                skipped.add(reason)
            skipped.count += batch_skipped.count - len(batch_skipped.examples)
            for document in documents:
                writer.add(document)
            n_input_bytes += n_bytes
    finally:
        if pool is not None:
            pool.terminate()
    return skipped, n_input_bytes


def prepare_token_shards(
    inputs: list[Path],
    tokenizer_dir: Path,
    out_dir: Path,
    skip_bad: bool = False,
    shard_tokens: int = 1 << 25,
    batch_lines: int = 512,
    workers: int | None = None,
) -> PrepareResult:
    """Tokenize the `{"text": ...}` lines of `inputs` (in order) into token shards in `out_dir`.

    skip_bad: skip malformed lines, counting them in meta.json, instead of failing at the first one
    (whose error names its file and line). workers: tokenizing processes (default: the CPU count,
    at most 8; 1 tokenizes in this process)."""
    inputs = [Path(path) for path in inputs]
    for path in inputs:
        if not path.is_file():
            raise DataError(f"input file {path} does not exist")
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    tokenizer = Tokenizer(tokenizer_dir)  # fails early with a clear message if there is none
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be positive, got {shard_tokens}")
    dtype = token_dtype(tokenizer.vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / META_FILE).unlink(missing_ok=True)  # the folder is incomplete until meta.json is back
    for stale in out_dir.glob("shard-*"):
        stale.unlink()
    workers = workers or min(8, os.cpu_count() or 1)
    writer = ShardWriter(out_dir, dtype, shard_tokens)
    started = time.perf_counter()
    skipped, n_input_bytes = _tokenize_into(writer, _jobs(inputs, batch_lines, skip_bad, dtype.name), tokenizer_dir,
                                            workers)
    writer.flush()
    if writer.n_documents == 0:
        raise DataError(f"no documents in {', '.join(map(str, inputs))}")
    seconds = time.perf_counter() - started
    if Path(tokenizer_dir).resolve() != (out_dir / TOKENIZER_FOLDER).resolve():  # not already there
        shutil.copytree(tokenizer_dir, out_dir / TOKENIZER_FOLDER, dirs_exist_ok=True)
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "vocab_size": tokenizer.vocab_size,
        "dtype": dtype.name,
        "n_tokens": writer.n_tokens,  # end tokens included
        "n_documents": writer.n_documents,
        "skipped_lines": skipped.count,
        "pad_id": tokenizer.pad_id,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "tokenizer_sha256": sha256_of(tokenizer_dir / TOKENIZER_FILE),
        "inputs": [str(path) for path in inputs],
        "input_bytes": n_input_bytes,
        "seconds": round(seconds, 3),
        "shards": writer.shards,
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if skipped.count:
        log.warning("skipped %d malformed lines, first: %s", skipped.count, skipped.examples[0])
    log.info("prepared %d documents, %d tokens (%s) in %d shards -> %s (%.1f MB/s)", writer.n_documents,
             writer.n_tokens, dtype.name, len(writer.shards), out_dir, n_input_bytes / 1e6 / max(seconds, 1e-9))
    return PrepareResult(out_dir=out_dir, meta=meta)


# --------------------------------------------------------------------------------------------
# Reading


def read_meta(folder: Path) -> dict[str, Any]:
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise DataError(f"{folder} is not a prepared token folder (no {META_FILE}): run `attnlab data prepare`")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise DataError(f"{path}: not a {FORMAT} v{FORMAT_VERSION} folder")
    return meta


class TokenShards:
    """The shards of a prepared folder as one token stream and one list of documents (memory-mapped)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.meta = read_meta(self.folder)
        dtype = np.dtype(self.meta["dtype"])
        self.shards = [np.memmap(self.folder / shard["tokens"], dtype=dtype, mode="r")
                       if shard["n_tokens"] else np.zeros(0, dtype) for shard in self.meta["shards"]]
        sizes = [len(shard) for shard in self.shards]
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # [n_shards + 1]
        offsets = [np.load(self.folder / shard["offsets"]) + start
                   for shard, start in zip(self.meta["shards"], self.shard_starts[:-1])]
        # [D + 1] global document boundaries
        self.offsets = np.concatenate([offsets[0]] + [part[1:] for part in offsets[1:]]).astype(np.int64)
        if self.offsets[-1] != self.meta["n_tokens"] or len(self.offsets) != self.meta["n_documents"] + 1:
            raise DataError(f"{self.folder}: shards do not match {META_FILE} (prepare the folder again)")

    @property
    def n_tokens(self) -> int:
        return int(self.shard_starts[-1])

    @property
    def n_documents(self) -> int:
        return len(self.offsets) - 1

    def document(self, index: int) -> np.ndarray:
        """Document `index`'s ids, its end token last (it lies inside one shard)."""
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        shard = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        base = int(self.shard_starts[shard])
        return np.asarray(self.shards[shard][start - base : end - base])

    def gather(self, positions: np.ndarray) -> np.ndarray:
        """Tokens at global `positions` (any shape), possibly from several shards."""
        if len(self.shards) == 1:
            return np.asarray(self.shards[0][positions])
        flat = positions.ravel()
        shard_of = np.searchsorted(self.shard_starts, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.shards[0].dtype)
        for shard in np.unique(shard_of):
            chosen = shard_of == shard
            out[chosen] = self.shards[shard][flat[chosen] - self.shard_starts[shard]]
        return out.reshape(positions.shape)


class TokenRange:
    """Tokens [start, end) of a TokenShards stream, indexed like an array (what the random window
    sampler and evaluation read from)."""

    def __init__(self, shards: TokenShards, start: int, end: int, token_bytes: np.ndarray | None = None) -> None:
        self.shards, self.start, self.end = shards, start, end
        self.token_bytes = token_bytes  # [V] UTF-8 bytes each id decodes to, for bits per byte

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            index = np.arange(start, stop, step)
        positions = np.asarray(index, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= len(self)):
            raise IndexError(f"token index out of range [0, {len(self)})")
        return self.shards.gather(positions + self.start)
