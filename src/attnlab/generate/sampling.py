"""Sampling: logit filters (temperature, top-k, top-p, min-p), and cached or uncached generation.

The filters are pure functions so that speculative decoding applies exactly the same ones to the
draft and the target distributions.

Legend: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

import codecs
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnlab.config import ModelConfig
from attnlab.errors import ConfigError, GenerationError
from attnlab.model.modes import eval_mode
from attnlab.model.transformer import Transformer

if TYPE_CHECKING:
    from attnlab.data.tokenizer import Tokenizer


@dataclass(kw_only=True)
class SamplingConfig:
    temperature: float = 1.0  # 0 means greedy
    top_k: int | None = None  # keep the k most likely tokens
    top_p: float | None = None  # keep the smallest set whose probability reaches p (nucleus)
    min_p: float | None = None  # keep tokens with probability >= min_p * the most likely one's

    def __post_init__(self) -> None:  # ConfigError is a ValueError too; `not 0 <= x` also refuses NaN
        if not 0 <= self.temperature < math.inf:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")


def check_prompt(model: torch.nn.Module, prompt: Tensor) -> None:
    """GenerationError if a prompt id lies outside the model's vocabulary (a tokenizer larger than the
    model's, say): the embedding would index past its table."""
    config = model_config(model)
    if config is not None and prompt.numel() and not 0 <= int(prompt.min()) <= int(prompt.max()) < config.num_tokens:
        raise GenerationError(f"the prompt holds token ids from {int(prompt.min())} to {int(prompt.max())}; the model "
                              f"has {config.num_tokens} (model.num_tokens)")


def model_config(model: torch.nn.Module) -> ModelConfig | None:
    """The ModelConfig of an attnlab model, also inside a DDP or DeepSpeed wrapper (`.module`);
    None for another module."""
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig) and hasattr(model, "module"):
        config = getattr(model.module, "config", None)
    return config if isinstance(config, ModelConfig) else None


def check_length(model: torch.nn.Module, length: int, what: str = "the prompt and the new tokens") -> None:
    """GenerationError if `model` cannot hold `length` tokens (`what` they are): learned positions end
    at max_seq_len (rotary ones extrapolate, so their models decode past it)."""
    config = model_config(model)
    if config is not None and config.position == "learned" and length > config.max_seq_len:
        raise GenerationError(f"{what} make {length} tokens; this model's learned positions end at "
                              f"model.max_seq_len={config.max_seq_len}")


def check_finite(logits: Tensor, step: int, who: str = "the model") -> None:
    """GenerationError if the logits hold NaN or infinity (the weights are damaged, or overflowed):
    no distribution to sample from."""
    if not bool(torch.isfinite(logits).all()):
        raise GenerationError(f"{who} gave non-finite logits (NaN or infinity) at new token {step + 1}: its "
                              "weights are damaged or overflow in this precision")


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
        filtered = filtered / config.temperature
    return torch.softmax(filtered, dim=-1)


@functools.lru_cache(maxsize=8)
def _zero_of(device: torch.device, dtype: torch.dtype) -> Tensor:
    with torch.inference_mode(False):  # usable inside and outside inference mode
        return torch.zeros((), device=device, dtype=dtype)


def _zero(like: Tensor) -> Tensor:
    """A 0-dim zero of like's device and dtype, made once (sampling runs once per decoded token)."""
    return _zero_of(like.device, like.dtype)


def sample_from(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of probs [..., V] -> [...], by inverting the cumulative distribution.

    Exact like torch.multinomial, and about half its cost per call on CPU. A token of probability
    zero adds nothing to the running sum, so no uniform draw lands on it; the draw is kept below
    the total so that rounding never selects past the last likely token."""
    cumulative = probs.cumsum(dim=-1)  # [..., V]
    total = cumulative[..., -1:]  # [..., 1]
    uniform = torch.rand(total.shape, generator=generator, device=probs.device, dtype=probs.dtype)
    draw = torch.minimum(uniform * total, torch.nextafter(total, _zero(total)))  # [..., 1] < total
    return torch.searchsorted(cumulative, draw, right=True).squeeze(-1)  # first index whose sum exceeds it


@torch.no_grad()
def stream(
    model: Transformer,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    compile: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield (next tokens [B], the logits they were drawn from [B, V]) one step at a time.

    With the cache, the prompt is fed once and each step feeds one token; without it, each step
    re-runs the model on the whole sequence (the slow path, kept as a check of the cache).
    compile: decode with the model's compiled step (Transformer.compile_decoding; made once).
    """
    sampling = sampling or SamplingConfig()
    check_length(model, prompt.shape[1] + max_new_tokens)
    check_prompt(model, prompt)
    if compile and use_cache and model._compiled_step is None:
        model.compile_decoding()
    with eval_mode(model):
        sequence = prompt
        cache = model.new_cache(prompt.shape[0], prompt.shape[1] + max_new_tokens) if use_cache else None
        next_input = prompt
        for _ in range(max_new_tokens):
            logits = model(next_input if use_cache else sequence, cache=cache).logits[:, -1]  # [B, V]
            token = sample_from(probabilities(logits, sampling), generator)  # [B]
            yield token, logits
            next_input = token[:, None]
            if not use_cache:  # only the uncached path re-reads the whole sequence
                sequence = torch.cat((sequence, next_input), dim=1)


def generate(
    model: Transformer,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    compile: bool = False,
) -> Tensor:
    """prompt [B, T] -> [B, T + max_new_tokens]; compile: as in `stream`."""
    new = [token for token, _ in stream(model, prompt, max_new_tokens, sampling, use_cache, generator, compile)]
    if not new:
        return prompt
    return torch.cat((prompt, torch.stack(new, dim=1)), dim=1)


def stream_text(
    model: Transformer,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    tokenizer: Tokenizer | None = None,
    compile: bool = False,
) -> Iterator[str]:
    """The text of row 0's new tokens, piece by piece as they are drawn (prompt [1, T]): each token's
    bytes (its own for a byte-level model, the tokenizer's otherwise) decoded as UTF-8 incrementally,
    so a character split over tokens comes out whole. A tokenized model stops at its end token (it
    is trained with one); the last piece flushes what is left (possibly "")."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = stream(model, prompt, max_new_tokens, sampling, use_cache, generator, compile)
    for step, (token, logits) in enumerate(pieces):
        check_finite(logits[0], step)  # before the token drawn from them is used (it may lie past the vocabulary)
        token_id = int(token[0])
        if tokenizer is not None and token_id == tokenizer.eos_id:
            break  # the document ends here
        yield decoder.decode(bytes([token_id]) if tokenizer is None else tokenizer.decode_bytes([token_id]))
    yield decoder.decode(b"", final=True)
