"""Byte-level BPE tokenizer (GPT-2 style) trained with Hugging Face `tokenizers`, as MiniMind's
`train_tokenizer.py` does: vocabulary 6400, special tokens first.

Special tokens and ids (MiniMind's): 0 `<|endoftext|>` padding (and unknown), 1 `<|im_start|>`
beginning of text, 2 `<|im_end|>` end of text. The 256 byte symbols are always in the vocabulary
(the trainer's initial alphabet), so every text and every byte string is encodable.

Saved as a standard `tokenizer.json` plus `tokenizer_config.json` and `special_tokens_map.json`, so
`transformers.PreTrainedTokenizerFast.from_pretrained(DIR)` (and AutoTokenizer) load it.

Round trips: `decode(encode(text)) == text` for any str of valid UTF-8 (no normaliser, no prefix
space, special tokens kept when decoding), and `decode_bytes(encode_bytes(data)) == data` for any
bytes: invalid UTF-8 bytes are encoded as their single byte symbols.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path

from attnlab.data.jsonl import read_texts
from attnlab.errors import DataError

log = logging.getLogger(__name__)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]  # ids 0, 1, 2 in this order
TOKENIZER_FILE = "tokenizer.json"


def _tokenizers():
    try:
        import tokenizers
    except ImportError as error:  # an optional dependency: the byte-level models do not need it
        raise DataError("the tokenizer needs Hugging Face tokenizers: pip install 'attnlab[tokenizer]'") from error
    return tokenizers


@lru_cache(maxsize=1)
def byte_symbols() -> tuple[dict[int, str], dict[str, int]]:
    """GPT-2's reversible byte -> printable character table (Radford et al. 2019, `bytes_to_unicode`)
    and its inverse: the alphabet byte-level BPE works in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    characters = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    forward = {byte: chr(code) for byte, code in zip(printable, characters)}
    return forward, {symbol: byte for byte, symbol in forward.items()}


def texts_of(paths: Iterable[Path]) -> Iterator[str]:
    """Documents of the input files: the "text" of each line of .jsonl files, the whole of others."""
    for path in paths:
        path = Path(path)
        if path.suffix == ".jsonl":
            yield from read_texts(path)
        elif path.is_file():
            yield path.read_text(encoding="utf-8", errors="replace")
        else:
            raise DataError(f"input file {path} does not exist")


def train_tokenizer(inputs: list[Path], vocab_size: int, out_dir: Path, max_seq_len: int = 512) -> Path:
    """Train byte-level BPE on `inputs` (jsonl or text files); write the tokenizer files to out_dir."""
    tokenizers = _tokenizers()
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise DataError(f"--vocab-size {vocab_size} is too small: 256 bytes + {len(SPECIAL_TOKENS)} special tokens")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, always encodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts_of(inputs), trainer=trainer)
    for index, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != index:
            raise DataError(f"special token {token} did not get id {index}")  # the trainer's documented order
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / TOKENIZER_FILE))
    special_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": PAD_TOKEN}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_seq_len,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **special_map,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    log.info("trained byte-level BPE, %d tokens -> %s", tokenizer.get_vocab_size(), out_dir)
    return out_dir


class Tokenizer:
    """A trained tokenizer: text <-> ids, bytes <-> ids."""

    def __init__(self, folder: Path) -> None:
        path = Path(folder) / TOKENIZER_FILE
        if not path.is_file():
            raise DataError(f"no {TOKENIZER_FILE} in {folder}: train one with `attnlab tokenizer train`")
        self.folder = Path(folder)
        self.backend = _tokenizers().Tokenizer.from_file(str(path))
        self.pad_id, self.bos_id, self.eos_id = (self.backend.token_to_id(t) for t in SPECIAL_TOKENS)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once (the Rust library parallelises over them)."""
        return [encoding.ids for encoding in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_bytes(self, data: bytes) -> list[int]:
        """Any bytes: valid UTF-8 runs are encoded as text, each other byte as its byte symbol."""
        symbol_of, _ = byte_symbols()
        ids: list[int] = []
        position = 0
        while position < len(data):
            try:
                ids += self.encode(data[position:].decode("utf-8"))
                break
            except UnicodeDecodeError as error:
                ids += self.encode(data[position : position + error.start].decode("utf-8"))
                for byte in data[position + error.start : position + error.end]:
                    ids.append(self.backend.token_to_id(symbol_of[byte]))
                position += error.end
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Exact inverse of encode_bytes (special tokens come back as their UTF-8 text)."""
        _, byte_of = byte_symbols()
        pieces = []
        for index in ids:
            token = self.backend.id_to_token(int(index))
            if token in SPECIAL_TOKENS:
                pieces.append(token.encode("utf-8"))
            else:
                pieces.append(bytes(byte_of[symbol] for symbol in token))
        return b"".join(pieces)
