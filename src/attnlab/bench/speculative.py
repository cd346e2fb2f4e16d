"""The speculative decoding benchmark behind `attnlab speculative`: a target's own cached decoding
against speculative decoding with a draft (another run, or the target's first layers), timed
alternately from the same prompt and seed, with the texts, medians, speedups and acceptance figures
in one JSON-ready record.

Legend: B batch, T prompt tokens, N new tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from attnlab.data.corpus import decode_text, encode_prompt, load_corpus, tokenizer_for
from attnlab.data.sampler import eval_windows, prime_tokens
from attnlab.data.tokenizer import Tokenizer
from attnlab.errors import AttnlabError
from attnlab.generate.sampling import (
    SamplingConfig,
    check_finite,
    generate,
)
from attnlab.generate.speculative import (
    VERIFICATIONS,
    CachedLanguageModel,
    EarlyExitDraft,
    SpeculativeResult,
    check_request,
    speculative_generate,
)
from attnlab.model.quantize import decoding_products, quantize_weights
from attnlab.model.transformer import Transformer
from attnlab.train.checkpoint import load_model
from attnlab.train.portable import run_directory

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SpeculativeBench:
    """One comparison: which pair, which prompt, how to decode, how often to time."""

    target: str | None  # run directory or checkpoint (None is refused: the command line may leave it out)
    draft: str | None = None  # a draft run; None: early_exit
    early_exit: int | None = None  # self-speculative: the target's first K layers are the draft
    draft_quantize: str = "none"  # model/quantize.py: the draft's linear layers keep int8 weights
    gamma: int = 5  # draft tokens per step
    verification: str = "block"  # the rule they are kept by (generate/speculative.py's VERIFICATIONS)
    prompt: str | None = None  # text to continue, the same for every row ("" if None and not prime_from_val)
    prime_from_val: bool = False  # continue windows (documents) of the target's validation data instead
    prime_length: int = 128  # tokens of each validation prime
    max_new_tokens: int = 256
    batch_size: int = 1
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0  # repeat r decodes with seed + r
    batch_scheme: Literal["auto", "per-row", "shared"] = "auto"  # how rows of a batch roll back
    repeats: int = 1  # timed runs of each decoder; medians reported
    weights: str = "auto"  # auto, model or ema
    device: str = "cpu"
    dtype: str = "float32"  # both models' weights and caches (torch's name): the base decodes in it too
    cache_dtype: str | None = None  # both models' and the base's caches' keys and values, if not dtype
    compile: bool = False  # both models decode with compiled steps (Transformer.compile_decoding)
    prefill_chunk: int | None = None  # with compile: both models prefill by the compiled step, C tokens at a time
    attention_backend: str | None = None  # both models' attention back-end (load_model); None: each run's

    def __post_init__(self) -> None:  # worded for `attnlab speculative`, whose flags these fields are
        if self.target is None or (self.draft is None and self.early_exit is None):
            raise AttnlabError("give --target RUN and --draft RUN (or --early-exit K); or use `speculative train`")
        if self.gamma < 1 or self.batch_size < 1 or self.max_new_tokens < 1 or self.repeats < 1:
            raise AttnlabError("--gamma, --batch-size, --max-new-tokens and --repeats must be >= 1")
        if self.early_exit is not None and self.draft_quantize != "none":
            raise AttnlabError("--draft-quantize needs a draft of its own (--draft RUN): an early-exit draft's "
                               "layers are the target's")
        if self.verification not in VERIFICATIONS:
            raise AttnlabError(f"--verification {self.verification}: choose from {', '.join(VERIFICATIONS)}")
        if self.prefill_chunk is not None and not self.compile:
            raise AttnlabError("--prefill-chunk prefills by the compiled step: add --compile")


def timed(function: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """(result, wall-clock seconds), synchronising CUDA before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = function()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - started


def load_pair(bench: SpeculativeBench, device: torch.device) -> tuple[Transformer, CachedLanguageModel, str]:
    """(target, draft, the draft's name for the report)."""
    target = load_model(bench.target, device=device, weights=bench.weights, dtype=getattr(torch, bench.dtype),
                        attention_backend=bench.attention_backend)
    if bench.compile:
        target.compile_decoding(prefill_chunk=bench.prefill_chunk)
    if bench.early_exit is not None:
        if not 1 <= bench.early_exit <= target.config.depth:
            raise AttnlabError(f"--early-exit {bench.early_exit}: the target has {target.config.depth} layers; give "
                               f"1 to {target.config.depth}")
        draft_name = f"early exit after layer {bench.early_exit} of the target"
        return target, EarlyExitDraft(target, bench.early_exit), draft_name
    draft = load_model(bench.draft, device=device, weights=bench.weights, dtype=getattr(torch, bench.dtype),
                       attention_backend=bench.attention_backend)
    draft_name = str(bench.draft)
    if draft.config.num_tokens != target.config.num_tokens:
        raise AttnlabError("draft and target must share a vocabulary (model.num_tokens)")
    if quantize_weights(draft, bench.draft_quantize):
        draft_name += f" ({bench.draft_quantize} weights)"
    if bench.compile:
        draft.compile_decoding(prefill_chunk=bench.prefill_chunk)
    return target, draft, draft_name


def attention_backend(model) -> str:
    """The attention back-end a model (or an early-exit draft's target) is configured with."""
    config = getattr(model, "target", model).config.attention
    return getattr(config, config.kind).backend


def cudagraph_skips() -> int:
    """Compiled calls inductor ran without CUDA graphs in this process (each one says why in a
    warning): 0 when every compiled step on the GPU replayed its graph."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def build_prompt(bench: SpeculativeBench, target: Transformer, tokenizer: Tokenizer | None) -> torch.Tensor:
    """[B, T] prompt tokens: the text repeated per row, or one validation prime per row (a window
    of byte data; the beginning of a document of tokenized data, all cut to the shortest)."""
    if bench.prime_from_val:
        corpus = load_corpus(target.run_config.data)
        if hasattr(corpus.val, "prime"):  # tokenized documents
            primes = [prime_tokens(corpus.val, bench.prime_length, seed=bench.seed + row)
                      for row in range(bench.batch_size)]
            length = min(len(prime) for prime in primes)
            return torch.stack([prime[:length] for prime in primes]).long().to(bench.device)
        longest = len(corpus.val) - 2  # eval_windows' windows of prime_length + 1 tokens, at one start at least
        if bench.prime_length > longest:  # its own error names train.seq_len, which is not what was asked
            raise AttnlabError(f"--prime-length {bench.prime_length}: the target's validation split has "
                               f"{len(corpus.val)} tokens, primes of at most {longest}")
        windows = eval_windows(corpus.val, bench.prime_length, bench.batch_size, seed=bench.seed)
        return windows[:, : bench.prime_length].long().to(bench.device)
    tokens = encode_prompt(tokenizer, bench.prompt if bench.prompt is not None else "")
    return torch.tensor([tokens] * bench.batch_size, device=bench.device)


def warn_beyond_training(model, name: str, length: int) -> bool:
    """Warn (and return True) when decoding reaches past the windows `model` was trained on: its
    predictions there are extrapolated, and they degrade fast (a byte model trained on 128 tokens
    gives about twice the bits per byte at positions 256-383), and so does the draft's agreement
    with the target (docs/speculative.md)."""
    config = getattr(model, "run_config", None)
    if config is None or length <= config.train.seq_len:
        return False
    log.warning("warning: the %s was trained on windows of %d tokens, and this decoding reaches %d; past %d its "
                "predictions are extrapolated and degrade", name, config.train.seq_len, length, config.train.seq_len)
    return True


def rollback_scheme(batch_scheme: str) -> bool | None:
    """speculative_generate's per_row for a batch scheme (None: auto)."""
    return {"auto": None, "per-row": True, "shared": False}[batch_scheme]


@dataclass
class Timings:
    """The timed runs of both decoders: seconds per repeat, the speculative runs' results, and the
    base decoding of the first repeat (the report's texts are the first repeat's)."""

    base_seconds: list[float]
    speculative_seconds: list[float]
    results: list[SpeculativeResult]
    first_base: torch.Tensor  # [B, T + N]


def time_decoders(bench: SpeculativeBench, target: Transformer, draft: CachedLanguageModel, prompt: torch.Tensor,
                  per_row: bool | None, device: torch.device) -> Timings:
    """A warm-up of both paths (allocator, first-call costs), then base and speculative runs alternating,
    each pair with the same seed."""

    cache_dtype = None if bench.cache_dtype is None else getattr(torch, bench.cache_dtype)

    def base(seed: int) -> torch.Tensor:
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.inference_mode():  # the same mode speculative_generate runs in
            return generate(target, prompt, bench.max_new_tokens, bench.sampling, generator=generator,
                            cache_dtype=cache_dtype)

    def speculative(seed: int) -> SpeculativeResult:
        generator = torch.Generator(device=device).manual_seed(seed)
        return speculative_generate(
            target, draft, prompt, bench.max_new_tokens, bench.gamma, bench.sampling, generator=generator,
            per_row=per_row, cache_dtype=cache_dtype, verification=bench.verification,
        )

    base(bench.seed)
    speculative(bench.seed)
    base_times, speculative_times, results = [], [], []
    for repeat in range(bench.repeats):
        base_tokens, seconds = timed(lambda: base(bench.seed + repeat), device)  # noqa: B023
        base_times.append(seconds)
        result, seconds = timed(lambda: speculative(bench.seed + repeat), device)  # noqa: B023
        speculative_times.append(seconds)
        results.append(result)
        if repeat == 0:
            first_base = base_tokens
    return Timings(base_times, speculative_times, results, first_base)


def run_speculative_bench(bench: SpeculativeBench) -> dict[str, Any]:
    """Load the pair, decode with both, and return the record `attnlab speculative --json` prints."""
    device = torch.device(bench.device)
    target, draft, draft_name = load_pair(bench, device)
    tokenizer = tokenizer_for(target.run_config.data, run_directory(bench.target))  # None: a byte-level run
    prompt = build_prompt(bench, target, tokenizer)  # [B, T]
    # speculative_generate's own checks (the prompt, learned positions with the tokens decoded past the
    # goal), here before any measurement rather than after the base decoding's warm-up
    per_row = rollback_scheme(bench.batch_scheme)
    check_request(target, draft, prompt, bench.max_new_tokens, bench.gamma, bench.verification, per_row)
    for name, model in (("the target", target), ("the draft", draft)):
        with torch.inference_mode():  # damaged (NaN) weights: refused here, not an index error mid-decoding
            check_finite(model(prompt).logits[:, -1], 0, name)
    warn_beyond_training(target, "target", prompt.shape[1] + bench.max_new_tokens)
    warn_beyond_training(draft, "draft", prompt.shape[1] + bench.max_new_tokens)
    timings = time_decoders(bench, target, draft, prompt, per_row, device)

    base_seconds = statistics.median(timings.base_seconds)
    speculative_seconds = statistics.median(timings.speculative_seconds)
    n_tokens = bench.batch_size * bench.max_new_tokens
    prompt_length = prompt.shape[1]
    results = timings.results
    return {
        "target": str(bench.target),
        "draft": draft_name,
        "draft_quantize": bench.draft_quantize,
        "compile": bench.compile,  # both models decode with compiled steps
        "prefill_chunk": bench.prefill_chunk,  # and prefill by them, so many tokens at a time (None: eagerly)
        # what still ran compiled at the end (an entry that failed decodes eagerly, after a warning)
        "compiled_entries": {"target": target.compiled_entries(), "draft": draft.compiled_entries()},
        "device": str(device),
        # what the models decode in, read off them (both cast alike: the base decodes in it too)
        "dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "cache_dtype": bench.cache_dtype or str(next(target.parameters()).dtype).removeprefix("torch."),
        # read off the models: each one's attention back-end as configured (auto: chosen per call)
        "attention_backend": {role: attention_backend(model) for role, model in (("target", target), ("draft", draft))},
        "gamma": bench.gamma,
        "verification": bench.verification,
        "batch_size": bench.batch_size,
        "max_new_tokens": bench.max_new_tokens,
        "prompt_tokens": prompt_length,
        "sampling": dataclasses.asdict(bench.sampling),
        "repeats": bench.repeats,
        "prompt": decode_text(tokenizer, prompt[0].tolist()),
        "base": {
            "text": decode_text(tokenizer, timings.first_base[0, prompt_length:].tolist()),
            "ms": 1000 * base_seconds,
            "ms_all": [1000 * seconds for seconds in timings.base_seconds],
            "tokens_per_s": n_tokens / base_seconds,
        },
        "speculative": {
            "text": decode_text(tokenizer, results[0].tokens[0, prompt_length:].tolist()),
            "ms": 1000 * speculative_seconds,
            "ms_all": [1000 * seconds for seconds in timings.speculative_seconds],
            "tokens_per_s": n_tokens / speculative_seconds,
            "steps": statistics.mean(result.n_steps for result in results),
            "mean_accepted": statistics.mean(result.mean_accepted for result in results),
            "acceptance_rate": statistics.mean(result.acceptance_rate for result in results),
            # at batch 1 too: the schemes draw the same tokens there, but per-row commits inside the step
            "batch_scheme": "per-row" if results[0].per_row else "shared",
        },
        # which products the models' linear layers multiply with when decoding (model/quantize.py)
        "products": {"target": decoding_products(target, bench.compile),
                     "draft": decoding_products(draft, bench.compile)},
        "speedup": base_seconds / speculative_seconds,
        "cudagraph_skips": cudagraph_skips() if device.type == "cuda" and bench.compile else None,
        # each speculative run against the base run of the same seed just before it: on a shared
        # machine whose speed drifts, the median of these pairs is the steadier figure
        "speedup_paired_median": statistics.median(
            base / speculative
            for base, speculative in zip(timings.base_seconds, timings.speculative_seconds, strict=True)
        ),
    }
