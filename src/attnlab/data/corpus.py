"""One interface to every corpus, byte-level or tokenized, and the one place that picks the source.

`data.source` names the source: builtin, file and enwik8 are byte corpora (data/byte_corpus.py,
the tokens are the bytes 0..255); tokens and builtin-tokens are tokenized documents in prepared shards
(data/pretrain.py). Training, evaluation and sampling use only what `Corpus` names.

Sampling from a trained run needs the run's tokenizer but not its data: `tokenizer_for`,
`encode_prompt` and `decode_text` give it without loading (or building) the corpus.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from attnlab.config import DataConfig
from attnlab.data.byte_corpus import byte_prompt, decode_bytes, load_byte_corpus
from attnlab.data.pretrain import document_prompt, load_token_corpus, token_folder
from attnlab.data.shards import TOKENIZER_FOLDER
from attnlab.data.tokenizer import TOKENIZER_FILE, Tokenizer
from attnlab.errors import DataError

TOKEN_SOURCES = ("tokens", "builtin-tokens")  # data.source values of tokenized documents


class Corpus(Protocol):
    """What the trainer, the evaluator and the sampler read of a corpus (ByteCorpus, TokenCorpus)."""

    # Token streams (uint8 arrays, TokenRange) or documents (PaddedDocuments): data/sampler.py reads both
    train: Any
    val: Any
    description: str  # one line for logs: where the data is and how large

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Prompt ids for generation, the way training samples start."""
        ...

    def decode(self, ids: Iterable[int]) -> str: ...


def load_corpus(config: DataConfig) -> Corpus:
    """The corpus `config.source` names (a tokenized source may be built into the cache on first use)."""
    if config.source in TOKEN_SOURCES:
        return load_token_corpus(config)
    return load_byte_corpus(config)


def with_data_path(config: DataConfig, path: str) -> DataConfig:
    """The same data settings on other data: a byte file for a byte-level run, a folder of token shards
    (from `attnlab data prepare`) for a tokenized one."""
    source = "tokens" if config.source in TOKEN_SOURCES else "file"
    return dataclasses.replace(config, source=source, path=path)


def tokenizer_for(config: DataConfig, run_dir: Path | None = None) -> Tokenizer | None:
    """The tokenizer of a run's data: the copy in the run directory (RUN/tokenizer/, which training
    keeps), else the one beside its shards; None for byte-level data. DataError naming the files
    looked for when there is none."""
    if config.source not in TOKEN_SOURCES:
        return None
    folders = [] if run_dir is None else [Path(run_dir) / TOKENIZER_FOLDER]
    if config.source == "builtin-tokens" or config.path:
        folders.append(token_folder(config) / TOKENIZER_FOLDER)
    for folder in folders:
        if (folder / TOKENIZER_FILE).is_file():
            return Tokenizer(folder)
    looked = " and no ".join(str(folder / TOKENIZER_FILE) for folder in folders) or "RUN/tokenizer/ (no run given)"
    raise DataError(f"the run's tokenizer is missing: no {looked}")


def encode_prompt(tokenizer: Tokenizer | None, text: str) -> list[int]:
    """Prompt ids for generation: BOS then the text for a tokenized run, the text's bytes for a
    byte-level run (as Corpus.encode, without loading the corpus)."""
    return byte_prompt(text) if tokenizer is None else document_prompt(tokenizer, text)


def decode_text(tokenizer: Tokenizer | None, ids: Iterable[int]) -> str:
    """Generated ids as text, as Corpus.decode gives them, without loading the corpus: bytes that are
    not UTF-8, and ids past the vocabulary (a model with more ids than its tokenizer or than 256
    bytes can draw one), as U+FFFD."""
    if tokenizer is None:
        return decode_bytes(ids)
    return tokenizer.decode_bytes(ids).decode("utf-8", errors="replace")
