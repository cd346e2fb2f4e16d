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

Any other Hugging Face `tokenizer.json` loads too (`Tokenizer(folder, special_tokens)`): its
padding, beginning- and end-of-text tokens are the ones named explicitly, else in the folder's
`special_tokens_map.json` / `tokenizer_config.json`, else MiniMind's, else well-known names
(`</s>`, `<|endoftext|>`, ...); without a beginning or padding token the end token serves (GPT-2's
way), without an end token it is an error that says how to name one. A tokenizer that is not
byte-level BPE (SentencePiece's `▁` and `<0xNN>` pieces, say) gives each token's bytes from its
text, so streamed text and bits per byte are close but not exact for it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from attnlab.data.files import write_atomic
from attnlab.data.jsonl import SkipCounter, read_texts
from attnlab.errors import DataError

log = logging.getLogger(__name__)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]  # ids 0, 1, 2 in this order
TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
MIN_VOCAB = 256 + len(SPECIAL_TOKENS) + 1  # the bytes, the special tokens and one merge
MAX_VOCAB = 1 << 22  # beyond any real vocabulary; the BPE trainer sizes its tables by it (a huge one aborts)
ROLES = ("pad", "bos", "eos")
# where the role's token is not named: MiniMind's, then names other tokenizers use, in this order
KNOWN_NAMES = {
    "pad": [PAD_TOKEN, "<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>"],
    "bos": [BOS_TOKEN, "<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]"],
    "eos": [EOS_TOKEN, "</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]"],
}
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


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


def texts_of(paths: Iterable[Path], skip_bad: bool = False, skipped: SkipCounter | None = None) -> Iterator[str]:
    """Documents of the input files: the "text" of each line of .jsonl files (the suffix in any
    case; skip_bad, skipped: read_texts'), the whole of others."""
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"input file {path} {'is not a regular file' if path.exists() else 'does not exist'}")
        if path.suffix.lower() == ".jsonl":
            yield from read_texts(path, skip_bad, skipped)
        elif path.stat().st_size:
            yield path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(inputs: list[Path], vocab_size: int, out_dir: Path, max_seq_len: int = 512,
                    progress: bool = False, skip_bad: bool = False) -> Path:
    """Train byte-level BPE on `inputs` (jsonl or text files); write the tokenizer files to out_dir.
    progress: a bar counting the documents read, then the trainer's own (on a terminal). skip_bad:
    malformed jsonl lines are skipped (counted in the log) rather than an error, as `data prepare
    --skip-bad` skips them, so the files it accepts train a tokenizer too."""
    from tqdm import tqdm

    tokenizers = _tokenizers()
    if vocab_size < MIN_VOCAB:
        raise DataError(f"--vocab-size {vocab_size} is too small: 256 bytes + {len(SPECIAL_TOKENS)} special tokens")
    if vocab_size > MAX_VOCAB:
        raise DataError(f"--vocab-size {vocab_size} is larger than any vocabulary attnlab trains (at most {MAX_VOCAB})")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"--out {out_dir} is a file, not a folder")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, always encodable
        show_progress=progress,
    )
    n_documents, skipped = 0, SkipCounter()

    def documents() -> Iterator[str]:
        nonlocal n_documents
        for text in tqdm(texts_of(inputs, skip_bad, skipped), desc="reading documents", unit=" documents",
                         disable=not progress):
            n_documents += 1
            yield text

    tokenizer.train_from_iterator(documents(), trainer=trainer)
    if skipped.count:
        log.warning("skipped %d malformed lines, first: %s", skipped.count, skipped.examples[0])
    if n_documents == 0:
        raise DataError(f"no documents in {', '.join(map(str, inputs))}")
    for index, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != index:
            raise DataError(f"special token {token} did not get id {index}")  # the trainer's documented order
    out_dir.mkdir(parents=True, exist_ok=True)
    # each file atomic: a folder trained again in place is never left with half a file
    write_atomic(out_dir / TOKENIZER_FILE, tokenizer.to_str(pretty=True).encode())  # as tokenizer.save writes
    special_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": PAD_TOKEN}
    write_atomic(out_dir / SPECIAL_TOKENS_FILE, (json.dumps(special_map, indent=2) + "\n").encode())
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_seq_len,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **special_map,
    }
    write_atomic(out_dir / "tokenizer_config.json", (json.dumps(tokenizer_config, indent=2) + "\n").encode())
    n_tokens = tokenizer.get_vocab_size()
    if n_tokens < vocab_size:  # the trainer stops when no pair of tokens is left to merge
        log.warning("--vocab-size %d: the documents gave only %d tokens (no more pairs to merge); train on it with "
                    "model.num_tokens=%d (a larger one spends parameters on ids that never occur)",
                    vocab_size, n_tokens, n_tokens)
    log.info("trained byte-level BPE, %d tokens -> %s", n_tokens, out_dir)
    return out_dir


def _named_tokens(folder: Path) -> dict[str, str]:
    """The special tokens a Hugging Face tokenizer folder names: {"bos": "<s>", ...} (strings or
    {"content": ...} objects, in special_tokens_map.json or tokenizer_config.json)."""
    named: dict[str, str] = {}
    for name in ("tokenizer_config.json", SPECIAL_TOKENS_FILE):  # the second wins
        path = folder / name
        if not path.is_file():
            continue
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            raise DataError(f"{path}: not valid JSON ({error})") from error
        for role in ROLES:
            value = values.get(f"{role}_token") if isinstance(values, dict) else None
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                named[role] = value
    return named


class Tokenizer:
    """A trained tokenizer: text <-> ids, bytes <-> ids.

    special_tokens: {"pad"|"bos"|"eos": token text} naming the roles explicitly (`attnlab data
    prepare --eos-token ...`); the rest are found as the module docstring says."""

    def __init__(self, folder: Path, special_tokens: dict[str, str] | None = None) -> None:
        path = Path(folder) / TOKENIZER_FILE
        if not path.is_file():
            raise DataError(f"no {TOKENIZER_FILE} in {folder}: train one with `attnlab tokenizer train`")
        self.folder = Path(folder)
        try:
            self.backend = _tokenizers().Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust library raises a bare Exception for any malformed file
            reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
            raise DataError(f"{path}: not a tokenizer the tokenizers library reads ({reason})") from error
        self.special_tokens = self._resolve_special_tokens(special_tokens or {})
        self.pad_id, self.bos_id, self.eos_id = (self.backend.token_to_id(self.special_tokens[r]) for r in ROLES)
        vocabulary = self.backend.get_vocab(with_added_tokens=True)  # token -> id
        added = {token.content for token in self.backend.get_added_tokens_decoder().values() if token.special}
        self.special_ids = {vocabulary[token] for token in added | set(self.special_tokens.values())}
        # byte-level BPE (GPT-2's, MiniMind's): tokens are spelled in the byte alphabet, their bytes exact
        self.byte_level = "ByteLevel" in json.dumps(json.loads(self.backend.to_str()).get("decoder"))

    def _resolve_special_tokens(self, given: dict[str, str]) -> dict[str, str]:
        named = {**_named_tokens(self.folder), **{role: token for role, token in given.items() if token}}
        chosen: dict[str, str] = {}
        for role in ROLES:
            if role in named:
                if self.backend.token_to_id(named[role]) is None:
                    raise DataError(f"{self.folder}: the {role} token {named[role]!r} is not in its vocabulary")
                chosen[role] = named[role]
                continue
            found = [token for token in KNOWN_NAMES[role] if self.backend.token_to_id(token) is not None]
            if found:
                chosen[role] = found[0]
        if "eos" not in chosen:
            raise DataError(f"{self.folder / TOKENIZER_FILE} has no end-of-text token attnlab knows (such as "
                            f"{EOS_TOKEN} or </s>): name it with --eos-token TOKEN")
        for role in ("bos", "pad"):  # GPT-2's way: documents start with, and are padded by, the end token
            chosen.setdefault(role, chosen["eos"])
        return chosen

    def check_ids(self, ids: list[int]) -> list[int]:
        """`ids` if every one is in the vocabulary, else DataError."""
        bad = [index for index in ids if not 0 <= index < self.vocab_size]
        if bad:
            raise DataError(f"token id {bad[0]} is not in the vocabulary of {self.folder} (0 to {self.vocab_size - 1})")
        return ids

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once (the Rust library parallelises over them)."""
        return [encoding.ids for encoding in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(self.check_ids([int(i) for i in ids]), skip_special_tokens=False)

    def encode_bytes(self, data: bytes) -> list[int]:
        """Any bytes: valid UTF-8 runs are encoded as text, each other byte as its byte symbol (for a
        tokenizer that is not byte-level, as the replacement character)."""
        if not self.byte_level:
            return self.encode(data.decode("utf-8", errors="replace"))
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
                    index = self.backend.token_to_id(symbol_of[byte])  # None: a vocabulary without that byte
                    ids += [index] if index is not None else self.encode("\ufffd")
                position += error.end
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Exact inverse of encode_bytes for byte-level BPE (special tokens come back as their UTF-8
        text); for other tokenizers each token's own text (`▁` as a space, `<0xNN>` as its byte).
        An id past the vocabulary comes out as U+FFFD's bytes: a model with more ids than its
        tokenizer (model.num_tokens 6400 on a tokenizer that came out smaller) can draw one, as a
        byte-level model can draw an id past 255, and its samples must still print."""
        from attnlab.data.byte_corpus import REPLACEMENT  # here: the CLI's parser imports this module, not numpy

        _, byte_of = byte_symbols()
        ids = [int(i) for i in ids]
        self.check_ids([index for index in ids if index < self.vocab_size])  # a negative id is an error
        pieces = []
        for index in ids:
            if index >= self.vocab_size:
                pieces.append(REPLACEMENT)
                continue
            token = self.backend.id_to_token(index)
            if index in self.special_ids:
                pieces.append(token.encode("utf-8"))
            elif self.byte_level:
                pieces.append(bytes(byte_of[symbol] for symbol in token))
            elif byte := BYTE_PIECE.fullmatch(token):
                pieces.append(bytes([int(byte.group(1), 16)]))
            else:
                pieces.append(token.replace("\u2581", " ").encode("utf-8"))
        return b"".join(pieces)

    def save_special_tokens(self, folder: Path) -> None:
        """Write the roles' tokens into `folder`'s special_tokens_map.json (a copy of this tokenizer),
        so that loading the copy finds the same ones without being told."""
        path = Path(folder) / SPECIAL_TOKENS_FILE
        values: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        values.update({f"{role}_token": token for role, token in self.special_tokens.items()})
        write_atomic(path, (json.dumps(values, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))
