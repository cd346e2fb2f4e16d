"""The autoregressive Transformer: embeddings, a stack of pre-norm blocks, an output head.

Attention, feed-forward and norm are chosen by name from their registries. The same model runs
in parallel over a whole sequence (training) or incrementally with a cache (decoding):

    model(tokens)                                     -> ModelOutput(logits)
    model(tokens, targets=targets)                    -> ModelOutput(logits, loss, aux_losses)
    cache = model.new_cache(batch_size, max_len); model(next_tokens, cache=cache)

Legend: B batch, T tokens, V vocabulary, dim model width.
"""

from __future__ import annotations

import contextlib
import logging
import math
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnlab.attention  # noqa: F401  (registers the attention variants)
import attnlab.model.moe  # noqa: F401  (registers the mixture-of-experts feed-forward)
from attnlab.attention.base import AttentionSpec, KVCache, RotaryEmbedding, new_lengths
from attnlab.config import ModelConfig
from attnlab.errors import ConfigError, GenerationError
from attnlab.generate.distribution import SamplingConfig, draw_chain
from attnlab.model.decode_compile import (
    STRUCTURE_CHANGES,
    FrozenWeights,
    call_key,
    decode_compile_options,
    dynamo_code_function,
    own_code,
    packed_step_compiling,
    resolved_linear,
    takes_cpu_defaults,
    weight_tensors,
)
from attnlab.model.layers import Chunked, TokenEmbedding
from attnlab.model.loss import IGNORE_INDEX, chunked_linear_cross_entropy  # IGNORE_INDEX: padding, masked
from attnlab.model.reversible import reversible_blocks
from attnlab.registry import ATTENTION, FEED_FORWARD, NORM

log = logging.getLogger(__name__)
DECODE_GRAPH_LIMIT = 256  # compiled decode steps kept (one per model, cache layout and chunk length)
DECODE_CAPACITY_FLOOR = 64  # the smallest cache a compiled decoding makes (decode_capacity)



@dataclass
class ModelOutput:
    logits: Tensor | None  # [B, T, V]; None when targets are given and model.loss_chunk_size > 0
    loss: Tensor | None = None  # lm_loss + every auxiliary loss (already weighted)
    lm_loss: Tensor | None = None  # mean next-token cross-entropy over unmasked targets
    aux_losses: dict[str, Tensor] = field(default_factory=dict)  # by name, summed over layers


class ModelCache:
    """One KVCache per layer, all counting their tokens in one tensor `lengths` [B] (each row's own
    count: speculative decoding rolls rows back to lengths of their own). The host keeps the longest
    and shortest row's count beside it, for checks outside any compiled step."""

    def __init__(self, layers: list[KVCache], lengths: Tensor, max_len: int, dtype: torch.dtype | None = None
                 ) -> None:
        self.layers = layers
        self.lengths = lengths  # [B], shared by every layer
        self.max_len = max_len
        self.dtype = dtype  # of the stored keys and values
        self.length = 0  # the longest row's count, on the host
        self.shortest = 0
        self.pinned = False  # its tensors marked as fixed addresses for CUDA graphs (pin_cache_storage)
        self.warned_autograd = False  # warn_autograd has warned of this cache

    @property
    def per_row_rollback(self) -> bool:
        """Every attention type's cache rolls rows back to lengths of their own (truncate_rows)."""
        return True

    def positions(self, n_new: int) -> Tensor:
        """[B, T]: the positions of each row's next n_new tokens."""
        return self.lengths[:, None] + torch.arange(n_new, device=self.lengths.device)

    def begin(self, n_new: int, whole_sequence: bool | None = None, n_rows: int | None = None) -> None:
        """Before a forward of n_new tokens: refuse more than max_len, or n_rows rows where the cache
        has another number, and tell the layers whether the chunk is a whole sequence (a prefill:
        each may compute it so). whole_sequence: None for "every row is empty"; False for a chunk
        the layers read as one after earlier tokens even where there are none (a compiled prefill's
        first chunk: the step's graph serves it)."""
        if n_rows is not None and n_rows != self.lengths.shape[0]:
            raise ValueError(f"the cache holds {self.lengths.shape[0]} rows; a forward of {n_rows} asked "
                             "(make a cache for them: new_cache(batch_size, max_len))")
        if self.length + n_new > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} tokens a row; {self.length} fed and {n_new} more asked "
                             "(make a larger cache: new_cache(batch, max_len))")
        whole = self.length == 0 if whole_sequence is None else whole_sequence
        for layer in self.layers:
            layer.prefill = whole

    def end(self, n_new: int) -> None:
        """After that forward (whose layers wrote n_new tokens a row): count them."""
        for layer in self.layers:
            layer.prefill = False
        self.length += n_new
        self.shortest += n_new

    def truncate(self, length: int) -> None:
        """Forget everything of every row after its first `length` tokens, exactly."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.shortest:
            raise ValueError(f"cannot truncate rows of lengths {self.shortest}..{self.length} to {length}")
        self.lengths.fill_(length)
        self.length = self.shortest = length

    def truncate_rows(self, lengths: Tensor, bounds: tuple[int, int] | None = None) -> None:
        """Roll row b back to its first lengths[b] tokens (speculative decoding's per-row rollback).
        bounds: (the longest, the shortest) of lengths, from a caller that has read them and knows
        every row within what it holds (speculative decoding's loop, one read a step for all it
        needs); without them this checks the lengths and reads the bounds itself."""
        if bounds is None:
            if (not isinstance(lengths, Tensor) or lengths.shape != self.lengths.shape
                    or lengths.dtype.is_floating_point or lengths.dtype == torch.bool):
                shape = tuple(lengths.shape) if isinstance(lengths, Tensor) else type(lengths).__name__
                raise ValueError(f"truncate_rows takes a tensor of {self.lengths.shape[0]} integer lengths, one "
                                 f"a row; got {shape}" + (f" {lengths.dtype}" if isinstance(lengths, Tensor) else ""))
            invalid, *bounds = torch.stack((((lengths < 0) | (lengths > self.lengths)).any(), lengths.max(),
                                            lengths.min())).tolist()
            if invalid:
                raise ValueError(f"cannot truncate rows of lengths {self.lengths.tolist()} to {lengths.tolist()}")
        self.lengths.copy_(lengths)
        self.length, self.shortest = bounds


def decode_capacity(length: int, max_seq_len: int) -> int:
    """The capacity of the cache a compiled decoding of `length` tokens a row makes: the next power
    of two (at least DECODE_CAPACITY_FLOOR), but no more than max_seq_len where length fits in it
    (past max_seq_len, the rotary tables grow to the bucket). A compiled step's graph is made for its
    cache's capacity (static shapes), so generations whose lengths fall in one bucket share the
    graphs the first made, where an exact capacity compiled anew for every length (20-30 s a time on
    a CPU). The cost: up to twice the cache's memory, and, on a path that reads the whole storage
    masked (the torch back-end's attention, which `auto` takes on CUDA), up to twice its reads; the
    cpu back-end (CPU) and the triton back-end (CUDA, when named: full and local attention) read only
    the positions a query sees."""
    bucket = max(DECODE_CAPACITY_FLOOR, 1 << (length - 1).bit_length())
    return min(bucket, max_seq_len) if length <= max_seq_len else bucket


def capacity_for(model: nn.Module, length: int) -> int:
    """The capacity of the cache a decoding of `length` tokens a row makes for `model`: its
    decoding_capacity (Transformer's: rounded up once its decoding is compiled), or length for a
    model without one."""
    rule = getattr(model, "decoding_capacity", None)
    return length if rule is None else rule(length)


def model_config(model: nn.Module) -> ModelConfig | None:
    """The ModelConfig of an attnlab model, also inside a DDP or DeepSpeed wrapper (`.module`);
    None for another module."""
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig) and hasattr(model, "module"):
        config = getattr(model.module, "config", None)
    return config if isinstance(config, ModelConfig) else None


def check_length(model: nn.Module, length: int, what: str) -> None:
    """GenerationError if `model` cannot hold `length` tokens (`what` they are, as the message names
    them: a prompt and its new tokens, evaluation windows, a teacher's training windows): learned
    positions end at max_seq_len (rotary ones extrapolate, so their models decode past it)."""
    config = model_config(model)
    if config is not None and config.position == "learned" and length > config.max_seq_len:
        raise GenerationError(f"{what} make {length} tokens; this model's learned positions end at "
                              f"model.max_seq_len={config.max_seq_len}")


def new_model_cache(model: nn.Module, attention_layers: list[nn.Module], batch_size: int, max_len: int, device=None,
                    dtype=None) -> ModelCache:
    """A ModelCache over these attention layers of `model`, their counts in one shared tensor; device and
    dtype by default those of the model's first parameter (an embedding: float also when quantized)."""
    parameter = next(model.parameters())
    dtype = dtype or parameter.dtype
    if not dtype.is_floating_point:
        raise ValueError(f"a cache stores keys and values in a floating-point dtype (bfloat16, float32, ...); "
                         f"got {dtype}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"a cache holds max_len >= 1 tokens a row, got {max_len!r}")
    lengths = new_lengths(batch_size, device or parameter.device)
    layers = [layer.new_cache(batch_size, max_len, lengths.device, dtype, lengths=lengths)
              for layer in attention_layers]
    return ModelCache(layers, lengths, max_len, dtype)


def pin_cache_storage(cache: ModelCache) -> None:
    """Mark every tensor a cache holds (each layer's storage, the shared lengths) as having a fixed
    address, once per cache. The compiled step writes them in place; CUDA graphs replay only steps
    whose mutated inputs are such static inputs (others would be skipped, or copied in at every
    replay). A new cache has new addresses: its first step records the graphs again (inductor allows
    config.triton.cudagraph_unexpected_rerecord_limit such re-recordings before it stops replaying)."""
    if cache.pinned:
        return
    for holder in (cache, *cache.layers):
        for value in vars(holder).values():
            members = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
            for member in members:
                if isinstance(member, Tensor):
                    torch._dynamo.mark_static_address(member)
    cache.pinned = True



def warn_autograd(cache: ModelCache) -> None:
    """Warn once per cache of a forward after earlier tokens with gradients on: each step writes its
    keys and values into the cache's storage in place, so the storage's autograd graph holds every
    step's activations until the cache is dropped (memory grows with every token). Decoding wants
    torch.no_grad() or torch.inference_mode(), as generate() and speculative_generate() take."""
    cache.warned_autograd = True
    log.warning("decoding through a cache with gradients on keeps every step's activations alive through the "
                "cache's storage: wrap decoding in torch.no_grad()")


def token_positions(cache: ModelCache | None, n_tokens: int, device: torch.device) -> Tensor:
    """Positions of the next n_tokens: [T] from 0 without a cache, [B, T] each row's own through one
    (learned position embeddings look them up)."""
    return torch.arange(n_tokens, device=device) if cache is None else cache.positions(n_tokens)


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
        self._compiled_step = None  # compile_decoding()
        self._prefill_chunk: int | None = None  # compile_decoding(): the compiled prefill's chunk, None: eager
        self._compiled_draw = None  # compile_decoding(): draw()'s graph
        self._compiled_decode_then = None  # compile_decoding(): decode_then()'s graphs
        self._compiled_draw_then_decode = None  # compile_decoding(): draw_then_decode()'s graphs
        self._cuda_graphs = False  # the compiled step replays CUDA graphs (compile_decoding on CUDA)
        self._decode_calls: dict[tuple, int] = {}  # times the compiled step served a call (_decode_call)
        self._direct_calls: dict[tuple, types.MethodType] = {}  # dynamo's code for a call, called directly
        self._decode_structure = -1  # STRUCTURE_CHANGES when _decode_calls was last cleared
        self._compile_arguments: dict = {}  # what compile_decoding() was last asked, to compile again
        self._compile_settings: tuple | None = None  # what it resolved them to: graphs made alike compare equal
        self._frozen_weights: FrozenWeights | None = None  # the weights a packed step holds as constants
        self._frozen_drafts: dict[int, FrozenWeights] = {}  # drafts' weights draw_then_decode's packed graphs hold
        self.initialise()

    def initialise(self) -> None:
        """The initial weights `config.init` names. "torch" keeps what torch's modules start with
        (linear layers Kaiming-uniform, std 1 / sqrt(3 fan_in); embeddings N(0, 1)), but a tied
        embedding, which is the output layer too, starts as that linear layer would (N(0, 1) logits
        would be sqrt(dim) wide). "gpt2": every linear layer and embedding N(0, 0.02), biases zero,
        the residual projections (to_out, down) N(0, 0.02 / sqrt(2 depth)), as GPT-2. Then each layer's
        own parameters that either would overwrite (NSA's gates)."""
        config = self.config
        if config.init == "gpt2":
            self.apply(self._gpt2_weights)
            for name, parameter in self.named_parameters():
                if name.endswith(("to_out.weight", "down.weight")):
                    nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * config.depth))
        elif config.tie_embeddings:
            nn.init.kaiming_uniform_(self.head.weight, a=math.sqrt(5))  # nn.Linear's own initialisation
        for module in self.modules():
            if hasattr(module, "init_own_parameters"):
                module.init_own_parameters()

    @staticmethod
    def _gpt2_weights(module: nn.Module) -> None:
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
        """tokens [B, T]; targets [B, T] (next tokens) for the loss; loss_mask [B, T] (0 = ignore).
        With a cache: tokens are each row's next T tokens. A chunk after earlier tokens runs the
        compiled decode step once compile_decoding() made one; a prefill too, in chunks, where it
        was given a prefill_chunk."""
        if cache is None:
            return self.run(tokens, targets, None, loss_mask)
        if self._compiled_step is not None and cache.length > 0:
            return self._cached_forward(tokens, targets, cache, loss_mask, compiled=True)
        chunked = self._compiled_step is not None and self._prefill_chunk is not None and targets is None
        if chunked and tokens.shape[1] > 0:
            return self._prefill_in_chunks(tokens, cache)
        return self._cached_forward(tokens, targets, cache, loss_mask, compiled=False)  # an eager prefill

    def _cached_forward(self, tokens, targets, cache, loss_mask, compiled: bool) -> ModelOutput:
        """The forward of tokens [B, T] through the cache, inside its bookkeeping: by the compiled
        step's graph for T tokens (its layers read the chunk as one after earlier tokens, even where
        there are none) or eagerly (an empty cache's chunk then a whole sequence)."""
        n_tokens = tokens.shape[1]
        self._check_positions(cache, n_tokens)
        cache.begin(n_tokens, whole_sequence=False if compiled else None, n_rows=tokens.shape[0])
        if compiled:
            output = self._compiled_decode(tokens, targets, cache, loss_mask)
        else:
            output = self.run(tokens, targets, cache, loss_mask)
        if cache.length > 0 and not cache.warned_autograd and output.logits is not None and output.logits.requires_grad:
            warn_autograd(cache)
        cache.end(n_tokens)
        return output

    def _prefill_in_chunks(self, tokens: Tensor, cache: ModelCache) -> ModelOutput:
        """A prefill of tokens [B, T] by the compiled step (compile_decoding's prefill_chunk C): C
        tokens at a time, the last chunk padded to C with copies of its last token and the padding
        rolled back after it (cache.truncate), so that one graph serves prompts of every length. The
        attention contract makes a sequence fed in chunks equal to the sequence fed whole, and a
        rollback exact. A padded chunk that would pass the cache's room or the model's max_seq_len
        runs eagerly instead. Returns the logits of the T tokens [B, T, V] (no auxiliary losses)."""
        chunk = self._prefill_chunk
        room = min(cache.max_len, self.config.max_seq_len)
        logits = []
        for start in range(0, tokens.shape[1], chunk):
            piece = tokens[:, start : start + chunk]  # [B, n], n <= C
            n_real = piece.shape[1]
            if n_real < chunk and start + chunk > room:
                logits.append(self._cached_forward(piece, None, cache, None, compiled=False).logits)
                continue
            if n_real < chunk:
                piece = torch.cat((piece, piece[:, -1:].expand(-1, chunk - n_real)), dim=1)  # [B, C]
            logits.append(self._cached_forward(piece, None, cache, None, compiled=True).logits[:, :n_real])
            if n_real < chunk:
                cache.truncate(start + n_real)
        return ModelOutput(logits=torch.cat(logits, dim=1))  # [B, T, V]

    def _check_positions(self, cache: ModelCache, n_tokens: int) -> None:
        if self.position_embedding is not None and cache.length + n_tokens > self.config.max_seq_len:
            raise ValueError(f"learned positions stop at max_seq_len={self.config.max_seq_len}; "
                             f"got position {cache.length + n_tokens - 1}")

    def _compiled_decode(self, tokens, targets, cache, loss_mask) -> ModelOutput:
        """The compiled step (its checks: _run_compiled)."""
        call = self._decode_call(tokens, targets, cache, loss_mask)
        return self._own_outputs(self._run_compiled("_compiled_step", call, cache, self.run, tokens, targets,
                                                    cache, loss_mask))

    def _run_compiled(self, name: str, call: tuple, cache: ModelCache, eager, *arguments):
        """Call the compiled function held at attribute `name` with `arguments` (among them `cache`),
        or, where torch.compile fails on this machine before running anything (or cannot trace a
        function given to decode_then), `eager` from then on for this entry, after one warning.

        A call like one the function has served twice runs the code dynamo made for it directly
        (direct_calls, compile_decoding's default: dynamo_code_function), or else skips most of
        dynamo's guards (skip_guard_eval_unsafe: only those telling its graphs apart are checked).
        Checking them all, and dynamo's frame evaluation itself, cost a small model a large share of
        its step on a CPU, and what the guards check cannot have changed: `call` holds what a graph
        depends on that a caller could change between calls (shapes, dtypes, modes, the modules,
        the sampling settings; the cache's tensors are always made alike by new_cache). Under the
        stance, should a guard fail all the same, dynamo refuses to compile before running
        anything, and the call is made again with every guard checked."""
        if self._decode_structure != STRUCTURE_CHANGES[0]:  # modules changed: every call is new again
            self._forget_calls()
            self._decode_structure = STRUCTURE_CHANGES[0]
        if self._frozen_weights is not None and self._frozen_weights.changed():
            log.info("the weights changed since the packed decode step froze them: compiling it again")
            self.compile_decoding(**self._compile_arguments)
        key = (name, call)
        served = self._decode_calls.get(key, 0)
        compiled = getattr(self, name)
        if self._cuda_graphs:
            pin_cache_storage(cache)
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are no longer read
        direct = self._direct_calls.get(key)
        if direct is not None:
            return direct(*arguments)
        try:
            if served >= 2:
                try:
                    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                        return compiled(*arguments)
                except Exception as error:  # noqa: BLE001 - only dynamo's refusal under the stance is retried
                    if "skip_guard_eval_unsafe" not in repr(error) + repr(error.__cause__):
                        raise
                    log.debug("a compiled decode call failed a guard dynamo skipped: checked in full")
                    served = 0
            with self._tracing_settings():
                output = compiled(*arguments)
            self._decode_calls[key] = served + 1
            if served == 1 and self._compile_arguments.get("direct_calls"):
                direct = dynamo_code_function(compiled, arguments)
                if direct is not None:
                    self._direct_calls[key] = direct
                else:  # a guard that fails after the compile (a flag read while tracing) lands here too
                    log.info("compiled decoding (%s): calls like this one cannot run dynamo's code directly and go "
                             "through its frame evaluation", name.removeprefix("_compiled_"))
            return output
        except torch._dynamo.exc.TorchDynamoException as error:  # this entry decodes eagerly from now on
            log.warning("compiled decoding (%s) failed, decoding eagerly: %s", name.removeprefix("_compiled_"),
                        str(error).splitlines()[0])
            setattr(self, name, None)
            return eager(*arguments)

    @torch.no_grad()  # draws have no gradient; a graph of several steps over one cache has no backward
    def draw(self, tokens: Tensor, cache: ModelCache, uniforms: Tensor, sampling: SamplingConfig,
             forced_tokens: Tensor | None = None, forced: Tensor | None = None, n_layers: int | None = None
             ) -> tuple[Tensor, Tensor]:
        """Feed tokens [B, T] through the cache, then draw n = uniforms.shape[1] tokens one after
        another (attnlab.generate.distribution.draw_chain: each drawn at its uniform [B] and fed
        back, but the last), under `sampling`. Returns (probs [B, n, V] each token was drawn from,
        tokens [B, n]). After compile_decoding(), a call after earlier tokens is one compiled graph:
        the n - 1 steps and the draws without a return to Python between them (speculative
        decoding's draft). n_layers: through the first n_layers blocks only, then the norm and the
        head (an early-exit draft's proposals, EarlyExitDraft: `cache` holds those blocks alone)."""
        if cache.length == 0 or self._compiled_draw is None:  # a prefill stays eager, as in forward
            return draw_chain(lambda chunk: self._forward_blocks(chunk, cache, n_layers).logits, tokens, uniforms,
                              sampling, forced_tokens, forced)
        arguments = (uniforms, sampling, forced_tokens, forced, n_layers)
        return self._compiled_chunk("_compiled_draw", tokens.shape[1] + uniforms.shape[1] - 1, tokens, cache,
                                    tuple(map(call_key, arguments)), self._draw, tokens, cache, *arguments)

    def _forward_blocks(self, tokens: Tensor, cache: ModelCache, n_layers: int | None) -> ModelOutput:
        """The cached forward of tokens [B, T]; with n_layers, through the first n_layers blocks only,
        eagerly (an early-exit draft's)."""
        if n_layers is None:
            return self(tokens, cache=cache)
        self._check_positions(cache, tokens.shape[1])
        cache.begin(tokens.shape[1], n_rows=tokens.shape[0])
        output = self.run(tokens, None, cache, None, n_layers)
        cache.end(tokens.shape[1])
        return output

    @torch.no_grad()
    def decode_then(self, function, tokens: Tensor, cache: ModelCache, *arguments):
        """function(logits [B, T, V], *arguments) of the cached forward of tokens [B, T]: after
        compile_decoding(), one graph holding the forward and the function (speculative decoding's
        verification: the forward, the target's distribution and the acceptance rule), compiled once
        per function. `function` is tensor code torch.compile can trace; its other arguments are
        tensors or settings (a SamplingConfig)."""
        if cache.length == 0 or self._compiled_decode_then is None:  # a prefill: forward's, eager or in chunks
            return function(self(tokens, cache=cache).logits, *arguments)
        return self._compiled_chunk("_compiled_decode_then", tokens.shape[1], tokens, cache,
                                    (function, *map(call_key, arguments)), self._run_then, function, tokens, cache,
                                    *arguments)

    def _compiled_chunk(self, name: str, n_fed: int, tokens: Tensor, cache: ModelCache, keys: tuple, eager,
                        *arguments):
        """A compiled entry's call (`name`, `eager`, `arguments`: _run_compiled's) that feeds tokens
        [B, T] and n_fed - T more through the cache, inside the cache's bookkeeping for n_fed tokens;
        keys: what its graph depends on of the arguments besides the chunk and the cache."""
        self._check_positions(cache, n_fed)
        cache.begin(n_fed, n_rows=tokens.shape[0])
        call = (self._decode_call(tokens, None, cache, None), *keys)
        output = self._run_compiled(name, call, cache, eager, *arguments)
        cache.end(n_fed)
        return self._own_outputs(output)

    def _run_then(self, function, tokens, cache, *arguments):
        """decode_then()'s work after cache.begin: traceable whole."""
        return function(self.run(tokens, None, cache, None).logits, *arguments)

    def drafting_blocks(self) -> tuple[Transformer, int | None]:
        """The model whose blocks draw this model's proposals and how many of them (None: all): this
        model's own (an early-exit draft names its target's first layers)."""
        return self, None

    @torch.no_grad()
    def draw_then_decode(self, draft, tokens: Tensor, draft_cache: ModelCache, cache: ModelCache, uniforms: Tensor,
                         sampling: SamplingConfig, forced_tokens: Tensor | None, forced: Tensor | None, function,
                         *arguments) -> tuple:
        """A draft's proposals, then this model's forward over them and function of its logits:
        speculative decoding's step. The draft draws n = uniforms.shape[1] tokens after tokens [B, T]
        through draft_cache (draft.draw); this model feeds the last of tokens and the n proposals
        through `cache`; returns (proposals [B, n], *function(logits [B, n + 1, V], probs [B, n, V] the
        proposals were drawn from, proposals, *arguments)). Where both models decode compiled alike
        (compile_decoding with the same settings; a draft is a Transformer or an early exit of this
        one), a call after earlier tokens is one compiled graph: a step returns to Python once rather
        than twice, each return costing a small model's step a share of its time on a CPU."""
        drafting_blocks = getattr(draft, "drafting_blocks", None)
        model, n_layers = drafting_blocks() if drafting_blocks is not None else (None, None)
        if not self._draws_then_decodes_compiled(model, draft_cache, cache):
            probs, proposals = draft.draw(tokens, draft_cache, uniforms, sampling, forced_tokens, forced)
            window = torch.cat((tokens[:, -1:], proposals), dim=1)  # [B, n + 1]
            return proposals, *self.decode_then(function, window, cache, probs, proposals, *arguments)
        if model is not self and self._frozen_weights is not None and self._frozen_draft(model).changed():
            log.info("the draft's weights changed since the packed decode step froze them: compiling it again")
            self.compile_decoding(**self._compile_arguments)
        n_drafted, n_verified = tokens.shape[1] + uniforms.shape[1] - 1, uniforms.shape[1] + 1
        model._check_positions(draft_cache, n_drafted)
        self._check_positions(cache, n_verified)
        draft_cache.begin(n_drafted, n_rows=tokens.shape[0])
        cache.begin(n_verified, n_rows=tokens.shape[0])
        call = (self._decode_call(tokens, None, cache, None), id(model), n_layers, draft_cache.max_len,
                len(draft_cache.layers), draft_cache.dtype, function,
                *map(call_key, (uniforms, sampling, forced_tokens, forced, *arguments)))
        if self._cuda_graphs:
            pin_cache_storage(draft_cache)  # the target's own is pinned by _run_compiled
        output = self._run_compiled("_compiled_draw_then_decode", call, cache, self._draw_then_run, model, n_layers,
                                    tokens, draft_cache, cache, uniforms, sampling, forced_tokens, forced, function,
                                    *arguments)
        draft_cache.end(n_drafted)
        cache.end(n_verified)
        return self._own_outputs(output)

    def _draws_then_decodes_compiled(self, model: Transformer | None, draft_cache: ModelCache, cache: ModelCache
                                     ) -> bool:
        """Whether draw_then_decode with a draft drawing through `model`'s blocks is one compiled call:
        both models compiled alike (the same settings once resolved: "cpu" asked of one, left to
        the CPU's default of the other, is alike), and neither cache empty (a prefill stays eager)."""
        return (model is not None and self._compiled_draw_then_decode is not None
                and model._compiled_draw is not None and model._compile_settings == self._compile_settings
                and cache.length > 0 and draft_cache.length > 0)

    def _frozen_draft(self, model: Transformer) -> FrozenWeights:
        """The record of a draft's weights as this model's packed draw_then_decode graphs froze them
        (made at its first call: the graph that call compiles freezes them)."""
        frozen = self._frozen_drafts.get(id(model))
        if frozen is None:
            frozen = self._frozen_drafts[id(model)] = FrozenWeights(model)
        return frozen

    def _draw_then_run(self, model, n_layers, tokens, draft_cache, cache, uniforms, sampling, forced_tokens, forced,
                       function, *arguments) -> tuple:
        """draw_then_decode()'s work after both caches' begin: traceable whole."""
        probs, proposals = model._draw(tokens, draft_cache, uniforms, sampling, forced_tokens, forced, n_layers)
        window = torch.cat((tokens[:, -1:], proposals), dim=1)  # [B, n + 1]
        return proposals, *function(self.run(window, None, cache, None).logits, probs, proposals, *arguments)

    def _draw(self, tokens, cache, uniforms, sampling, forced_tokens, forced, n_layers) -> tuple[Tensor, Tensor]:
        """draw()'s work after cache.begin: tensors in, tensors out, traceable whole."""
        return draw_chain(lambda chunk: self.run(chunk, None, cache, None, n_layers).logits, tokens, uniforms,
                          sampling, forced_tokens, forced)

    def _tracing_settings(self) -> contextlib.AbstractContextManager:
        """Around a call that may compile: a packed step's settings (packed_step_compiling)."""
        return contextlib.nullcontext() if self._frozen_weights is None else packed_step_compiling()

    def _own_outputs(self, output: ModelOutput | tuple[Tensor, ...]) -> ModelOutput | tuple[Tensor, ...]:
        """Under CUDA graphs a step's outputs live in the graph's memory, which its next replay
        overwrites: callers keep logits across steps (speculative decoding keeps a verification's),
        so the logits (or draw's tensors) are copied out ([B, T, V], small beside the step)."""
        if not self._cuda_graphs:
            return output
        if isinstance(output, tuple):
            return tuple(tensor.clone() for tensor in output)
        if output.logits is not None:
            output.logits = output.logits.clone()
        return output

    def _decode_call(self, tokens, targets, cache, loss_mask) -> tuple:
        """What tells one compiled decode call from another: the inputs' shapes, strides and kinds,
        the cache's layout (and whether inference mode made it), the grad and inference modes, the
        parameters' dtype and device. The modules' structure is checked before (STRUCTURE_CHANGES:
        quantising the model, or a longer cache regrowing the rotary tables, registers new modules or
        buffers, and then every call counts as new)."""
        parameter = next(self.parameters())
        return (tokens.shape, tokens.stride(), tokens.device, targets is None, loss_mask is None, cache.max_len,
                len(cache.layers), cache.dtype, cache.lengths.is_inference(), torch.is_grad_enabled(),
                torch.is_inference_mode_enabled(), self.training, parameter.dtype, parameter.device)

    def compile_decoding(self, mode: str | None = None, backend: str = "inductor", cpp_wrapper: bool | None = None,
                         linear: str | None = None, direct_calls: bool = True, elementwise: str | None = None,
                         prefill_chunk: int | None = None) -> bool:
        """Compile the cached forward of a chunk after earlier tokens (a decode step, a speculative
        verification): one graph per chunk length, fullgraph (the static caches give it the same
        shapes at every position, so it never recompiles per token); on CUDA with CUDA graphs
        ("reduce-overhead") unless `mode` says otherwise. Returns False, with one warning, where
        torch.compile cannot serve this device.

        prefill_chunk: None (the default), the prefill stays eager; C, the prefill runs by the same
        step C tokens at a time, its last chunk padded (_prefill_in_chunks): one graph more, for
        prompts of every length. It pays where a model prefills many prompts (a server, a benchmark)
        and the graph's compile is spent once; an eager prefill pays every operation's overhead.

        cpp_wrapper: inductor calls the step's kernels from generated C++ rather than Python. A
        small model's CPU step is mostly per-kernel calls, so this is the default there (None: on
        for inductor on the CPU without a `mode`; docs/benchmarks.md "Compiled decoding" has the
        effect); each graph takes longer to compile. CUDA graphs already remove that cost on a GPU.

        linear: the kernels of the products with a weight matrix. "library": ATen's calls (MKL,
        oneDNN, cuBLAS), the weights read as the step's inputs. "packed" (inductor on the CPU without
        a `mode`): the weights frozen into the step as constants, packed once, and multiplied by
        inductor's C++ GEMM template (decode_compile.PACKED_LINEAR_OPTIONS). A one-token step reads
        every weight once, so the product's kernel sets its speed; the template's micro-kernels read a packed
        weight once for all of a step's rows (a speculative verification's too), and the products
        of one input (queries, keys and values) are one product over their weights concatenated
        (CONCATENATED_PRODUCTS). "cpu" (the default there where attnlab's operator is built): as
        "packed", but every float32 product of more than one row by attnlab's operator over its own
        packing of the weight (model/linear_cpu.py: register blocks of 6 rows by 4 AVX-512 vectors,
        or 2 AVX2 ones); a batch-4 verification's products run faster, see
        docs/benchmarks.md "Compiled decoding". The frozen weights are checked at every step: a step
        after they changed (training, loading a state dict, quantising) compiles again.

        elementwise: "serial" (inductor on the CPU without a `mode`; the default there) runs the
        step's elementwise loops and reductions on one thread (decode_compile.SERIAL_ELEMENTWISE),
        "parallel" as inductor decides.

        direct_calls: a call like one a graph has served twice (through dynamo, every guard
        checked) runs the code dynamo made for it directly, without dynamo's frame evaluation
        (dynamo_code_function); False: through dynamo at every call, most guards skipped, which
        took a small model's CPU step 1.13-1.24x the time (docs/benchmarks.md "Compiled decoding
        on an Intel Xeon")."""
        self.prefill_chunk = prefill_chunk  # checked
        device = next(self.parameters()).device
        # each model's step has a code object of its own (own_code), under which dynamo keeps its graphs
        # (one per chunk length and cache layout): room for many before it gives up
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, DECODE_GRAPH_LIMIT)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, DECODE_GRAPH_LIMIT)
        mode = mode or ("reduce-overhead" if device.type == "cuda" and backend == "inductor" else None)
        linear = self._linear_for_weights(linear)
        options = decode_compile_options(device, mode, backend, cpp_wrapper, linear, elementwise)
        self._compile_arguments = {"mode": mode, "backend": backend, "cpp_wrapper": cpp_wrapper, "linear": linear,
                                   "direct_calls": direct_calls, "elementwise": elementwise,
                                   "prefill_chunk": prefill_chunk}
        self._compile_settings = (device, mode, backend, sorted((options or {}).items()))
        frozen = bool(options and options.get("freezing"))
        self._frozen_weights = FrozenWeights(self) if frozen else None
        try:
            self._compiled_step, self._compiled_draw, self._compiled_decode_then, self._compiled_draw_then_decode = (
                torch.compile(types.MethodType(own_code(function), self), fullgraph=True, dynamic=False, mode=mode,
                              backend=backend, options=options)
                for function in (Transformer.run, Transformer._draw, Transformer._run_then, Transformer._draw_then_run))
            self._cuda_graphs = device.type == "cuda" and mode in ("reduce-overhead", "max-autotune")
            self._forget_calls()
            self._frozen_drafts.clear()
        except Exception as error:  # noqa: BLE001 - any failure: decode eagerly, and say so once
            log.warning("compiled decoding unavailable on %s, decoding eagerly: %s", device.type, error)
            self._compiled_step = self._compiled_draw = self._compiled_decode_then = None
            self._compiled_draw_then_decode = None
        return self._compiled_step is not None

    @property
    def decoding_linear(self) -> str | None:
        """The products' kernels of the compiled step (one of LINEAR_KERNELS: compile_decoding's
        `linear` as it resolved); None where the model decodes eagerly."""
        if self._compiled_step is None:
            return None
        device, mode, backend, _ = self._compile_settings
        return resolved_linear(self._compile_arguments["linear"], takes_cpu_defaults(device, mode, backend))

    @property
    def prefill_chunk(self) -> int | None:
        """The compiled prefill's chunk (compile_decoding's prefill_chunk; None: prefills stay eager).
        It may change between generations: the graph of a new chunk is made at its first prefill."""
        return self._prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, chunk: int | None) -> None:
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"prefill_chunk must be a positive number of tokens or None, got {chunk!r}")
        self._prefill_chunk = chunk
        if self._compile_arguments:  # a compile again (its weights changed) keeps it
            self._compile_arguments["prefill_chunk"] = chunk

    def _forget_calls(self) -> None:
        """Every decode call counts as new again (the graphs or the modules changed)."""
        self._decode_calls.clear()
        self._direct_calls.clear()

    def decoding_capacity(self, length: int) -> int:
        """The capacity of the cache generate() and speculative decoding make for `length` tokens a
        row: length itself when this model decodes eagerly, rounded up after compile_decoding() so
        that generations of other lengths reuse the compiled graphs (decode_capacity)."""
        return decode_capacity(length, self.config.max_seq_len) if self.compiled_entries() else length

    def compiled_entries(self) -> list[str]:
        """The compiled decode entries this model still runs: "step", "draw", "decode_then" and
        "draw_then_decode" after compile_decoding(), less any that failed and decodes eagerly since
        (its warning said why); [] for an eager model. A benchmark reports it beside its figures."""
        entries = {"step": self._compiled_step, "draw": self._compiled_draw, "decode_then": self._compiled_decode_then,
                   "draw_then_decode": self._compiled_draw_then_decode}
        return [name for name, compiled in entries.items() if compiled is not None]

    def _linear_for_weights(self, linear: str | None) -> str | None:
        """`linear` as asked, but the library's products for weights made under torch.inference_mode:
        an inference tensor counts no versions, so a packed step could not see that its weights
        changed (one warning; asking for "packed" then is a one-line error)."""
        if not any(tensor.is_inference() for tensor in weight_tensors(self)):
            return linear
        if linear in ("packed", "cpu"):
            raise ValueError(f"{linear} linear kernels need weights made outside torch.inference_mode (their changes "
                             "are tracked by version); make the model under torch.no_grad() instead")
        if linear is None:
            log.warning("the model's weights were made under torch.inference_mode, so the decode step cannot tell "
                        "when they change: its products read them at every step (linear='library'); make the model "
                        "outside inference mode for the packed kernels")
        return "library"

    def run(self, tokens: Tensor, targets: Tensor | None, cache: ModelCache | None, loss_mask: Tensor | None,
            n_layers: int | None = None) -> ModelOutput:
        """The forward itself (`forward` adds the cache's host bookkeeping): tensors in, tensors out,
        traceable whole by torch.compile. n_layers: the first n_layers blocks only, then the norm
        and the head (an early exit: EarlyExitDraft; the cache, if any, holds those blocks)."""
        n_tokens = tokens.shape[1]
        blocks = list(self.blocks)[:n_layers]  # a list: slicing the ModuleList would register a new module
        x = self.token_embedding(tokens)  # [B, T, dim]
        if self.position_embedding is not None:
            x = x + self.position_embedding(token_positions(cache, n_tokens, tokens.device))  # [T] or [B, T]
        if self.config.reversible:  # two-stream reversible residuals (model/reversible.py)
            x = reversible_blocks(blocks, x, None if cache is None else cache.layers)
        else:
            for index, block in enumerate(blocks):
                x = block(x, None if cache is None else cache.layers[index])
        if cache is not None:
            cache.lengths += n_tokens  # every layer has written its tokens
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
        """An empty cache for incremental decoding of up to `max_len` tokens a row (default max_seq_len),
        its storage preallocated."""
        return new_model_cache(self, [block.attention for block in self.blocks], batch_size,
                               self.config.max_seq_len if max_len is None else max_len, device, dtype)

    def num_parameters(self) -> int:
        """Distinct parameters (a tied matrix counted once)."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
