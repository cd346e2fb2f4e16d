"""Evaluation: mean next-token loss, bits per token, bits per byte and perplexity, over a fixed,
seeded set of validation windows (or padded documents), so the same model always gets the same numbers.

Bits per byte of tokenized data: the summed loss in bits over the UTF-8 bytes the counted targets
decode to (special tokens count 0 bytes), so it is comparable with byte-level models."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from attnlab.attention.routing import routing_stats
from attnlab.data.corpus import load_corpus, with_data_path
from attnlab.data.sampler import eval_batch
from attnlab.errors import ConfigError, DataError
from attnlab.generate.sampling import check_length
from attnlab.model.modes import eval_mode
from attnlab.model.transformer import Transformer
from attnlab.train.checkpoint import load_model


@dataclass
class EvalResult:
    loss: float  # mean cross-entropy in nats per token
    bits_per_token: float  # loss / ln 2; bits per byte (and per character of ASCII) for byte data
    perplexity: float
    n_windows: int
    n_tokens: int  # targets counted (padding excluded)
    bits_per_byte: float | None = None  # equal to bits_per_token for byte data

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def evaluate(
    model: Transformer,
    data: np.ndarray,  # or a validation split with eval_batch / token_bytes (data/pretrain.py)
    seq_len: int,
    n_windows: int,
    batch_size: int,
    seed: int = 1234,
    autocast_dtype: torch.dtype | None = None,
    progress: bool = False,
) -> EvalResult:
    """Loss over `n_windows` windows of seq_len + 1 tokens drawn with `seed` from `data`.
    progress: a bar over the windows (stderr)."""
    for name, value in (("windows", n_windows), ("seq_len", seq_len), ("batch_size", batch_size)):
        if value < 1:
            raise ConfigError(f"evaluation needs {name} >= 1, got {value}")
    check_length(model, seq_len, "evaluation windows of seq_len")
    with eval_mode(model):  # each module's own mode restored afterwards, also on an error
        device = next(model.parameters()).device
        samples = eval_batch(data, seq_len, n_windows, seed)  # tokens [n_windows, seq_len + 1], mask or None
        token_bytes = getattr(data, "token_bytes", None)  # [V] bytes per id; None: one byte per token
        if token_bytes is not None:
            token_bytes = torch.from_numpy(token_bytes)  # once, not per batch
        total, count, n_bytes = 0.0, 0, 0
        bar = tqdm(total=n_windows, desc="evaluating", unit=" windows", disable=not progress)
        for start in range(0, n_windows, batch_size):
            bar.update(min(batch_size, n_windows - start))
            batch = samples.tokens[start : start + batch_size].to(device)
            mask = None if samples.loss_mask is None else samples.loss_mask[start : start + batch_size].to(device)
            autocast = torch.autocast(device.type, dtype=autocast_dtype or torch.float32,
                                      enabled=autocast_dtype is not None)
            with autocast:
                output = model(batch[:, :-1], targets=batch[:, 1:], loss_mask=mask)
            counted = torch.ones_like(batch[:, 1:]) if mask is None else mask  # [B, T]
            n = int(counted.sum())
            total += output.lm_loss.item() * n  # lm_loss is the mean over the counted targets
            count += n
            if token_bytes is None:
                n_bytes += n
            else:
                n_bytes += int((token_bytes[batch[:, 1:].cpu()] * counted.cpu()).sum())
        bar.close()
    if count == 0:
        raise DataError("the validation windows hold no target to score (every one is padding)")
    loss = total / count
    return EvalResult(
        loss=loss, bits_per_token=loss / math.log(2), perplexity=math.exp(min(loss, 50.0)),
        n_windows=n_windows, n_tokens=count, bits_per_byte=total / math.log(2) / max(n_bytes, 1),
    )


def evaluate_run(
    run: str | Path,
    n_windows: int = 64,
    seq_len: int | None = None,
    batch_size: int = 8,
    seed: int = 1234,
    data_path: str | None = None,
    weights: str = "auto",
    device: str = "cpu",
    progress: bool = False,
) -> dict[str, Any]:
    """The record `attnlab eval RUN --json` prints: the run's checkpoint evaluated on its validation
    data (or on `data_path`'s: a byte file, or token shards for a tokenized run) over `n_windows`
    windows of seq_len (default: the run's), with routing statistics when the model routes."""
    model = load_model(run, device=device, weights=weights)
    config = model.run_config
    data_config = config.data if data_path is None else with_data_path(config.data, data_path)
    corpus = load_corpus(data_config)
    if corpus.vocab_size > model.config.num_tokens:  # ids past the embedding: name the mismatch, do not index
        raise DataError(f"{corpus.description}: its vocabulary has {corpus.vocab_size} tokens, the model's "
                        f"{model.config.num_tokens} (model.num_tokens): it was not trained on this kind of data")
    seq_len = seq_len or config.train.seq_len
    result = evaluate(model, corpus.val, seq_len, n_windows, batch_size, seed=seed, progress=progress)
    report = {"run": str(run), "step": model.checkpoint_step, "data": corpus.description, "seq_len": seq_len,
              **result.as_dict()}
    windows = eval_batch(corpus.val, seq_len, min(n_windows, batch_size), seed).tokens
    routing = routing_stats(model, windows[:, :-1].to(device))  # empty unless the model routes
    if routing:
        report["routing"] = routing
    return report
