"""Tokenized pretraining data: sample layouts over prepared token shards, and the built-in jsonl corpus.

Two layouts (`data.layout`), both giving batches of tokens [B, T + 1] (inputs tokens[:, :-1],
targets tokens[:, 1:]) with T = train.seq_len:

- padded (MiniMind's `PretrainDataset`): one document per sample, BOS + its first T - 1 tokens + EOS,
  padded to T + 1 with the padding token; loss_mask [B, T] is 1 on the targets that are text or EOS
  and 0 on padding. Departures from MiniMind, both deliberate: a sample holds T + 1 tokens (MiniMind:
  max_seq_len, so its inputs are one shorter), and the mask is built from the sample's length, not
  by comparing targets with the padding id, so a document that literally contains `<|endoftext|>`
  is still trained on it. Documents are visited in a seeded random order, a new permutation every epoch.
- packed: the documents joined by their end tokens form one stream; a sample is a random window of
  T + 1 tokens of it (the byte-level sampler, unchanged), no padding, no mask. Attention is not
  reset at document boundaries: a window's tokens see the end of the previous document.

Both samplers are counter-based (global batch i is a pure function of seed and i), so their state is
one integer saved in every checkpoint and a resumed run reads exactly the batches an uninterrupted
one would; rank r of a distributed run takes slice r of each global batch, so ranks never share a sample.

Validation is the last `data.val_fraction` of the documents (at least one), in the same layout.

The built-in jsonl corpus (`data.source=builtin-tokens`) needs no download: one document per
docstring (module, class or function) of the running interpreter's standard library, read with
`ast` (nothing is imported), in sorted file order, so the same Python version gives the same
documents. `prepare_builtin_tokens` builds it, trains a BPE tokenizer on it and prepares its shards,
each stage cached in the cache directory and skipped when already done.

Legend: B batch, T seq_len, V vocabulary size, D documents.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import platform
import shutil
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnlab.config import DataConfig, TrainConfig
from attnlab.data.files import cache_dir, read_meta_fields, sha256_of, stdlib_sources, write_atomic
from attnlab.data.sampler import Batch, RandomWindowSampler
from attnlab.data.shards import (
    META_FILE,
    TOKENIZER_FOLDER,
    TokenRange,
    TokenShards,
    prepare_token_shards,
    read_meta,
)
from attnlab.data.tokenizer import TOKENIZER_FILE, Tokenizer, train_tokenizer
from attnlab.errors import DataError

log = logging.getLogger(__name__)

MIN_DOCSTRING_CHARS = 64  # shorter docstrings ("Return x.") teach little and are mostly padding
SKIPPED_FOLDERS = {"test", "tests", "idle_test"}  # test suites: odd syntax, few docstrings


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """[V] bytes of text each id stands for; 0 for the special tokens, which are not text."""
    lengths = np.array([len(tokenizer.decode_bytes([index])) for index in range(tokenizer.vocab_size)])
    lengths[sorted(tokenizer.special_ids)] = 0
    return lengths.astype(np.int64)


# --------------------------------------------------------------------------------------------
# The padded layout


class PaddedDocuments:
    """Documents [first, last) of a TokenShards, served as MiniMind's padded samples."""

    def __init__(self, shards: TokenShards, first: int, last: int, token_bytes: np.ndarray | None = None) -> None:
        self.shards, self.first, self.last = shards, first, last
        self.pad_id, self.bos_id, self.eos_id = (int(shards.meta[key]) for key in ("pad_id", "bos_id", "eos_id"))
        self.token_bytes = token_bytes  # [V], for bits per byte

    @property
    def n_documents(self) -> int:
        return self.last - self.first

    def text_tokens(self, index: int) -> np.ndarray:
        """Document `index` (counted from `first`) without its stored end token."""
        return self.shards.document(self.first + index)[:-1]

    def batch(self, indices: np.ndarray, seq_len: int) -> Batch:
        """Samples of the documents `indices`: tokens [B, T + 1], loss_mask [B, T]."""
        tokens = torch.full((len(indices), seq_len + 1), self.pad_id, dtype=torch.int64)  # [B, T + 1]
        loss_mask = torch.zeros((len(indices), seq_len), dtype=torch.int64)  # [B, T]
        for row, index in enumerate(indices):
            text = self.text_tokens(int(index))[: seq_len - 1]  # room for BOS and EOS
            sample = np.concatenate([[self.bos_id], text, [self.eos_id]])  # [L], L <= T + 1
            tokens[row, : len(sample)] = torch.from_numpy(sample.astype(np.int64))
            loss_mask[row, : len(sample) - 1] = 1  # targets sample[1:], the EOS included
        return Batch(tokens=tokens, loss_mask=loss_mask)

    def eval_batch(self, seq_len: int, n_samples: int, seed: int) -> Batch:
        """A fixed, seeded set of `n_samples` validation samples (documents repeat only if too few)."""
        generator = np.random.default_rng(seed)
        if n_samples <= self.n_documents:
            indices = generator.permutation(self.n_documents)[:n_samples]
        else:
            indices = generator.integers(0, self.n_documents, size=n_samples)
        return self.batch(indices, seq_len)

    def prime(self, length: int, seed: int) -> torch.Tensor:
        """BOS + the start of a seeded validation document: at most `length` tokens."""
        index = int(np.random.default_rng(seed).integers(0, self.n_documents))
        text = self.text_tokens(index)[: length - 1]
        return torch.from_numpy(np.concatenate([[self.bos_id], text]).astype(np.int64))


class PaddedDocumentSampler(RandomWindowSampler):
    """Global batch i holds the documents at positions i*B*W .. (i+1)*B*W - 1 of an endless sequence
    of epochs, epoch e visiting the documents in the order of a permutation seeded with (seed, e);
    rank r takes the r-th B of them. The state is the batch counter, as in RandomWindowSampler."""

    unit = "documents"

    def __init__(self, n_documents: int, seq_len: int, batch_size: int, seed: int, rank: int = 0,
                 world_size: int = 1) -> None:
        if n_documents < 1:
            raise DataError("the training split has no documents: lower data.val_fraction or add data")
        self.n_documents, self.seq_len, self.batch_size, self.seed = n_documents, seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.position = 0
        self._epoch, self._order = -1, np.zeros(0, dtype=np.int64)

    @property
    def size(self) -> int:
        return self.n_documents

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:  # one permutation in memory at a time
            self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_documents)
        return self._order

    def starts(self, index: int) -> np.ndarray:
        """This rank's document indices in global batch `index`."""
        per_batch = self.batch_size * self.world_size
        positions = index * per_batch + self.rank * self.batch_size + np.arange(self.batch_size)
        return np.array([self.order(int(p) // self.n_documents)[int(p) % self.n_documents] for p in positions])

    def next_batch(self, data: PaddedDocuments) -> Batch:
        batch = data.batch(self.starts(self.position), self.seq_len)
        self.position += 1
        return batch


# --------------------------------------------------------------------------------------------
# The corpus a run trains on


@dataclass
class TokenCorpus:
    """Prepared token shards split into train and validation documents, in one layout."""

    train: PaddedDocuments | TokenRange
    val: PaddedDocuments | TokenRange
    description: str
    tokenizer: Tokenizer
    layout: str
    vocab_size: int

    def make_sampler(self, config: TrainConfig, rank: int = 0, world_size: int = 1) -> RandomWindowSampler:
        if isinstance(self.train, PaddedDocuments):
            return PaddedDocumentSampler(self.train.n_documents, config.seq_len, config.batch_size, config.seed,
                                         rank, world_size)
        return RandomWindowSampler(len(self.train), config.seq_len, config.batch_size, config.seed, rank, world_size)

    def encode(self, text: str) -> list[int]:
        return document_prompt(self.tokenizer, text)

    def decode(self, ids) -> str:
        return self.tokenizer.decode_bytes(ids).decode("utf-8", errors="replace")


def token_folder(config: DataConfig) -> Path:
    """Where a token source's shards are (for builtin-tokens: in the cache, built or not)."""
    if config.source == "tokens":
        if not config.path:
            raise DataError("data.source=tokens needs data.path=FOLDER (from `attnlab data prepare`)")
        return Path(config.path)
    return builtin_folder(config) / f"tokens-v{config.vocab_size}"


def document_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Prompt ids for generation from a tokenized model: BOS then the text (its training documents
    start with BOS). Bytes that are not UTF-8 (surrogate-escaped, as a command line gives them) are
    encoded as bytes."""
    return [tokenizer.bos_id, *tokenizer.encode_bytes(text.encode("utf-8", "surrogateescape"))]


def load_token_corpus(config: DataConfig) -> TokenCorpus:
    folder = prepare_builtin_tokens(config) if config.source == "builtin-tokens" else token_folder(config)
    shards = TokenShards(folder)
    if not (folder / TOKENIZER_FOLDER / TOKENIZER_FILE).is_file():
        raise DataError(f"{folder}: its tokenizer ({TOKENIZER_FOLDER}/{TOKENIZER_FILE}) is missing: prepare the "
                        "folder again")
    tokenizer = Tokenizer(folder / TOKENIZER_FOLDER)
    if sha256_of(folder / TOKENIZER_FOLDER / TOKENIZER_FILE) != shards.meta["tokenizer_sha256"]:
        raise DataError(f"{folder}: the tokenizer beside the shards is not the one they were made with")
    if [tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id] != [shards.meta[key] for key in ("pad_id", "bos_id",
                                                                                                "eos_id")]:
        raise DataError(f"{folder}: the tokenizer beside the shards names other special tokens than they were "
                        f"made with ({TOKENIZER_FOLDER}/special_tokens_map.json): prepare the folder again")
    n_documents = shards.n_documents
    n_val = max(1, int(n_documents * config.val_fraction))
    if n_val >= n_documents:
        raise DataError(f"{folder} has {n_documents} documents: too few to hold out {n_val} for validation")
    n_train = n_documents - n_val
    token_bytes = token_byte_lengths(tokenizer)
    if config.layout == "padded":
        train: Any = PaddedDocuments(shards, 0, n_train, token_bytes)
        val: Any = PaddedDocuments(shards, n_train, n_documents, token_bytes)
    else:
        boundary = int(shards.offsets[n_train])
        train = TokenRange(shards, 0, boundary, token_bytes)
        val = TokenRange(shards, boundary, shards.n_tokens, token_bytes)
    description = (f"{folder} ({n_documents:,} documents, {shards.n_tokens:,} tokens, vocabulary "
                   f"{shards.meta['vocab_size']}, {config.layout} layout)")
    return TokenCorpus(train=train, val=val, description=description, tokenizer=tokenizer, layout=config.layout,
                       vocab_size=int(shards.meta["vocab_size"]))


# --------------------------------------------------------------------------------------------
# The built-in jsonl corpus and the demo pipeline


def builtin_folder(config: DataConfig) -> Path:
    return cache_dir(config) / f"builtin-jsonl-py{platform.python_version()}"


def stdlib_documents() -> list[str]:
    """One document per docstring of the standard library: "module.qualified.name" then the docstring."""
    root = Path(sysconfig.get_paths()["stdlib"])
    documents = []
    for path in stdlib_sources():
        parts = path.relative_to(root).with_suffix("").parts  # ("json", "decoder")
        if SKIPPED_FOLDERS.intersection(parts):
            continue
        try:
            with warnings.catch_warnings():  # invalid escape sequences in old sources: not our concern
                warnings.simplefilter("ignore")
                tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):  # a few deliberately broken files: skipped the same way everywhere
            continue
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        documents += _docstrings(tree, module)
    return documents


def _docstrings(tree: ast.AST, prefix: str) -> list[str]:
    """Docstrings of a module, class or function and of everything defined in it, in source order."""
    found = []
    docstring = ast.get_docstring(tree)  # type: ignore[arg-type]
    if docstring and len(docstring) >= MIN_DOCSTRING_CHARS:
        found.append(f"{prefix}\n\n{docstring}")
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            found += _docstrings(node, f"{prefix}.{node.name}")
    return found


def write_builtin_jsonl(config: DataConfig) -> Path:
    """The built-in corpus as jsonl in the cache (built once; meta.json marks it complete)."""
    folder = builtin_folder(config)
    path, meta_path = folder / "documents.jsonl", folder / "documents.meta.json"
    if path.is_file() and meta_path.is_file() and cached_jsonl_bytes(meta_path) == path.stat().st_size:
        log.info("built-in jsonl corpus: cached at %s", path)
        return path
    documents = stdlib_documents()
    if not documents:
        raise DataError("found no docstrings in the standard library for the built-in jsonl corpus")
    data = "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in documents).encode("utf-8")
    write_atomic(path, data)
    meta = {"python": platform.python_version(), "n_documents": len(documents), "bytes": len(data)}
    write_atomic(meta_path, (json.dumps(meta, indent=2) + "\n").encode())
    log.info("built-in jsonl corpus: %d documents, %d bytes -> %s", len(documents), len(data), path)
    return path


def cached_jsonl_bytes(meta_path: Path) -> int | None:
    """The size the built-in jsonl corpus's meta.json records; None when it is damaged (a warning:
    the corpus is a cache, built again)."""
    try:
        return read_meta_fields(meta_path, {"python": str, "n_documents": int, "bytes": int})["bytes"]
    except DataError as error:
        log.warning("%s; building the built-in jsonl corpus again", error)
        return None


def cached_meta(folder: Path) -> dict[str, Any]:
    """A cached token folder's meta.json; {} when it is missing or damaged (then it is built again)."""
    if not (folder / META_FILE).is_file():
        return {}
    try:
        return read_meta(folder)
    except DataError as error:
        log.warning("%s; building it again", error)
        return {}


def tokenizer_complete(tokenizer_dir: Path) -> bool:
    return (tokenizer_dir / "tokenizer_config.json").is_file()  # written last by train_tokenizer


def train_cached_tokenizer(corpus: Path, vocab_size: int, tokenizer_dir: Path) -> None:
    """Train the tokenizer of `corpus` into tokenizer_dir, staged in a folder of this process's own:
    runs started together on a fresh cache (a sweep) each train one, none deleting another's half-made
    folder; where another finished first, its tokenizer (the same: training is deterministic) is kept."""
    partial = tokenizer_dir.with_name(f".{tokenizer_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        train_tokenizer([corpus], vocab_size, partial)
        if not tokenizer_complete(tokenizer_dir):
            shutil.rmtree(tokenizer_dir, ignore_errors=True)  # a folder left half-made by a stopped run
            try:
                os.replace(partial, tokenizer_dir)
            except OSError:  # another run's tokenizer took the place since the check
                if not tokenizer_complete(tokenizer_dir):
                    raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def prepare_builtin_tokens(config: DataConfig, workers: int | None = None) -> Path:
    """jsonl corpus -> tokenizer -> shards, each stage skipped when its output is complete."""
    corpus = write_builtin_jsonl(config)
    tokenizer_dir = builtin_folder(config) / f"tokenizer-v{config.vocab_size}"
    if tokenizer_complete(tokenizer_dir):
        log.info("tokenizer: cached at %s", tokenizer_dir)
    else:
        train_cached_tokenizer(corpus, config.vocab_size, tokenizer_dir)
    shards_dir = token_folder(config)
    sha = sha256_of(tokenizer_dir / TOKENIZER_FILE)
    if cached_meta(shards_dir).get("tokenizer_sha256") == sha:
        log.info("token shards: cached at %s", shards_dir)
    else:
        prepare_token_shards([corpus], tokenizer_dir, shards_dir, workers=workers)
    return shards_dir
