"""The autoregressive Transformer: embeddings, a stack of pre-norm blocks, an output head.

Attention, feed-forward and norm are chosen by name from their registries. The same model runs
in parallel over a whole sequence (training) or incrementally with a cache (decoding):

    model(tokens)                                     -> ModelOutput(logits)
    model(tokens, targets=targets)                    -> ModelOutput(logits, loss, aux_losses)
    cache = model.new_cache(batch_size, max_len); model(next_tokens, cache=cache)

Legend: B batch, T tokens, V vocabulary, dim model width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnlab.attention  # noqa: F401  (registers the attention variants)
import attnlab.model.moe  # noqa: F401  (registers the mixture-of-experts feed-forward)
from attnlab.attention.base import AttentionSpec, KVCache, RotaryEmbedding, RowLengths
from attnlab.config import ModelConfig
from attnlab.errors import ConfigError
from attnlab.model.layers import Chunked, TokenEmbedding
from attnlab.model.loss import IGNORE_INDEX, chunked_linear_cross_entropy  # IGNORE_INDEX: padding, masked
from attnlab.model.reversible import reversible_blocks
from attnlab.registry import ATTENTION, FEED_FORWARD, NORM


@dataclass
class ModelOutput:
    logits: Tensor | None  # [B, T, V]; None when targets are given and model.loss_chunk_size > 0
    loss: Tensor | None = None  # lm_loss + every auxiliary loss (already weighted)
    lm_loss: Tensor | None = None  # mean next-token cross-entropy over unmasked targets
    aux_losses: dict[str, Tensor] = field(default_factory=dict)  # by name, summed over layers


class ModelCache:
    """One KVCache per layer, advanced together."""

    def __init__(self, layers: list[KVCache], max_len: int) -> None:
        self.layers = layers
        self.max_len = max_len

    @property
    def length(self) -> int:
        """Tokens fed (the longest row's, after truncate_rows)."""
        return self.layers[0].length

    @property
    def offset(self) -> int | Tensor:
        """The position of the next token: an int, or [B] per row after truncate_rows."""
        return self.layers[0].offset

    @property
    def per_row_rollback(self) -> bool:
        """Whether every layer can roll rows back to lengths of their own (truncate_rows)."""
        return all(layer.per_row_rollback for layer in self.layers)

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.truncate(length)

    def truncate_rows(self, lengths: Tensor) -> None:
        """Roll row b back to its first lengths[b] tokens (speculative decoding's per-row rollback)."""
        offset = self.offset
        longest, invalid = torch.stack((lengths.max(), ((lengths < 0) | (lengths > offset)).any())).tolist()
        if invalid:
            current = offset if isinstance(offset, int) else offset.tolist()
            raise ValueError(f"cannot truncate rows of lengths {current} to {lengths.tolist()}")
        rows = RowLengths(lengths.to(dtype=torch.long), longest)  # one object for every layer
        for layer in self.layers:
            layer.truncate_rows(rows)


def token_positions(cache: ModelCache | None, n_tokens: int, device: torch.device) -> Tensor:
    """Positions of the next n_tokens fed through `cache` (from 0 without one): [T], or [B, T]
    when its rows differ in length (learned position embeddings look them up)."""
    steps = torch.arange(n_tokens, device=device)
    if cache is None:
        return steps
    offset = cache.offset
    return offset + steps if isinstance(offset, int) else offset[:, None] + steps


def make_norm(config: ModelConfig) -> nn.Module:
    """The configured norm over dim; norm_eps None keeps the norm's own default epsilon."""
    norm_class = NORM.get(config.norm)
    if config.norm_eps is None:
        return norm_class(config.dim)
    return norm_class(config.dim, eps=config.norm_eps)


class Block(nn.Module):
    """x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, config: ModelConfig, layer_index: int, rotary: RotaryEmbedding | None) -> None:
        super().__init__()
        spec = AttentionSpec(
            dim=config.dim,
            n_heads=config.heads,
            dim_head=config.dim_head,
            n_kv_heads=config.n_kv_heads,
            dropout=config.attention.dropout,
            max_seq_len=config.max_seq_len,
            layer_index=layer_index,
            n_layers=config.depth,
            rotary=rotary,
        )
        attention_class = ATTENTION.get(config.attention.kind)
        # a variant named X reads its options, of its config_class, from `attention.X`
        variant_config = getattr(config.attention, config.attention.kind, None)
        expected = attention_class.config_class
        if variant_config is not None and expected is not None and not isinstance(variant_config, expected):
            raise ConfigError(f"model.attention.{config.attention.kind} must hold a "
                              f"{attention_class.config_class.__name__}; add it to AttentionConfig")
        self.attention_norm = make_norm(config)
        self.attention = attention_class(spec, variant_config)
        self.feed_forward_norm = make_norm(config)
        self.feed_forward = Chunked(FEED_FORWARD.get(config.feed_forward)(config), config.ff_chunks)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        attended = self.attention(self.attention_norm(x), cache)
        if self.training:  # dropout is the identity in eval mode: skip its call when decoding
            attended = self.dropout(attended)
        x = x + attended
        return x + self.feed_forward(self.feed_forward_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        rotary = None
        if config.position == "rotary":
            rotary = RotaryEmbedding(config.dim_head, config.rope_theta, config.max_seq_len)
        self.rotary = rotary
        self.token_embedding = TokenEmbedding(config)
        self.position_embedding = (
            nn.Embedding(config.max_seq_len, config.dim) if config.position == "learned" else None
        )
        self.blocks = nn.ModuleList(Block(config, index, rotary) for index in range(config.depth))
        self.norm = make_norm(config)
        out_width = config.emb_dim or config.dim
        # factorised embeddings project back to E before the (possibly tied) vocabulary matrix
        self.head_project = nn.Linear(config.dim, out_width, bias=False) if config.emb_dim else None
        self.head = nn.Linear(out_width, config.num_tokens, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.token_embedding.embed.weight
        self._aux_modules: list[nn.Module] | None = None  # modules reporting aux_losses, found on first use
        self.apply(self._init_weights)
        for name, parameter in self.named_parameters():
            if name.endswith(("to_out.weight", "down.weight")):  # GPT-2: scale residual projections
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * config.depth))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self,
        tokens: Tensor,
        targets: Tensor | None = None,
        cache: ModelCache | None = None,
        loss_mask: Tensor | None = None,
    ) -> ModelOutput:
        """tokens [B, T]; targets [B, T] (next tokens) for the loss; loss_mask [B, T] (0 = ignore)."""
        offset = 0 if cache is None else cache.length  # the longest row's, when rows differ
        n_tokens = tokens.shape[1]
        x = self.token_embedding(tokens)  # [B, T, dim]
        if self.position_embedding is not None:
            if offset + n_tokens > self.config.max_seq_len:
                raise ValueError(
                    f"learned positions stop at max_seq_len={self.config.max_seq_len}; "
                    f"got position {offset + n_tokens - 1}"
                )
            x = x + self.position_embedding(token_positions(cache, n_tokens, tokens.device))  # [T] or [B, T]
        if self.config.reversible:  # two-stream reversible residuals (model/reversible.py)
            x = reversible_blocks(self.blocks, x, None if cache is None else cache.layers)
        else:
            for index, block in enumerate(self.blocks):
                x = block(x, None if cache is None else cache.layers[index])
        x = self.norm(x)
        if self.head_project is not None:
            x = self.head_project(x)
        if targets is not None and loss_mask is not None:
            targets = targets.masked_fill(loss_mask == 0, IGNORE_INDEX)
        chunk = self.config.loss_chunk_size
        chunked_loss = targets is not None and chunk > 0  # the loss without the full logits (model/loss.py)
        logits = None if chunked_loss else self.head(x)  # [B, T, V]
        output = ModelOutput(logits=logits, aux_losses=self.collect_aux_losses())
        if targets is not None:
            if chunked_loss:
                lm_loss = chunked_linear_cross_entropy(x, self.head.weight, targets, chunk)
            else:
                lm_loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
            output.lm_loss = lm_loss
            output.loss = lm_loss + sum(output.aux_losses.values(), torch.zeros((), device=lm_loss.device))
        return output

    def collect_aux_losses(self) -> dict[str, Tensor]:
        """Named auxiliary losses of the last forward, summed over layers."""
        if self._aux_modules is None:  # found once: walking every module per call slows decoding
            self._aux_modules = [m for m in self.modules() if m is not self and hasattr(m, "aux_losses")]
        totals: dict[str, Tensor] = {}
        for module in self._aux_modules:
            for name, value in module.aux_losses.items():
                totals[name] = totals[name] + value if name in totals else value
        return totals

    def after_optimizer_step(self) -> None:
        """Explicit once-per-step updates of state that is not a gradient parameter (routing
        centroids): the training loop calls this after every optimiser step."""
        for block in self.blocks:
            block.attention.after_optimizer_step()

    def collect_stats(self) -> dict[str, float]:
        """Logging-only statistics of the last forward (e.g. MoE expert load), averaged over layers."""
        totals: dict[str, list[float]] = {}
        for module in self.modules():
            for name, value in getattr(module, "stats", {}).items():
                totals.setdefault(name, []).append(float(value))
        return {name: sum(values) / len(values) for name, values in totals.items()}

    def new_cache(self, batch_size: int, max_len: int | None = None, device=None, dtype=None) -> ModelCache:
        """An empty cache for incremental decoding of up to `max_len` tokens (default max_seq_len)."""
        parameter = next(self.parameters())
        max_len = max_len or self.config.max_seq_len
        device = device or parameter.device
        dtype = dtype or parameter.dtype
        layers = [block.attention.new_cache(batch_size, max_len, device, dtype) for block in self.blocks]
        return ModelCache(layers, max_len)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied matrix counted once)."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
