"""Random windows of seq_len + 1 tokens, as the seeds sample them, with exactly resumable state.

The sampler is counter-based: the window starts of global batch i are drawn from a generator
seeded with (seed, i). Its whole state is the batch counter, so a resumed run draws exactly the
batches an uninterrupted one would, and ranks of a distributed run take disjoint slices of the
same global batch (their union is the single-process batch of batch_size * world_size windows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attnlab.config import TrainConfig
from attnlab.errors import DataError

log = logging.getLogger(__name__)


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T + 1] int64: inputs are tokens[:, :-1], targets tokens[:, 1:]
    loss_mask: torch.Tensor | None = None  # [B, T], 0 where a target must not count (padding)


def fetch_windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    """[len(starts), seq_len + 1] int64 windows of `data` beginning at `starts`."""
    offsets = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(np.asarray(data[offsets.ravel()], dtype=np.int64).reshape(offsets.shape))


def _check_length(n_tokens: int, seq_len: int, split: str) -> None:
    """DataError naming the split (training or validation) that is too short for one window: a
    packed corpus may have plenty of training tokens and a validation split of a few."""
    if n_tokens < seq_len + 2:
        raise DataError(
            f"the {split} split has {n_tokens} tokens; windows of seq_len + 1 = {seq_len + 1} need at least "
            f"{seq_len + 2} (give more data, a shorter train.seq_len, or another data.val_fraction)"
        )


class RandomWindowSampler:
    unit = "tokens"  # what the training split is counted in (its `size`)

    def __init__(
        self, n_tokens: int, seq_len: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        _check_length(n_tokens, seq_len, "training")
        self.n_tokens, self.seq_len, self.batch_size, self.seed = n_tokens, seq_len, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.position = 0  # index of the next global batch

    def starts(self, index: int) -> np.ndarray:
        """This rank's window starts in global batch `index`."""
        generator = np.random.default_rng([self.seed, index])
        every = generator.integers(0, self.n_tokens - self.seq_len - 1, size=self.batch_size * self.world_size)
        return every[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]

    def next_batch(self, data: np.ndarray) -> Batch:
        """[batch_size, seq_len + 1] token windows; advances the position."""
        batch = fetch_windows(data, self.starts(self.position), self.seq_len)
        self.position += 1
        return Batch(tokens=batch)

    @property
    def size(self) -> int:
        """The training split's size in `unit`s: the batches a position gives depend on it."""
        return self.n_tokens

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "world_size": self.world_size, "split": [self.size, self.unit]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "seq_len", "batch_size", "world_size"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"checkpoint's data sampler has {key}={state[key]} but this run has {getattr(self, key)}; "
                    f"resume with the same train.{key if key != 'world_size' else 'world size'}"
                )
        # other data (prepared again, another split or layout) is a choice a run may make: said, not refused;
        # said once, by rank 0 (every rank reads the same data)
        if "split" in state and list(state["split"]) != [self.size, self.unit] and self.rank == 0:
            size, unit = state["split"]
            log.warning("the training split has %d %s where the checkpoint's had %d %s: the run goes on with "
                        "other batches than an uninterrupted run would have read", self.size, self.unit, size, unit)
        self.position = int(state["position"])


def eval_windows(data: np.ndarray, seq_len: int, n_windows: int, seed: int = 1234) -> torch.Tensor:
    """Deterministic evaluation windows [n_windows, seq_len + 1] at seeded random starts."""
    _check_length(len(data), seq_len, "validation")
    starts = np.random.default_rng(seed).integers(0, len(data) - seq_len - 1, size=n_windows)
    return fetch_windows(data, starts, seq_len)


def check_eval_split(data: Any, seq_len: int) -> None:
    """eval_batch's DataError for a validation split too short for one window, raised when a run
    starts: a resumed run evaluates first after train.eval_every steps (on other data than its
    checkpoint's, e.g. another data.layout, the split may be new), which the error would lose.
    Padded documents fit any seq_len (data/pretrain.py)."""
    if not hasattr(data, "eval_batch"):
        _check_length(len(data), seq_len, "validation")


def make_sampler(corpus: Any, config: TrainConfig, rank: int = 0, world_size: int = 1) -> RandomWindowSampler:
    """The training sampler for a corpus: its own (token corpora: by layout, data/pretrain.py), else
    random windows over its token stream."""
    if hasattr(corpus, "make_sampler"):
        return corpus.make_sampler(config, rank, world_size)
    return RandomWindowSampler(len(corpus.train), config.seq_len, config.batch_size, config.seed, rank, world_size)


def eval_batch(data: Any, seq_len: int, n_windows: int, seed: int = 1234) -> Batch:
    """Deterministic evaluation samples of a validation split: its own (padded documents with their
    loss mask, data/pretrain.py) or random windows of its token stream."""
    if hasattr(data, "eval_batch"):
        return data.eval_batch(seq_len, n_windows, seed)
    return Batch(tokens=eval_windows(data, seq_len, n_windows, seed))


def prime_tokens(data: Any, length: int, seed: int) -> torch.Tensor:
    """[P] int64, P <= length: a prime for sampling, taken from a validation split (shorter than
    `length` where the split is, as a document may be: a sample is no reason to stop a run)."""
    if hasattr(data, "prime"):
        return data.prime(length, seed)
    length = max(1, min(length, len(data) - 2))  # eval_windows' windows of length + 1 need length + 2 tokens
    return eval_windows(data, length, 1, seed=seed)[0, :length]


def randomly_truncate(batch: Batch, seed: int, index: int, probability: float = 0.1) -> Batch:
    """Seed 000's `randomly_truncate_sequence`: with `probability`, cut the whole micro-batch to a
    random length of 2..T+1 tokens, so the model also trains on short contexts. The draw depends only
    on (seed, index), like the windows, so resumed runs truncate the same batches the same way."""
    generator = np.random.default_rng([seed, index, 7])  # 7: a stream apart from the window starts
    if generator.random() >= probability:
        return batch
    length = int(generator.integers(2, batch.tokens.shape[1] + 1))
    mask = None if batch.loss_mask is None else batch.loss_mask[:, : length - 1]
    return Batch(tokens=batch.tokens[:, :length], loss_mask=mask)
