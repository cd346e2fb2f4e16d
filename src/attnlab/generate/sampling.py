"""Generation: cached or uncached sampling from a model, token by token or as text. The
distribution sampled from (SamplingConfig, the logit filters, the draws) is
attnlab.generate.distribution's, imported here for callers.

Legend: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attnlab.data.byte_corpus import byte_model_bytes
from attnlab.errors import ConfigError, GenerationError
from attnlab.generate.distribution import (  # noqa: F401  (filter_logits: re-exported for callers)
    SamplingConfig,
    draw_last,
    filter_logits,
    probabilities,
    sample_from,
)
from attnlab.model.modes import eval_mode
from attnlab.model.transformer import Transformer, capacity_for, check_length, model_config

if TYPE_CHECKING:
    from attnlab.data.tokenizer import Tokenizer


EMBEDDING_INDEX_DTYPES = (torch.long, torch.int32)  # the index dtypes nn.Embedding takes


def check_prompt(model: torch.nn.Module, prompt: Tensor, who: str = "the model") -> None:
    """The checks of a prompt every decoding makes before its first forward (generate, stream,
    speculative_generate, for each of its models), each a one-line error naming what is wrong rather
    than an index or dtype error deep in the embedding: ConfigError unless prompt is a [B, T] tensor
    of integer ids (torch.long or torch.int32, EMBEDDING_INDEX_DTYPES) with T >= 1 on the model's
    device; GenerationError if an id lies outside the model's vocabulary (a tokenizer larger than
    the model's, say)."""
    if not isinstance(prompt, Tensor) or prompt.dim() != 2:
        shape = tuple(prompt.shape) if isinstance(prompt, Tensor) else type(prompt).__name__
        raise ConfigError(f"the prompt must be a [batch, tokens] tensor of token ids, got {shape} "
                          "(one sequence: prompt[None])")
    if prompt.dtype not in EMBEDDING_INDEX_DTYPES:  # uint8 bytes too: the embedding refuses them deep in torch
        raise ConfigError(f"the prompt must hold integer token ids as torch.long or torch.int32, got {prompt.dtype} "
                          "(prompt.long())")
    if prompt.shape[1] < 1:
        raise ConfigError("the prompt needs at least one token")
    parameter = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
    if parameter is not None and prompt.device != parameter.device:
        raise ConfigError(f"the prompt is on {prompt.device}, {who} on {parameter.device}: move one to the other's "
                          "device (prompt.to(device))")
    config = model_config(model)
    if config is not None and not 0 <= int(prompt.min()) <= int(prompt.max()) < config.num_tokens:
        raise GenerationError(f"the prompt holds token ids from {int(prompt.min())} to {int(prompt.max())}; {who} "
                              f"has {config.num_tokens} (model.num_tokens)")


def check_new_tokens(max_new_tokens: int) -> None:
    """ConfigError unless max_new_tokens is a whole number >= 0 (a negative count returned the prompt
    alone, silently; a float failed deep in a cache's allocation)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")


def check_finite(logits: Tensor, step: int, who: str = "the model") -> None:
    """GenerationError if the logits hold NaN or infinity (the weights are damaged, or overflowed):
    no distribution to sample from."""
    if not bool(torch.isfinite(logits).all()):
        raise GenerationError(f"{who} gave non-finite logits (NaN or infinity) at new token {step + 1}: its "
                              "weights are damaged or overflow in this precision")


@torch.no_grad()
def stream(
    model: Transformer,
    prompt: Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    compile: bool = False,
    cache_dtype: torch.dtype | None = None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield (next tokens [B], the logits they were drawn from [B, V]) one step at a time.

    With the cache, the prompt is fed once and each step feeds one token; without it, each step
    re-runs the model on the whole sequence (the slow path, kept as a check of the cache). The
    steps run under torch.inference_mode (the model's own tables are still made as ordinary
    tensors, so it trains afterwards); what is yielded are ordinary tensors.
    compile: decode with the model's compiled step (Transformer.compile_decoding; made once), which
    also draws the token (draw_last inside the step's graph, at a uniform drawn before it: the
    tokens sample_from would draw). Its cache's capacity is rounded up to a power of two
    (Transformer.decoding_capacity), so a later generation of another length whose length rounds
    alike reuses the compiled step instead of compiling one.
    cache_dtype: the dtype the cache stores keys and values in (default: the weights'); bfloat16
    beside float32 weights halves the bytes a long context's step reads, at bfloat16's rounding of
    what attention reads (the arithmetic stays in the weights' dtype).
    """
    sampling = sampling or SamplingConfig()
    check_new_tokens(max_new_tokens)
    check_prompt(model, prompt)
    check_length(model, prompt.shape[1] + max_new_tokens, "the prompt and the new tokens")
    if compile and use_cache and model._compiled_step is None:
        model.compile_decoding()
    with eval_mode(model):
        sequence = prompt
        with torch.inference_mode():  # the cache's tensors count no versions (a compiled step runs leaner)
            capacity = capacity_for(model, prompt.shape[1] + max_new_tokens)  # rounded up when compiled
            cache = model.new_cache(prompt.shape[0], capacity, dtype=cache_dtype) if use_cache else None
        next_input = prompt
        for _ in range(max_new_tokens):
            with torch.inference_mode():  # never around a yield: the caller's code runs outside it
                if use_cache:  # the forward and the draw: one call of a compiled model's step
                    uniform = torch.rand(prompt.shape[0], generator=generator, device=prompt.device)  # [B] float32
                    token, logits = model.decode_then(draw_last, next_input, cache, sampling, uniform)
                else:
                    logits = model(sequence).logits[:, -1]  # [B, V]
                    token = sample_from(probabilities(logits, sampling), generator)  # [B]
            # ordinary tensors for the caller (an inference tensor cannot be changed in place outside
            # inference mode): [B] tokens and [B, V] logits, small beside a step
            token, logits = token.clone(), logits.clone()
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
    cache_dtype: torch.dtype | None = None,
) -> Tensor:
    """prompt [B, T] (integer ids on the model's device, T >= 1) -> [B, T + max_new_tokens] long: the
    prompt, then the tokens drawn after it (no row stops early: an end token is drawn like any other).
    The model decodes in eval mode (its own modes restored after) without autograd; `generator`
    seeds the draws; compile, cache_dtype: as in `stream`. Bad arguments are refused before any
    forward (check_prompt, check_new_tokens, check_length)."""
    new = [token for token, _ in stream(model, prompt, max_new_tokens, sampling, use_cache, generator, compile,
                                        cache_dtype)]
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
    cache_dtype: torch.dtype | None = None,
) -> Iterator[str]:
    """The text of row 0's new tokens, piece by piece as they are drawn (prompt [1, T]): each token's
    bytes (its own for a byte-level model, the tokenizer's otherwise) decoded as UTF-8 incrementally,
    so a character split over tokens comes out whole. A tokenized model stops at its end token (it
    is trained with one); the last piece flushes what is left (possibly "")."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = stream(model, prompt, max_new_tokens, sampling, use_cache, generator, compile, cache_dtype)
    for step, (token, logits) in enumerate(pieces):
        check_finite(logits[0], step)  # before the token drawn from them is used (it may lie past the vocabulary)
        token_id = int(token[0])
        if tokenizer is not None and token_id == tokenizer.eos_id:
            break  # the document ends here
        yield decoder.decode(byte_model_bytes([token_id]) if tokenizer is None else tokenizer.decode_bytes([token_id]))
    yield decoder.decode(b"", final=True)
