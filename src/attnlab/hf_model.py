"""attnlab's own model type for Hugging Face transformers: any attnlab model, whatever its attention
(full, local, routing, sinkhorn, NSA) or feed-forward (mixture of experts included), loads with
`AutoModelForCausalLM` and decodes with `generate()`, computing what attnlab computes.

    AttnlabConfig        a PretrainedConfig holding the resolved attnlab ModelConfig (`attnlab_model`),
                         mirrored in the names tools read (vocab_size, hidden_size, max_position_embeddings)
    AttnlabForCausalLM   PreTrainedModel + GenerationMixin around `attnlab.Transformer` (`self.model`), whose
                         weights keep attnlab's names under `model.`; the forward is attnlab's, unchanged
    AttnlabCache         attnlab's per-layer caches (model/transformer.py ModelCache) as the cache generate()
                         hands from one step to the next

Why attnlab's cache and not transformers' DynamicCache: routing, sinkhorn and NSA keep more than
keys and values per layer (cluster ids, bucket summaries, compressed blocks) and only their own
caches know how to extend them. So the model tells generate() that it brings its own cache (as
Mamba does), creates one on the first forward with `use_cache=True` and returns it; generate()
passes it back on every later step. Greedy decoding then makes the same calls as attnlab's
`generate` (the prompt at once, then one token per step) and picks the same tokens. A left-padded
batch (prompts of different lengths) is decoded one row at a time (AttnlabRowsCache): each row as
it would be alone.

`register()` adds the type to transformers' Auto classes; attnlab runs it when both are imported
(attnlab/transformers_hook.py). Exported folders also carry `modeling_attnlab.py`, which imports
these classes, for `trust_remote_code=True` (hf.py writes it).

transformers 5 names the cache argument `cache`, transformers 4 `past_key_values`: both are read,
and the output carries it under the name the installed version's generate() reads.

Legend: B batch, T tokens fed, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from attnlab.attention.base import RotaryEmbedding
from attnlab.attention.routing import RoutingAttention
from attnlab.config import ModelConfig, config_from_dict, config_to_dict
from attnlab.model.transformer import ModelCache, Transformer

MODEL_TYPE = "attnlab"
# the usual config names, copied from the attnlab model config (config.json holds them too)
MIRRORED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "tie_word_embeddings")
IGNORED_LABEL = -100  # transformers' label for positions without a loss
# the output field generate() reads the cache from: `cache` in transformers 5, `past_key_values` in 4
CACHE_FIELD = "cache" if "cache" in {field.name for field in dataclasses.fields(CausalLMOutputWithPast)} \
    else "past_key_values"


class AttnlabConfig(PretrainedConfig):
    """The resolved attnlab ModelConfig as a transformers config. `attnlab_model` is the source of
    truth; the usual names are copies for tools that read them (lm-eval reads max_position_embeddings)."""

    model_type = MODEL_TYPE

    def __init__(self, attnlab_model: dict[str, Any] | None = None, **kwargs: Any) -> None:
        model = config_from_dict(attnlab_model or {}, ModelConfig)  # checked: unknown keys fail
        for name in MIRRORED:  # config.json holds them too; they always follow attnlab_model
            kwargs.pop(name, None)
        self.attnlab_model = config_to_dict(model)
        self.vocab_size = model.num_tokens
        self.hidden_size = model.dim
        self.num_hidden_layers = model.depth
        self.num_attention_heads = model.heads
        self.num_key_value_heads = model.n_kv_heads
        self.head_dim = model.dim_head
        self.max_position_embeddings = model.max_seq_len
        kwargs["tie_word_embeddings"] = model.tie_embeddings  # attnlab ties them itself; kept consistent
        super().__init__(**kwargs)

    @property
    def model_config(self) -> ModelConfig:
        return config_from_dict(self.attnlab_model, ModelConfig)


class AttnlabCache:
    """attnlab's caches of every layer for generate(), and the tokens fed so far ([B, L]).

    Storage is preallocated (model.new_cache): for max_seq_len tokens, or the prompt if longer. A
    forward that needs more room moves to a cache twice as large by feeding it the tokens so far
    (exact to ~1e-5: the cache-equivalence contract), so generate() may run past max_seq_len."""

    is_compileable = False  # transformers: do not compile decoding around this cache

    def __init__(self, model: Transformer, batch_size: int, capacity: int) -> None:
        self.model = model
        self.layers: ModelCache = model.new_cache(batch_size, capacity)
        device = next(model.parameters()).device
        self.tokens = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # [B, L]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers.length

    def feed(self, tokens: Tensor) -> ModelCache:
        """The caches to run the next tokens [B, T] through, with room for them."""
        needed = self.layers.length + tokens.shape[1]
        if needed > self.layers.max_len:
            self.layers = self.model.new_cache(tokens.shape[0], max(needed, 2 * self.layers.max_len))
            if self.tokens.shape[1]:
                self.model(self.tokens, cache=self.layers)  # the same state, in a larger store
        self.tokens = torch.cat((self.tokens, tokens), dim=1)
        return self.layers


class AttnlabRowsCache:
    """The caches of a left-padded batch (generate() on prompts of different lengths, as lm-eval's
    generation tasks give them): one AttnlabCache per row, fed that row's tokens without its
    padding, so each row makes the calls it would make alone and decodes what it would decode alone,
    bit for bit. attnlab's attention cannot skip padding inside what it attends to (routing, sinkhorn
    and NSA group positions: a shifted prompt is another computation), hence one row at a time."""

    is_compileable = False

    def __init__(self, model: Transformer, padding: list[int]) -> None:
        self.model = model
        self.padding = padding  # [B] padding tokens before each row's prompt
        self.rows: list[AttnlabCache | None] = [None] * len(padding)  # made by the first forward

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The padded length generate() counts: the same for every row."""
        return self.padding[0] + self.rows[0].get_seq_length() if self.rows[0] is not None else 0

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids [B, T] -> logits [B, T, V], each row's from its own cache; zeros at padding."""
        logits = []
        for row, tokens in enumerate(input_ids):  # tokens [T]
            start = self.padding[row] if self.rows[row] is None else 0  # the prompt: skip its padding
            fed = tokens[None, start:]  # [1, T - start]
            if self.rows[row] is None:
                self.rows[row] = AttnlabCache(self.model, 1, max(self.model.config.max_seq_len, fed.shape[1]))
            out = self.model(fed, cache=self.rows[row].feed(fed)).logits  # [1, T - start, V]
            logits.append(F.pad(out, (0, 0, start, 0)))
        return torch.cat(logits)


def left_padding(attention_mask: Tensor | None, cached: bool) -> list[int] | None:
    """attnlab attends to every token it is given. A mask of ones is what it computes, and so are
    zeros after the ones (right padding) in a parallel forward, since attention is causal: None.
    In a cached call (generate) a row may start with zeros (left padding): their count per row, for
    AttnlabRowsCache. Anything else (zeros between ones, right padding while decoding, a row of
    padding only) would be computed wrongly: refused."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    mask = attention_mask.long()
    if not cached and bool((mask.cummin(dim=-1).values == mask).all()):  # no 1 after a 0
        return None
    counts = (mask == 0).sum(dim=-1)  # [B]
    if cached and bool((mask.cummax(dim=-1).values == mask).all()) and bool((counts < mask.shape[1]).all()):
        return counts.tolist()
    raise ValueError("attnlab models take no padding inside the tokens they attend to: an attention_mask may "
                     "only have zeros after its ones in a parallel forward, and before them (left padding) "
                     "when generating, with at least one token a row")


def next_token_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """transformers' causal LM loss: position t predicts labels[t + 1]; labels of -100 are skipped."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORED_LABEL)


class AttnlabForCausalLM(PreTrainedModel, GenerationMixin):
    """attnlab.Transformer as a transformers causal language model."""

    config_class = AttnlabConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.head.weight": "model.token_embedding.embed.weight"}  # used when tied

    def __init__(self, config: AttnlabConfig) -> None:
        super().__init__(config)
        self.model = Transformer(config.model_config)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() leaves the cache to the model: attnlab's own (see the module docstring)

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Rebuild the state that is not saved. transformers builds the model on the meta device and
        loads the weights into it; the rotary tables and routing's per-step statistics are not in
        the weights, so they are made again here. Everything saved comes from the checkpoint (or,
        for a new model, from attnlab's own initialisation in Transformer)."""
        if isinstance(module, RotaryEmbedding):
            fresh = RotaryEmbedding(module.dim_head, module.theta, module.cos.shape[0])
            module.cos.copy_(fresh.cos)
            module.sin.copy_(fresh.sin)
        elif isinstance(module, RoutingAttention):
            module.centroid_sums.zero_()
            module.centroid_counts.zero_()

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.token_embedding.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.head

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: AttnlabCache | None = None,
        past_key_values: AttnlabCache | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        **ignored: Any,  # what generate() passes for other models (position_ids, return_dict, ...): not needed
    ) -> CausalLMOutputWithPast:
        """input_ids [B, T] -> logits [B, T, V]. With a cache (given, or made when use_cache=True),
        the tokens follow those it holds; positions come from the cache, as in attnlab."""
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("attnlab models take input_ids (inputs_embeds are not supported)")
        cache = cache if cache is not None else past_key_values
        padding = left_padding(attention_mask, cached=cache is not None or bool(use_cache))
        if cache is None and padding is not None:  # a left-padded prompt: one row at a time
            cache = AttnlabRowsCache(self.model, padding)
        elif cache is None and use_cache:
            capacity = max(self.model.config.max_seq_len, input_ids.shape[1])
            cache = AttnlabCache(self.model, input_ids.shape[0], capacity)
        elif cache is not None and attention_mask is not None and padding != getattr(cache, "padding", None):
            raise ValueError("attnlab models take an attention_mask whose padding is the prompt's while decoding: "
                             "ones after it for every token generated")
        if isinstance(cache, AttnlabRowsCache):
            logits = cache.forward(input_ids)  # [B, T, V]
        else:
            layers = None if cache is None else cache.feed(input_ids)
            logits = self.model(input_ids, cache=layers).logits  # [B, T, V]
        loss = None if labels is None else next_token_loss(logits, labels)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})


def register() -> None:
    """Make `AutoConfig` and `AutoModelForCausalLM` know model_type "attnlab"."""
    AutoConfig.register(MODEL_TYPE, AttnlabConfig, exist_ok=True)
    AutoModelForCausalLM.register(AttnlabConfig, AttnlabForCausalLM, exist_ok=True)
