"""Norms, feed-forward networks and embeddings, each chosen by name through a registry.

Legend: B batch, T tokens, E embedding width, dim model width, F feed-forward hidden width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.config import ModelConfig
from attnlab.registry import FEED_FORWARD, NORM

NORM.register("layernorm")(nn.LayerNorm)
NORM.register("rmsnorm")(nn.RMSNorm)


def hidden_width(config: ModelConfig, gated: bool) -> int:
    """Feed-forward hidden width; gated units use 2/3 of it so the parameter count matches.
    ff_hidden, when set, is taken as is (an imported checkpoint's intermediate_size)."""
    if config.ff_hidden is not None:
        return config.ff_hidden
    width = config.ff_mult * config.dim * (2 / 3 if gated else 1)
    return int(width)


@FEED_FORWARD.register("gelu")
class GeluMLP(nn.Module):
    """dim -> F -> dim with a GELU between (GPT-2)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = hidden_width(config, gated=False)
        self.up = nn.Linear(config.dim, hidden)
        self.down = nn.Linear(hidden, config.dim)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        y = self.down(F.gelu(self.up(x)))
        return self.dropout(y) if self.training else y  # dropout is the identity in eval mode


@FEED_FORWARD.register("swiglu")
class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer, "GLU Variants Improve Transformer", arXiv 2002.05202)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = hidden_width(config, gated=True)
        self.gate = nn.Linear(config.dim, hidden, bias=False)
        self.up = nn.Linear(config.dim, hidden, bias=False)
        self.down = nn.Linear(hidden, config.dim, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        y = self.down(F.silu(self.gate(x)) * self.up(x))
        return self.dropout(y) if self.training else y  # dropout is the identity in eval mode


class Chunked(nn.Module):
    """Apply a position-wise module to `n_chunks` slices of the sequence in turn, so the hidden
    activations of only one slice are alive at a time (the seeds' `ff_chunks`)."""

    def __init__(self, inner: nn.Module, n_chunks: int) -> None:
        super().__init__()
        self.inner, self.n_chunks = inner, n_chunks

    def forward(self, x: Tensor) -> Tensor:
        if self.n_chunks <= 1 or x.shape[1] <= 1:
            return self.inner(x)
        return torch.cat([self.inner(part) for part in x.chunk(self.n_chunks, dim=1)], dim=1)


class TokenEmbedding(nn.Module):
    """Token ids -> dim, optionally factorised through a narrower width E (seed 001: E = 128)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        width = config.emb_dim or config.dim
        self.embed = nn.Embedding(config.num_tokens, width)
        self.project = nn.Linear(width, config.dim, bias=False) if config.emb_dim else nn.Identity()

    def forward(self, tokens: Tensor) -> Tensor:
        return self.project(self.embed(tokens))  # [B, T] -> [B, T, dim]


