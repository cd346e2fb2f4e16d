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

Preparing into a folder that exists replaces it only when the new one is complete: everything is
written to a hidden folder beside it (`.DATA.partial-PID`), which is then renamed into place and the
old folder removed, so a failed or killed run never costs the data that was there. Only a folder
that holds nothing but a prepared folder's files is ever replaced.

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
import re
import shutil
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

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


def _start_worker(tokenizer_dir: str, special_tokens: dict[str, str] | None = None, in_pool: bool = False) -> None:
    global _worker_tokenizer
    if in_pool:  # one thread per worker process: the workers already use every core between them
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = Tokenizer(Path(tokenizer_dir), special_tokens)


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


SHARD_FILE = re.compile(r"shard-\d+\.(tokens\.bin|offsets\.npy)")
# The folder's own file names: a folder holding anything else is never replaced
OWN_NAMES = re.compile(rf"{re.escape(META_FILE)}|{TOKENIZER_FOLDER}|{SHARD_FILE.pattern}|\..*\.partial")


def _check_out_dir(out_dir: Path) -> None:
    """`out_dir` (absolute) may be replaced: a new folder, or one of nothing but prepared data, and
    not the folder this process is in (nor one above it), which the swap would pull from under it."""
    if Path.cwd().is_relative_to(out_dir):
        raise DataError(f"--out {out_dir} is the current folder or one above it: preparing replaces the whole "
                        "folder, so give a new one (such as ./data)")
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--out {out_dir} is a file, not a folder")
    foreign = sorted(entry.name for entry in out_dir.iterdir() if not OWN_NAMES.fullmatch(entry.name)) \
        if out_dir.is_dir() else []
    if foreign:
        raise DataError(f"--out {out_dir} holds files that are not prepared data ({', '.join(foreign[:3])}): "
                        "preparing replaces the whole folder, so give a new or empty one")


def _remove_stale_folders(out_dir: Path) -> None:
    """Staging and retired folders of `out_dir` whose preparing process is gone (killed)."""
    for stale in out_dir.parent.glob(f".{out_dir.name}.*-*"):
        kind, _, pid = stale.name[len(out_dir.name) + 2 :].rpartition("-")
        if kind in ("partial", "old") and pid.isdigit() and not _is_running(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _swap_in(staging: Path, out_dir: Path) -> None:
    """Put the complete `staging` folder at `out_dir`; the old folder is removed only after."""
    if not out_dir.exists():
        os.replace(staging, out_dir)
        return
    retired = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    os.replace(out_dir, retired)
    os.replace(staging, out_dir)
    shutil.rmtree(retired, ignore_errors=True)


def _in_order(pool: ProcessPoolExecutor, jobs: Iterator[tuple], max_in_flight: int) -> Iterator:
    """Results of `jobs` run on `pool`, in input order, with at most `max_in_flight` batches read
    ahead (pool.map would read the whole input ahead: not bounded). A worker that dies (killed, out
    of memory) is a one-line error, never a wait without end."""
    pending: deque = deque()
    try:
        for job in jobs:
            pending.append(pool.submit(_tokenize_batch, job))
            if len(pending) >= max_in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool as error:
        raise DataError(f"a tokenizing worker process ended without finishing its batch ({error}); "
                        "run again, or with --workers 1") from None


@dataclass
class PrepareResult:
    out_dir: Path
    meta: dict[str, Any]


def _tokenize_into(writer: ShardWriter, jobs: Iterator[tuple], tokenizer: Tokenizer, workers: int,
                   bar: tqdm) -> tuple[SkipCounter, int]:
    """Tokenize every job's lines (in order) into `writer`, on `workers` processes; -> the skipped
    lines and the input bytes read (counted on `bar`)."""
    skipped = SkipCounter()
    n_input_bytes = 0
    setup = (str(tokenizer.folder), tokenizer.special_tokens)
    if workers == 1:
        _start_worker(*setup)
        results: Iterator = map(_tokenize_batch, jobs)
        pool = None
    else:
        # spawn, not fork: the calling process may hold threads (torch's compile workers, the
        # tokenizers library's pool, a test runner's) whose locks a forked child would inherit held.
        # Each worker starts fresh, imports this module (no torch) and tokenizes on one thread.
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_worker, initargs=(*setup, True))
        results = _in_order(pool, jobs, max_in_flight=2 * workers)
    try:
        for documents, batch_skipped, n_bytes in results:
            for reason in batch_skipped.examples:
                skipped.add(reason)
            skipped.count += batch_skipped.count - len(batch_skipped.examples)
            for document in documents:
                writer.add(document)
            n_input_bytes += n_bytes
            bar.update(n_bytes)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return skipped, n_input_bytes


def prepare_token_shards(
    inputs: list[Path],
    tokenizer_dir: Path,
    out_dir: Path,
    skip_bad: bool = False,
    shard_tokens: int = 1 << 25,
    batch_lines: int = 512,
    workers: int | None = None,
    special_tokens: dict[str, str] | None = None,
    progress: bool = False,
) -> PrepareResult:
    """Tokenize the `{"text": ...}` lines of `inputs` (in order) into token shards in `out_dir`,
    replacing what is there only once the new folder is complete (the module docstring).

    skip_bad: skip malformed lines, counting them in meta.json, instead of failing at the first one
    (whose error names its file and line). workers: tokenizing processes (default: the CPU count,
    at most 8; 1 tokenizes in this process). special_tokens: {"pad"|"bos"|"eos": token} for a
    tokenizer that does not name its own (data/tokenizer.py). progress: a bar over the input bytes."""
    inputs = [Path(path) for path in inputs]
    for path in inputs:
        if not path.is_file():
            raise DataError(f"input file {path} {'is not a regular file' if path.exists() else 'does not exist'}")
    tokenizer_dir = Path(tokenizer_dir)
    out_dir = Path(os.path.abspath(out_dir))  # "." or "data/.." have no name to put the staging folder beside
    tokenizer = Tokenizer(tokenizer_dir, special_tokens)  # fails early with a clear message if there is none
    if shard_tokens < 1:
        raise DataError(f"shard_tokens must be positive, got {shard_tokens}")
    _check_out_dir(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_folders(out_dir)
    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        meta = _write_shards(inputs, tokenizer, staging, skip_bad, shard_tokens, batch_lines, workers, progress)
        _swap_in(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when swapped in
    log.info("prepared %d documents, %d tokens (%s) in %d shards -> %s (%.1f MB/s)", meta["n_documents"],
             meta["n_tokens"], meta["dtype"], len(meta["shards"]), out_dir,
             meta["input_bytes"] / 1e6 / max(meta["seconds"], 1e-9))
    return PrepareResult(out_dir=out_dir, meta=meta)


def _write_shards(inputs: list[Path], tokenizer: Tokenizer, folder: Path, skip_bad: bool, shard_tokens: int,
                  batch_lines: int, workers: int | None, progress: bool) -> dict[str, Any]:
    """Shards, the tokenizer's copy and meta.json (last) in the empty `folder`; -> the meta."""
    dtype = token_dtype(tokenizer.vocab_size)
    workers = workers or min(8, os.cpu_count() or 1)
    writer = ShardWriter(folder, dtype, shard_tokens)
    started = time.perf_counter()
    total = sum(path.stat().st_size for path in inputs)
    with tqdm(total=total, desc="tokenizing", unit="B", unit_scale=True, disable=not progress) as bar:
        skipped, n_input_bytes = _tokenize_into(writer, _jobs(inputs, batch_lines, skip_bad, dtype.name), tokenizer,
                                                workers, bar)
    writer.flush()
    if writer.n_documents == 0:
        raise DataError(f"no documents in {', '.join(map(str, inputs))}")
    seconds = time.perf_counter() - started
    shutil.copytree(tokenizer.folder, folder / TOKENIZER_FOLDER)
    tokenizer.save_special_tokens(folder / TOKENIZER_FOLDER)  # the copy names the tokens the ids below are
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
        "tokenizer_sha256": sha256_of(tokenizer.folder / TOKENIZER_FILE),
        "inputs": [str(path) for path in inputs],
        "input_bytes": n_input_bytes,
        "seconds": round(seconds, 3),
        "shards": writer.shards,
    }
    (folder / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if skipped.count:
        log.warning("skipped %d malformed lines, first: %s", skipped.count, skipped.examples[0])
    return meta


# --------------------------------------------------------------------------------------------
# Reading


def read_meta(folder: Path) -> dict[str, Any]:
    """A prepared folder's meta.json, checked: every field there, of its type, consistent with itself."""
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise DataError(missing_folder_message(Path(folder)))
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise DataError(f"{path} is damaged (not valid JSON): prepare the folder again") from error
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise DataError(f"{path}: not the meta.json of a token folder ({FORMAT} v{FORMAT_VERSION})")
    problem = _meta_problem(meta)
    if problem:
        raise DataError(f"{path} is damaged ({problem}): prepare the folder again")
    return meta


def missing_folder_message(folder: Path) -> str:
    """Why `folder` holds no prepared tokens. A relative data.path is read from the current folder,
    not the one training ran in: said, so that a run evaluated from elsewhere is not prepared again."""
    where = "" if folder.is_absolute() else f" (a relative path, read from the current folder {Path.cwd()})"
    if not folder.exists():
        elsewhere = "" if folder.is_absolute() else "run from the folder it is relative to, or "
        return (f"{folder} does not exist{where}: {elsewhere}make it with "
                f"`attnlab data prepare --input FILES --tokenizer DIR --out {folder}`")
    return f"{folder} is not a prepared token folder (no {META_FILE}){where}: run `attnlab data prepare`"


def _meta_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with a meta.json's fields, or None."""
    integers = ("vocab_size", "n_tokens", "n_documents", "pad_id", "bos_id", "eos_id")
    for key in integers:
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool) or meta[key] < 0:
            return f"{key} is not a count"
    if meta.get("dtype") not in ("uint16", "uint32") or not isinstance(meta.get("tokenizer_sha256"), str):
        return "dtype or tokenizer_sha256"
    if not all(meta[key] < meta["vocab_size"] for key in ("pad_id", "bos_id", "eos_id")):
        return "a special token id beyond the vocabulary"
    shards = meta.get("shards")
    if not isinstance(shards, list) or not shards:
        return "no shards listed"
    for shard in shards:
        if not isinstance(shard, dict) or not all(isinstance(shard.get(key), int) and shard[key] >= 0
                                                  for key in ("n_tokens", "n_documents")):
            return "a shard without its counts"
        names = (shard.get("tokens"), shard.get("offsets"))
        if not all(isinstance(name, str) and SHARD_FILE.fullmatch(name) for name in names):
            return "a shard file name that is not one of the folder's own"
    if sum(shard["n_tokens"] for shard in shards) != meta["n_tokens"] or \
            sum(shard["n_documents"] for shard in shards) != meta["n_documents"]:
        return "the shards' counts do not add up"
    return None


def _load_offsets(path: Path, n_documents: int, n_tokens: int) -> np.ndarray:
    """A shard's document offsets [D + 1], checked: int64, from 0 to its token count, increasing
    (every document holds at least its end token)."""
    try:
        offsets = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise DataError(f"{path} is damaged or missing ({type(error).__name__}): prepare the folder again") from error
    if offsets.dtype != np.int64 or offsets.shape != (n_documents + 1,) or offsets[0] != 0 or \
            offsets[-1] != n_tokens or (np.diff(offsets) <= 0).any():
        raise DataError(f"{path} does not hold the document offsets {META_FILE} describes: prepare the folder again")
    return offsets


class TokenShards:
    """The shards of a prepared folder as one token stream and one list of documents (memory-mapped).
    Every file is checked against meta.json on opening (sizes, offsets), and every token read
    against the vocabulary, so a damaged folder is a DataError naming the file, never a crash."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.meta = read_meta(self.folder)
        self.vocab_size = int(self.meta["vocab_size"])
        dtype = np.dtype(self.meta["dtype"])
        self.shards, offsets = [], []
        for shard in self.meta["shards"]:
            path = self.folder / shard["tokens"]
            size = path.stat().st_size if path.is_file() else None
            if size != shard["n_tokens"] * dtype.itemsize:
                found = "is missing" if size is None else f"has {size:,} bytes"
                raise DataError(f"{path} {found}; {META_FILE} lists {shard['n_tokens'] * dtype.itemsize:,}: prepare "
                                "the folder again")
            self.shards.append(np.memmap(path, dtype=dtype, mode="r") if shard["n_tokens"] else np.zeros(0, dtype))
            offsets.append(_load_offsets(self.folder / shard["offsets"], shard["n_documents"], shard["n_tokens"]))
        sizes = [len(shard) for shard in self.shards]
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # [n_shards + 1]
        offsets = [part + start for part, start in zip(offsets, self.shard_starts[:-1])]
        # [D + 1] global document boundaries
        self.offsets = np.concatenate([offsets[0]] + [part[1:] for part in offsets[1:]]).astype(np.int64)

    def checked(self, tokens: np.ndarray) -> np.ndarray:
        """`tokens` if every id is in the vocabulary (a flipped bit in a shard is not), else DataError."""
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            raise DataError(f"{self.folder}: a shard holds token id {int(tokens.max())}, beyond the vocabulary of "
                            f"{self.vocab_size}: the folder is damaged, prepare it again")
        return tokens

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
        return self.checked(np.asarray(self.shards[shard][start - base : end - base]))

    def gather(self, positions: np.ndarray) -> np.ndarray:
        """Tokens at global `positions` (any shape), possibly from several shards."""
        if len(self.shards) == 1:
            return self.checked(np.asarray(self.shards[0][positions]))
        flat = positions.ravel()
        shard_of = np.searchsorted(self.shard_starts, flat, side="right") - 1
        out = np.empty(flat.shape, dtype=self.shards[0].dtype)
        for shard in np.unique(shard_of):
            chosen = shard_of == shard
            out[chosen] = self.shards[shard][flat[chosen] - self.shard_starts[shard]]
        return self.checked(out.reshape(positions.shape))


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
