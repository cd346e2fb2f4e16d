"""Evaluation: mean next-token loss, bits per token (per byte for byte-level data) and perplexity,
over a fixed, seeded set of validation windows, so the same model always gets the same numbers."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from attnlab.data.sampler import eval_windows
from attnlab.model.transformer import Transformer


@dataclass
class EvalResult:
    loss: float  # mean cross-entropy in nats per token
    bits_per_token: float  # loss / ln 2; bits per byte (and per character of ASCII) for byte data
    perplexity: float
    n_windows: int
    n_tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def evaluate(
    model: Transformer,
    data: np.ndarray,
    seq_len: int,
    n_windows: int,
    batch_size: int,
    seed: int = 1234,
    autocast_dtype: torch.dtype | None = None,
) -> EvalResult:
    """Loss over `n_windows` windows of seq_len + 1 tokens drawn with `seed` from `data`."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    windows = eval_windows(data, seq_len, n_windows, seed)  # [n_windows, seq_len + 1]
    total, count = 0.0, 0
    for start in range(0, n_windows, batch_size):
        batch = windows[start : start + batch_size].to(device)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            output = model(batch[:, :-1], targets=batch[:, 1:])
        n = batch[:, 1:].numel()
        total += output.lm_loss.item() * n
        count += n
    model.train(was_training)
    loss = total / count
    return EvalResult(
        loss=loss, bits_per_token=loss / math.log(2), perplexity=math.exp(min(loss, 50.0)),
        n_windows=n_windows, n_tokens=count,
    )
