"""The distribution a model's next token is drawn from, and the draws: logit filters (temperature,
top-k, top-p, min-p) and sampling by inverting the cumulative distribution, given uniforms or
drawing them. Pure tensor functions, traceable by torch.compile, so that speculative decoding
applies exactly the same filters to the draft and the target, and a compiled decode step can draw
its tokens inside its graph (draw_chain).

Legend: B batch, T tokens, V vocabulary, n tokens drawn.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab.errors import ConfigError
from attnlab.generate import sampling_cpu

SMALLEST_TEMPERATURE = torch.finfo(torch.float32).smallest_normal  # the logits are divided in float32


@dataclass(kw_only=True)
class SamplingConfig:
    temperature: float = 1.0  # 0 means greedy
    top_k: int | None = None  # keep the k most likely tokens
    top_p: float | None = None  # keep the smallest set whose probability reaches p (nucleus)
    min_p: float | None = None  # keep tokens with probability >= min_p * the most likely one's

    def __post_init__(self) -> None:  # ConfigError is a ValueError too; `not 0 <= x` also refuses NaN
        if not 0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < SMALLEST_TEMPERATURE:  # float32 would hold it as 0 (or a subnormal)
            raise ConfigError(f"temperature must be 0 (greedy) or at least {SMALLEST_TEMPERATURE:.3g}, float32's "
                              f"smallest normal number, got {self.temperature}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):  # a float failed at the first draw, in torch.topk
            raise ConfigError(f"top_k must be a whole number >= 1, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")


def filter_logits(logits: Tensor, config: SamplingConfig) -> Tensor:
    """Logits [..., V] with the tokens the filters reject set to -inf (temperature not applied)."""
    logits = logits.float()
    if config.top_k is not None and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        floor = config.min_p * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if config.top_p is not None and config.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens strictly more likely already reach top_p
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = before >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probabilities(logits: Tensor, config: SamplingConfig) -> Tensor:
    """The distribution sampled from: filtered, tempered softmax; one-hot argmax when greedy.

    Only the work asked for is done (this runs once per decoded token): no filter pass without a
    filter, no division at temperature 1, and greedy skips the filters, which never remove the
    most likely token."""
    if config.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    filtered = filter_logits(logits, config)
    if config.temperature != 1:
        # the largest logit subtracted first: a small temperature sends the others to -inf, never the
        # largest to +-inf (a softmax of NaN, and a draw past the vocabulary)
        filtered = (filtered - filtered.amax(dim=-1, keepdim=True)) / config.temperature
    return torch.softmax(filtered, dim=-1)


def sample_from(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of probs [..., V] -> [...]: token_at a uniform drawn from `generator`."""
    uniform = torch.rand(probs.shape[:-1], generator=generator, device=probs.device, dtype=probs.dtype)
    return token_at(probs, uniform)


def token_at(probs: Tensor, uniform: Tensor) -> Tensor:
    """The token of each row of probs [..., V] at which the cumulative distribution passes
    uniform [...] (in [0, 1)) x its total -> [...]: exact sampling when the uniforms are uniform.

    Exact like torch.multinomial, and about half its cost per call on CPU. A token of probability
    zero adds nothing to the running sum, so no uniform lands on it; the draw is kept below the
    total so that rounding never selects past the last likely token. On the CPU, in float32, one
    operator gives the same tokens (sampling_cpu.cpp: a compiled step's draw without two library
    calls)."""
    if sampling_cpu.serves(probs, uniform):
        return sampling_cpu.token_at(probs, uniform)
    cumulative = probs.cumsum(dim=-1)  # [..., V]
    total = cumulative[..., -1:]  # [..., 1]
    draw = torch.minimum(uniform[..., None] * total, torch.nextafter(total, torch.zeros_like(total)))  # < total
    return torch.searchsorted(cumulative, draw, right=True).squeeze(-1)  # first index whose sum exceeds it


def draw_last(logits: Tensor, config: SamplingConfig, uniform: Tensor) -> tuple[Tensor, Tensor]:
    """The token after logits [B, T, V] drawn at uniform [B] -> (token [B], the last position's
    logits [B, V]): a cached decoding step's sampling, traceable, so that a compiled step draws
    inside its graph (Transformer.decode_then); sample_from's token for sample_from's uniform."""
    last = logits[:, -1]  # [B, V]
    return token_at(probabilities(last, config), uniform), last


def draw_chain(step: Callable[[Tensor], Tensor], tokens: Tensor, uniforms: Tensor, config: SamplingConfig,
               forced_tokens: Tensor | None = None, forced: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Draw n tokens one after another from a cached model: feed tokens [B, T], draw a token from
    the distribution after them at uniforms[:, 0], feed it, draw the next at uniforms[:, 1], ...;
    the last token drawn is not fed. step(tokens [B, t]) -> logits [B, t, V] feeds tokens through
    the model's cache. forced [B, n] bool: slots whose token is forced_tokens' (drawn all the
    same, then replaced: speculative decoding's slots a row has already committed).
    Returns (probs [B, n, V] each token was drawn from, tokens [B, n])."""
    n_draws = uniforms.shape[1]
    distributions, drawn = [], []
    probs = probabilities(step(tokens)[:, -1], config)  # [B, V]
    for slot in range(n_draws):
        token = token_at(probs, uniforms[:, slot])  # [B]
        if forced is not None:
            token = torch.where(forced[:, slot], forced_tokens[:, slot], token)
        distributions.append(probs)
        drawn.append(token)
        if slot < n_draws - 1:
            probs = probabilities(step(token[:, None])[:, -1], config)
    return torch.stack(distributions, dim=1), torch.stack(drawn, dim=1)
