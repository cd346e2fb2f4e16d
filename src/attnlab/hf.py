"""Hugging Face checkpoints: export an attnlab model as a folder transformers loads, natively where
transformers has the architecture (Llama; Qwen2-MoE for a mixture of experts; Mistral for local
attention), as attnlab's own model type (hf_model.py) otherwise; import a Llama or Qwen2-MoE
checkpoint as an attnlab run.

attnlab's own type needs no correspondence: its config.json carries the whole model config and its
weights keep attnlab's names (under `model.`), beside a modeling_attnlab.py that imports the classes.
The native correspondences follow.

A dense, full-attention attnlab model with RMSNorm, rotary positions, SwiGLU and bias-free linears
(MiniMind's architecture, grouped-query attention and tied embeddings allowed) computes exactly
what `transformers.LlamaForCausalLM` computes, so the conversion is a renaming of weights plus a
config.json. Every correspondence below was checked against the model code, and tests/test_export.py
compares logits both ways:

    attnlab (model/transformer.py, layers.py, attention/)      HF Llama (modeling_llama.py)
    token_embedding.embed.weight, no scale                     model.embed_tokens.weight, no scale
    blocks.i.attention_norm  nn.RMSNorm(dim, eps)              model.layers.i.input_layernorm
    blocks.i.attention.heads.to_q / to_k / to_v / to_out       self_attn.q_proj / k_proj / v_proj / o_proj
    blocks.i.feed_forward_norm                                 post_attention_layernorm
    blocks.i.feed_forward.inner.gate / up / down               mlp.gate_proj / up_proj / down_proj
        down(silu(gate(x)) * up(x))                                down(silu(gate(x)) * up(x))
    norm, head (tied: the embedding matrix)                    model.norm, lm_head (tie_word_embeddings)

Mistral is Llama with a sliding window: a query sees the last `sliding_window` keys, itself included,
as attnlab's local attention sees `window_size` (attention/local.py).

Rotary positions need no permutation of the query and key rows: attnlab's RotaryEmbedding splits a
head into halves x1, x2 and returns (x1 cos - x2 sin, x2 cos + x1 sin), which is HF's
`x * cos + rotate_half(x) * sin` with rotate_half(x) = (-x2, x1), both pairing dimension i with
i + D/2 at frequency theta^(-2i/D). (Meta's original Llama weights pair neighbouring dimensions
and need a permutation; neither side here does.) Both scale attention scores by 1/sqrt(D).

A mixture-of-experts feed-forward (model/moe.py) exports as `Qwen2MoeForCausalLM`, whose layers are
Llama's but for the feed-forward: softmax top-k router, SwiGLU experts, one sigmoid-gated shared
expert. `moe_tensors` explains how attnlab's ungated shared experts fit that exactly; import reads
a Qwen2-MoE back only in that shape (zero shared-expert gate and attention biases), Llama in any.

RMSNorm epsilon: attnlab's `model.norm_eps: null` means nn.RMSNorm's default, the machine epsilon
of the input dtype; it is exported as float32's, 2^-23 ~ 1.19e-7, the value of a float32 model.

Checkpoints are read without unpickling: safetensors, or a torch file with `weights_only=True`.
Legend: V vocabulary, dim model width, H query heads, G key/value heads, D head width, F hidden width,
E routed experts, S shared experts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from attnlab.config import (
    DataConfig,
    ModelConfig,
    MoEConfig,
    RunConfig,
    TrainConfig,
    check_model,
    config_to_dict,
    save_config,
)
from attnlab.data.files import copy_atomic, write_atomic
from attnlab.data.shards import TOKENIZER_FOLDER
from attnlab.data.tokenizer import BOS_TOKEN, TOKENIZER_FILE, byte_symbols
from attnlab.errors import ConfigError, ConversionError
from attnlab.model.layers import hidden_width
from attnlab.model.transformer import Transformer
from attnlab.train.checkpoint import CHECKPOINT_DIR, checkpoint_path, list_checkpoints, load_model, save_checkpoint
from attnlab.train.checksum import load_safetensors, save_safetensors

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SHARDED_INDEX_FILE = "model.safetensors.index.json"
TORCH_WEIGHTS_FILE = "pytorch_model.bin"
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json")
RUN_TOKENIZER_DIR = TOKENIZER_FOLDER  # where a run keeps its tokenizer files: `tokenizer_for` reads them there
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GENERATION_CONFIG_FILE = "generation_config.json"
ATTNLAB = "attnlab"  # the architecture name of attnlab's own model type (hf_model.py)
# `--model-type`: auto = native where transformers has the architecture (Llama, Qwen2-MoE, Mistral),
# attnlab's own type otherwise; native = refuse rather than use attnlab's type; attnlab = always attnlab's
MODEL_TYPES = ("auto", "native", ATTNLAB)
MODELING_FILE = "modeling_attnlab.py"
MODELING_SOURCE = '''"""attnlab's model type for transformers (`trust_remote_code=True`). The classes are attnlab's own:
attnlab must be installed where this folder is loaded (pip install attnlab); this file only names them."""

from attnlab.hf_model import AttnlabConfig, AttnlabForCausalLM

__all__ = ["AttnlabConfig", "AttnlabForCausalLM"]
'''
Tensors = dict[str, torch.Tensor]  # a state dict: parameter name -> tensor

# The ModelConfig fields export knows: mapped to HF, checked below, or without effect on the logits
# (ff_chunks splits the same computation, dropout and loss_chunk_size act in training only, init
# draws the weights a run starts from, which the checkpoint's replace). Any
# other field, an option added later, must be at its default or the export is refused: it could
# change what the model computes.
KNOWN_MODEL_OPTIONS = frozenset({
    "num_tokens", "dim", "depth", "heads", "dim_head", "kv_heads", "max_seq_len", "emb_dim", "position",
    "rope_theta", "norm", "norm_eps", "feed_forward", "ff_mult", "ff_hidden", "tie_embeddings", "reversible",
    "attention", "moe", "ff_chunks", "dropout", "loss_chunk_size", "init",
})


# --------------------------------------------------------------------------------------------
# The correspondence, shared by both directions


def hf_family(config: ModelConfig) -> str:
    """The transformers architecture a model exports as natively: Llama, Qwen2-MoE for a mixture of
    experts, Mistral (Llama with a sliding window) for local attention."""
    if config.feed_forward == "moe":
        return "Qwen2-MoE"
    return "Mistral" if config.attention.kind == "local" else "Llama"


def hf_incompatibilities(config: ModelConfig) -> list[str]:
    """Why `config` has no Hugging Face equivalent; empty when it has one."""
    family = hf_family(config)
    reasons = []
    if config.attention.kind not in ("full", "local") or (config.attention.kind == "local" and family != "Mistral"):
        reasons.append(f"attention.kind={config.attention.kind} ({family} attends to every earlier token)")
    if config.norm != "rmsnorm":
        reasons.append(f"norm={config.norm} ({family} uses RMSNorm without bias)")
    if config.feed_forward not in ("swiglu", "moe"):
        reasons.append(f"feed_forward={config.feed_forward} ({family}'s feed-forward is SwiGLU)")
    if config.position != "rotary":
        reasons.append(f"position={config.position} ({family} uses rotary positions)")
    if config.emb_dim is not None:
        reasons.append(f"emb_dim={config.emb_dim} ({family} has no factorised embedding)")
    if config.reversible:
        reasons.append(f"reversible=true ({family} has ordinary residuals)")
    defaults = type(config)()
    for option in dataclasses.fields(config):
        value = getattr(config, option.name)
        if option.name not in KNOWN_MODEL_OPTIONS and value != getattr(defaults, option.name):
            reasons.append(f"{option.name}={value} (an option the exporter does not know)")
    return reasons


def check_exportable(config: ModelConfig) -> None:
    reasons = hf_incompatibilities(config)
    if reasons:
        raise ConversionError(f"no Hugging Face {hf_family(config)} equivalent: {'; '.join(reasons)}")


def weight_names(config: ModelConfig) -> list[tuple[str, str]]:
    """(attnlab state_dict key, HF key) for every stored matrix and norm weight that is renamed
    as it is: all of them, except a mixture of experts' feed-forward (see `moe_tensors`).
    A tied head is left out: HF ties lm_head to the embedding itself (tie_word_embeddings)."""
    names = [("token_embedding.embed.weight", "model.embed_tokens.weight")]
    for index in range(config.depth):
        ours, theirs = f"blocks.{index}.", f"model.layers.{index}."
        names += [
            (ours + "attention_norm.weight", theirs + "input_layernorm.weight"),
            (ours + "attention.heads.to_q.weight", theirs + "self_attn.q_proj.weight"),  # [H*D, dim]
            (ours + "attention.heads.to_k.weight", theirs + "self_attn.k_proj.weight"),  # [G*D, dim]
            (ours + "attention.heads.to_v.weight", theirs + "self_attn.v_proj.weight"),  # [G*D, dim]
            (ours + "attention.heads.to_out.weight", theirs + "self_attn.o_proj.weight"),  # [dim, H*D]
            (ours + "feed_forward_norm.weight", theirs + "post_attention_layernorm.weight"),
        ]
        if config.feed_forward != "moe":
            names += [
                (ours + "feed_forward.inner.gate.weight", theirs + "mlp.gate_proj.weight"),  # [F, dim]
                (ours + "feed_forward.inner.up.weight", theirs + "mlp.up_proj.weight"),  # [F, dim]
                (ours + "feed_forward.inner.down.weight", theirs + "mlp.down_proj.weight"),  # [dim, F]
            ]
    names.append(("norm.weight", "model.norm.weight"))
    if not config.tie_embeddings:
        names.append(("head.weight", "lm_head.weight"))
    return names


def moe_tensors(state: Tensors, config: ModelConfig, index: int) -> tuple[Tensors, list[str]]:
    """Layer `index`'s mixture-of-experts feed-forward as Qwen2-MoE tensors, and the attnlab keys used.

    The router and the routed experts are renamed as they are: Qwen2-MoE routes by a softmax over
    `mlp.gate` logits in float32, takes the top k, renormalises them when norm_topk_prob (attnlab:
    normalize_top_k and k > 1) and runs experts down(silu(gate x) * up x), as model/moe.py does.
    Qwen2-MoE has one shared expert whose output is scaled by sigmoid(shared_expert_gate x), where
    attnlab sums its shared experts ungated. So the shared experts are joined along the hidden
    width (a sum of SwiGLUs is one SwiGLU over their hidden units together), the gate is zero
    (sigmoid(0) = 1/2 exactly) and the down projection doubled (exact in floating point). Without
    shared experts, a one-unit shared expert of zeros adds exactly 0. Qwen2's attention has query,
    key and value biases, which are written as zeros.
    """
    ours, theirs = f"blocks.{index}.feed_forward.inner.", f"model.layers.{index}.mlp."
    tensors = {theirs + "gate.weight": state[ours + "router.weight"]}  # [E, dim]
    used = [ours + "router.weight"]
    for expert in range(config.moe.n_experts):
        for part in ("gate", "up", "down"):
            tensors[f"{theirs}experts.{expert}.{part}_proj.weight"] = state[f"{ours}experts.{expert}.{part}.weight"]
            used.append(f"{ours}experts.{expert}.{part}.weight")
    shared = {
        part: [state[f"{ours}shared_experts.{number}.{part}.weight"] for number in range(config.moe.n_shared_experts)]
        for part in ("gate", "up", "down")
    }
    used += [f"{ours}shared_experts.{number}.{part}.weight"
             for number in range(config.moe.n_shared_experts) for part in ("gate", "up", "down")]
    if config.moe.n_shared_experts:
        tensors[theirs + "shared_expert.gate_proj.weight"] = torch.cat(shared["gate"], dim=0)  # [S*F, dim]
        tensors[theirs + "shared_expert.up_proj.weight"] = torch.cat(shared["up"], dim=0)  # [S*F, dim]
        tensors[theirs + "shared_expert.down_proj.weight"] = 2 * torch.cat(shared["down"], dim=1)  # [dim, S*F]
    else:
        tensors[theirs + "shared_expert.gate_proj.weight"] = torch.zeros(1, config.dim)
        tensors[theirs + "shared_expert.up_proj.weight"] = torch.zeros(1, config.dim)
        tensors[theirs + "shared_expert.down_proj.weight"] = torch.zeros(config.dim, 1)
    tensors[theirs + "shared_expert_gate.weight"] = torch.zeros(1, config.dim)
    attention = f"model.layers.{index}.self_attn."
    for projection, width in (("q", config.heads), ("k", config.n_kv_heads), ("v", config.n_kv_heads)):
        tensors[f"{attention}{projection}_proj.bias"] = torch.zeros(width * config.dim_head)  # Qwen2's biases, 0
    return tensors, used


def rms_norm_eps(config: ModelConfig) -> float:
    """The epsilon attnlab's RMSNorm adds, for a float32 model (see the module docstring)."""
    return config.norm_eps if config.norm_eps is not None else torch.finfo(torch.float32).eps


def llama_config(config: ModelConfig, dtype: str, special_ids: dict[str, int | None]) -> dict[str, Any]:
    """config.json of the LlamaForCausalLM equivalent to `config`. Both spellings of the rotary base
    are written: `rope_theta` (transformers 4) and `rope_parameters` (transformers 5)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.num_tokens,
        "hidden_size": config.dim,
        "intermediate_size": hidden_width(config, gated=True),  # the width SwiGLU builds
        "num_hidden_layers": config.depth,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.dim_head,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": rms_norm_eps(config),
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": config.attention.dropout,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        **special_ids,
    }


def qwen2_moe_config(config: ModelConfig, dtype: str, special_ids: dict[str, int | None]) -> dict[str, Any]:
    """config.json of the Qwen2MoeForCausalLM equivalent to a mixture-of-experts `config`: every
    layer sparse, zero query/key/value biases, no sliding window (see `moe_tensors` for the experts)."""
    hf = llama_config(config, dtype, special_ids)
    for llama_only in ("attention_bias", "mlp_bias"):
        del hf[llama_only]
    width = hidden_width(config, gated=True)
    return {
        **hf,
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "qkv_bias": True,  # zero biases are written: transformers 4 always builds them, 5 reads this flag
        "use_sliding_window": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": config.moe.n_experts,
        "num_experts_per_tok": config.moe.top_k,
        "norm_topk_prob": config.moe.normalize_top_k and config.moe.top_k > 1,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": max(1, config.moe.n_shared_experts * width),
        "router_aux_loss_coef": config.moe.balance_loss_weight,
        "output_router_logits": False,
    }


def mistral_config(config: ModelConfig, dtype: str, special_ids: dict[str, int | None]) -> dict[str, Any]:
    """config.json of the MistralForCausalLM equivalent to a local-attention `config`: Llama's layers
    with a sliding window, in which a query sees the last `sliding_window` keys, itself included:
    attnlab's window_size (attention/local.py). max_rollback and the back-end change no logits."""
    hf = llama_config(config, dtype, special_ids)
    for llama_only in ("attention_bias", "mlp_bias"):
        del hf[llama_only]
    return {**hf, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "sliding_window": config.attention.local.window_size}


def attnlab_config(config: ModelConfig, dtype: str, special_ids: dict[str, int | None]) -> dict[str, Any]:
    """config.json of attnlab's own model type (hf_model.py), for any model: the whole resolved model
    config, the usual names mirrored for tools that read config.json, and `auto_map` naming the
    classes in the folder's modeling_attnlab.py for `trust_remote_code=True`."""
    return {
        "architectures": ["AttnlabForCausalLM"],
        "model_type": ATTNLAB,
        "auto_map": {"AutoConfig": "modeling_attnlab.AttnlabConfig",
                     "AutoModelForCausalLM": "modeling_attnlab.AttnlabForCausalLM"},
        "attnlab_model": config_to_dict(config),
        "vocab_size": config.num_tokens,
        "hidden_size": config.dim,
        "num_hidden_layers": config.depth,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.dim_head,
        "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings,
        "use_cache": True,
        "torch_dtype": dtype,
        **special_ids,
    }


CONFIG_WRITERS = {"Llama": llama_config, "Qwen2-MoE": qwen2_moe_config, "Mistral": mistral_config,
                  ATTNLAB: attnlab_config}


# --------------------------------------------------------------------------------------------
# Export


def find_tokenizer(run_dir: Path, run_config: RunConfig | None) -> Path | None:
    """The tokenizer folder of a run: RUN/tokenizer/ (imported runs) or the copy beside the token
    shards of a tokenized run; None for a byte-level run that has none."""
    candidates = [run_dir / RUN_TOKENIZER_DIR]
    tokenized = run_config is not None and run_config.data.source in ("tokens", "builtin-tokens")
    if tokenized:
        from attnlab.data.pretrain import token_folder  # shards keep the tokenizer their ids belong to

        candidates.append(token_folder(run_config.data) / TOKENIZER_FOLDER)
    for folder in candidates:
        if (folder / TOKENIZER_FILES[0]).is_file():
            return folder
    if tokenized:
        looked = " and no ".join(str(folder / TOKENIZER_FILES[0]) for folder in candidates)
        raise ConversionError(f"the tokenizer of {run_dir} is missing: no {looked}; pass --tokenizer DIR")
    return None


def special_token_ids(tokenizer_dir: Path | None) -> dict[str, int | None]:
    """bos/eos/pad ids named by a tokenizer folder's special_tokens_map.json, for config.json.
    ConversionError when the folder's files cannot be read (checked before anything is written)."""
    ids: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if tokenizer_dir is None:
        return ids
    from tokenizers import Tokenizer as BackendTokenizer

    special_file = tokenizer_dir / "special_tokens_map.json"
    try:
        tokenizer = BackendTokenizer.from_file(str(tokenizer_dir / TOKENIZER_FILE))
        special_map = json.loads(special_file.read_text()) if special_file.is_file() else {}
    except Exception as error:  # a truncated or foreign file: the parsers' errors vary
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise ConversionError(f"the tokenizer in {tokenizer_dir} cannot be read ({reason})") from error
    for role in ("bos", "eos", "pad"):
        token = special_map.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None:
            ids[f"{role}_token_id"] = tokenizer.token_to_id(token)
    return ids


def write_byte_tokenizer(out_dir: Path) -> bool:
    """A tokenizer whose ids are the bytes themselves (byte b -> id b), for byte-level models:
    byte-level BPE with no merges over GPT-2's byte alphabet. False when `tokenizers` is missing."""
    try:
        import tokenizers
    except ImportError:
        log.warning("tokenizers is not installed: no tokenizer written; token id = byte value")
        return False
    symbol_of, _ = byte_symbols()
    vocabulary = {symbol_of[byte]: byte for byte in range(256)}  # id b is byte b
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocabulary, merges=[]))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    write_atomic(out_dir / TOKENIZER_FILES[0], tokenizer.to_str(pretty=True).encode())  # as tokenizer.save writes
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    write_atomic(out_dir / "tokenizer_config.json", (json.dumps(tokenizer_config, indent=2) + "\n").encode())
    return True


def _prepare_out_dir(out_dir: Path, overwrite: bool, own_checkpoint: Path | None = None) -> None:
    """Make `out_dir` for writing: refused if it is a file, if it is not empty (unless `overwrite`),
    or, even with `overwrite`, if it holds a run's checkpoints other than `own_checkpoint` (the one
    the write replaces): an export would replace the run's model.safetensors, and an import's step-0
    checkpoint would lie under the run's later ones, which attnlab would load instead of it."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"{out_dir} is a file, not a folder; choose a folder to write")
    others = [path.name for path in list_checkpoints(out_dir) if path != own_checkpoint]
    if others:
        raise ConversionError(f"{out_dir} holds an attnlab run ({CHECKPOINT_DIR}/{others[-1]}), which writing into it "
                              "would damage; choose another folder")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConversionError(f"{out_dir} is not empty; choose another folder or pass --force")
    out_dir.mkdir(parents=True, exist_ok=True)


def choose_architecture(config: ModelConfig, model_type: str = "auto") -> str:
    """What a model exports as (`--model-type`, MODEL_TYPES): its native transformers architecture
    (hf_family) when there is one, else attnlab's own model type; `native` refuses instead."""
    if model_type not in MODEL_TYPES:
        raise ConversionError(f"model type {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
    if model_type == ATTNLAB:
        return ATTNLAB
    if model_type == "native":
        check_exportable(config)
    return ATTNLAB if hf_incompatibilities(config) else hf_family(config)


def native_tensors(state: Tensors, config: ModelConfig) -> Tensors:
    """attnlab weights renamed as the native architecture's (weight_names, moe_tensors); a weight with
    no counterpart is refused rather than dropped."""
    names = weight_names(config)
    tensors = {theirs: state[ours] for ours, theirs in names}
    used = {ours for ours, _ in names} | ({"head.weight"} if config.tie_embeddings else set())
    if config.feed_forward == "moe":
        for index in range(config.depth):
            layer_tensors, layer_used = moe_tensors(state, config, index)
            tensors.update(layer_tensors)
            used.update(layer_used)
    unmapped = sorted(set(state) - used)
    if unmapped:  # a weight HF has no place for (a future option): refuse rather than drop it
        raise ConversionError(f"weights with no {hf_family(config)} counterpart: {', '.join(unmapped[:5])}")
    return tensors


def attnlab_tensors(state: Tensors, config: ModelConfig) -> Tensors:
    """attnlab's own weights and saved buffers (routing centroids) under `model.`, as AttnlabForCausalLM
    holds them; a tied head is the embedding, stored once (transformers ties it again on loading)."""
    return {f"model.{name}": value for name, value in state.items()
            if not (config.tie_embeddings and name == "head.weight")}


def write_tokenizer_files(out_dir: Path, tokenizer_dir: Path | None, num_tokens: int) -> None:
    """The tokenizer's files; a 256-token model without one gets the byte tokenizer."""
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                copy_atomic(tokenizer_dir / name, out_dir / name)
    elif num_tokens == 256:
        write_byte_tokenizer(out_dir)
    else:
        log.warning("no tokenizer found for a %d-token model: exported without tokenizer files", num_tokens)


def write_configs(out_dir: Path, architecture: str, config: ModelConfig, dtype: str,
                  special_ids: dict[str, int | None]) -> None:
    """config.json, generation_config.json (the special tokens generate() stops at and pads with)
    and, for attnlab's own type, the modeling_attnlab.py that config.json's auto_map names."""
    hf_config = CONFIG_WRITERS[architecture](config, dtype, special_ids)
    write_atomic(out_dir / CONFIG_FILE, (json.dumps(hf_config, indent=2) + "\n").encode())
    generation = {name: value for name, value in special_ids.items() if value is not None}
    write_atomic(out_dir / GENERATION_CONFIG_FILE, (json.dumps(generation, indent=2) + "\n").encode())
    if architecture == ATTNLAB:
        write_atomic(out_dir / MODELING_FILE, MODELING_SOURCE.encode())


def check_finite_in(tensors: dict[str, torch.Tensor], dtype: str) -> None:
    """ConversionError where a weight is no longer finite in `dtype`: a value beyond float16's
    65504 became infinite in the cast, and the exported model would compute inf and NaN."""
    for name, value in tensors.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise ConversionError(f"{name} is not finite in {dtype} (a weight beyond its range): export in "
                                  f"bfloat16 or float32")


def export_model(
    model: Transformer,
    out_dir: str | Path,
    dtype: str = "float32",
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
    model_type: str = "auto",
) -> Path:
    """Write `model` as a Hugging Face folder: model.safetensors, config.json, generation_config.json
    and, when given, the tokenizer files of `tokenizer_dir` (a 256-token model without one gets the
    byte tokenizer). The architecture is native where transformers has one (Llama, Qwen2-MoE,
    Mistral), attnlab's own model type otherwise (`model_type`, see MODEL_TYPES). Raises
    ConversionError before writing anything."""
    config = model.config
    architecture = choose_architecture(config, model_type)
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    if tokenizer_dir is not None and not (tokenizer_dir / TOKENIZER_FILES[0]).is_file():
        raise ConversionError(f"no {TOKENIZER_FILES[0]} in the tokenizer folder {tokenizer_dir}")
    special_ids = special_token_ids(tokenizer_dir)  # the tokenizer is read before anything is written
    state = {name: value.detach().cpu() for name, value in model.state_dict().items()}
    tensors = attnlab_tensors(state, config) if architecture == ATTNLAB else native_tensors(state, config)
    # contiguous copies: safetensors refuses views and tensors that share memory
    tensors = {name: value.to(DTYPES[dtype]).contiguous().clone() for name, value in tensors.items()}
    check_finite_in(tensors, dtype)
    out_dir = Path(out_dir)
    _prepare_out_dir(out_dir, overwrite)
    save_safetensors(tensors, out_dir / WEIGHTS_FILE)  # staged and renamed: never half a file
    write_tokenizer_files(out_dir, tokenizer_dir, config.num_tokens)
    write_configs(out_dir, architecture, config, dtype, special_ids)
    log.info("exported %d tensors to %s (%s, %s)", len(tensors), out_dir, architecture, dtype)
    return out_dir


def export_run(
    run_or_checkpoint: str | Path,
    out_dir: str | Path,
    weights: str = "auto",
    dtype: str = "float32",
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
    model_type: str = "auto",
) -> Path:
    """`attnlab export RUN --format hf --out DIR`: the run's latest checkpoint (or the given one) as a
    Hugging Face folder (export_model), with the run's tokenizer when it has one."""
    model = load_model(run_or_checkpoint, weights=weights)
    choose_architecture(model.config, model_type)  # refused before the tokenizer is looked for
    path = Path(run_or_checkpoint)
    run_dir = path if path.is_dir() else path.parent.parent  # RUN/checkpoints/step-N.pt -> RUN
    if tokenizer_dir is None:
        tokenizer_dir = find_tokenizer(run_dir, model.run_config)
    return export_model(model, out_dir, dtype=dtype, tokenizer_dir=tokenizer_dir, overwrite=overwrite,
                        model_type=model_type)


# --------------------------------------------------------------------------------------------
# Import


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / CONFIG_FILE
    if not path.is_file():
        raise ConversionError(f"{hf_dir} has no {CONFIG_FILE}: not a Hugging Face checkpoint folder")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConversionError(f"{path}: not valid JSON ({error.msg})") from error
    if not isinstance(hf, dict):
        raise ConversionError(f"{path}: not a model config (a JSON {type(hf).__name__}, not an object)")
    return hf


IMPORTABLE = {"llama": "LlamaForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
# config.json's counts and widths, positive integers where given, and its real numbers
HF_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "max_position_embeddings", "moe_intermediate_size", "num_experts",
            "num_experts_per_tok", "shared_expert_intermediate_size")
HF_REALS = ("rope_theta", "rms_norm_eps", "router_aux_loss_coef")


def malformed_values(hf: dict[str, Any]) -> list[str]:
    """config.json's numbers of the wrong kind (a string, a fraction, zero or less where a width is due;
    null where a real number is), as key=value: read as they are, they fail with a traceback."""
    def is_size(value: Any) -> bool:
        return value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)

    def is_real(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    wrong = [key for key in HF_SIZES if not is_size(hf.get(key))]
    wrong += [key for key in HF_REALS if key in hf and not is_real(hf[key])]
    return [f"{key}={hf[key]!r}" for key in wrong]


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The attnlab ModelConfig equal to a LlamaForCausalLM config.json (or a Qwen2MoeForCausalLM one
    of the shape attnlab exports); ConversionError for options attnlab does not compute (rope
    scaling, biases, another activation, dense layers between sparse ones, ...)."""
    model_type = hf.get("model_type")
    if model_type not in IMPORTABLE:
        raise ConversionError(f"model_type {model_type!r} is not supported; only 'llama' (LlamaForCausalLM) "
                              "and 'qwen2_moe' as attnlab exports it")
    moe = model_type == "qwen2_moe"
    required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
    required += ["moe_intermediate_size", "num_experts", "num_experts_per_tok", "shared_expert_intermediate_size"] \
        if moe else ["intermediate_size"]
    missing = [key for key in required if hf.get(key) is None]
    if missing:
        raise ConversionError(f"{CONFIG_FILE} lacks {', '.join(missing)}")
    malformed = malformed_values(hf)
    if malformed:
        raise ConversionError(f"{CONFIG_FILE} has malformed values: {', '.join(malformed)}")
    rope = hf.get("rope_parameters") or {}  # transformers 5; 4 writes rope_theta and rope_scaling
    scaling = hf.get("rope_scaling") or {}
    problems = []
    for rope_type in (rope.get("rope_type", rope.get("type")), scaling.get("rope_type", scaling.get("type"))):
        if rope_type not in (None, "default"):
            problems.append(f"rope scaling ({rope_type})")
    if hf.get("attention_bias"):
        problems.append("attention_bias=true")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers maps both to SiLU
        problems.append(f"hidden_act={hf.get('hidden_act')} (attnlab's SwiGLU uses silu)")
    moe_config = MoEConfig()
    if moe:
        width, shared_width = int(hf["moe_intermediate_size"]), int(hf["shared_expert_intermediate_size"])
        top_k, normalize = int(hf["num_experts_per_tok"]), bool(hf.get("norm_topk_prob", False))
        if hf.get("use_sliding_window"):
            problems.append("use_sliding_window=true")
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            problems.append("dense layers between sparse ones (decoder_sparse_step, mlp_only_layers)")
        if normalize and top_k == 1:
            problems.append("norm_topk_prob with one expert per token (attnlab keeps a lone top-1 probability)")
        if shared_width % width and shared_width != 1:  # 1: the all-zero stand-in for no shared expert
            problems.append(f"shared_expert_intermediate_size {shared_width} is not a multiple of {width}")
        moe_config = MoEConfig(
            # at top-1 attnlab never renormalises, whatever the flag: keep its default there
            n_experts=int(hf["num_experts"]), top_k=top_k, normalize_top_k=normalize if top_k > 1 else True,
            n_shared_experts=0 if shared_width % width else shared_width // width,
            balance_loss_weight=float(hf.get("router_aux_loss_coef", MoEConfig().balance_loss_weight)),
        )
    if problems:
        raise ConversionError(f"unsupported {IMPORTABLE[model_type]} options: {'; '.join(problems)}")
    heads = int(hf["num_attention_heads"])
    config = ModelConfig(
        num_tokens=int(hf["vocab_size"]),
        dim=int(hf["hidden_size"]),
        depth=int(hf["num_hidden_layers"]),
        heads=heads,
        dim_head=int(hf.get("head_dim") or hf["hidden_size"] // heads),
        kv_heads=int(hf.get("num_key_value_heads") or heads),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        position="rotary",
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        feed_forward="moe" if moe else "swiglu",
        ff_hidden=int(hf["moe_intermediate_size"] if moe else hf["intermediate_size"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        moe=moe_config,
    )
    try:
        check_model(config, where="")  # what no single value says: heads a multiple of key/value heads, ...
    except ConfigError as error:
        raise ConversionError(f"{CONFIG_FILE} describes no model attnlab can build: {error}") from error
    return config


def sharded_files(index_file: Path) -> list[str]:
    """The shard file names a sharded checkpoint's index lists; ConversionError for a damaged index."""
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
        raise ConversionError(f"{index_file} is damaged: no readable weight_map ({type(error).__name__})") from error
    for name in names:
        if not isinstance(name, str) or Path(name).name != name:
            raise ConversionError(f"{index_file} names a shard outside its folder: {name!r}")
    return names


def read_hf_weights(hf_dir: Path) -> Tensors:
    """All tensors of a checkpoint folder: model.safetensors, a sharded safetensors index, or
    pytorch_model.bin read with weights_only=True (no arbitrary objects unpickled)."""
    if (hf_dir / WEIGHTS_FILE).is_file():  # the header checked first, then attnlab's checksum if it carries one
        return load_safetensors(hf_dir / WEIGHTS_FILE)
    if (hf_dir / SHARDED_INDEX_FILE).is_file():
        shards = sharded_files(hf_dir / SHARDED_INDEX_FILE)
        tensors: Tensors = {}
        for shard in shards:
            tensors.update(load_safetensors(hf_dir / shard))
        return tensors
    if (hf_dir / TORCH_WEIGHTS_FILE).is_file():
        try:
            return torch.load(hf_dir / TORCH_WEIGHTS_FILE, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ConversionError(f"{hf_dir / TORCH_WEIGHTS_FILE} cannot be read safely ({type(error).__name__})") \
                from error
    raise ConversionError(f"{hf_dir} has no {WEIGHTS_FILE}, {SHARDED_INDEX_FILE} or {TORCH_WEIGHTS_FILE}")


def moe_state(config: ModelConfig, tensors: Tensors, index: int) -> tuple[Tensors, list[str]]:
    """Layer `index`'s Qwen2-MoE feed-forward as attnlab MoE weights (the inverse of `moe_tensors`),
    and the HF names used. Only the shape attnlab exports imports: a zero shared-expert gate (a
    constant 1/2, undone by halving the down projection, exactly) and zero attention biases."""
    ours, theirs = f"blocks.{index}.feed_forward.inner.", f"model.layers.{index}.mlp."
    used = [theirs + "gate.weight", theirs + "shared_expert_gate.weight"]
    used += [f"{theirs}shared_expert.{part}_proj.weight" for part in ("gate", "up", "down")]
    used += [f"{theirs}experts.{expert}.{part}_proj.weight"
             for expert in range(config.moe.n_experts) for part in ("gate", "up", "down")]
    attention = f"model.layers.{index}.self_attn."
    biases = [name for name in (f"{attention}{projection}_proj.bias" for projection in "qkv") if name in tensors]
    used += biases
    missing = [name for name in used if name not in tensors]
    if missing:
        raise ConversionError(f"weights do not match a Qwen2MoeForCausalLM of this config: missing {missing[0]}")
    if tensors[theirs + "shared_expert_gate.weight"].any():
        raise ConversionError("a sigmoid-gated shared expert has no attnlab equivalent (only a zero gate imports)")
    if any(tensors[name].any() for name in biases):
        raise ConversionError("query/key/value biases have no attnlab equivalent (only zero biases import)")
    state = {ours + "router.weight": tensors[theirs + "gate.weight"]}  # [E, dim]
    for expert in range(config.moe.n_experts):
        for part in ("gate", "up", "down"):
            state[f"{ours}experts.{expert}.{part}.weight"] = tensors[f"{theirs}experts.{expert}.{part}_proj.weight"]
    shared = {part: tensors[f"{theirs}shared_expert.{part}_proj.weight"] for part in ("gate", "up", "down")}
    if config.moe.n_shared_experts == 0 and any(value.any() for value in shared.values()):
        raise ConversionError(f"layer {index}: shared_expert_intermediate_size 1 is only the all-zero stand-in")
    width = hidden_width(config, gated=True)
    for number in range(config.moe.n_shared_experts):
        rows = slice(number * width, (number + 1) * width)  # this expert's hidden units in the joined one
        state[f"{ours}shared_experts.{number}.gate.weight"] = shared["gate"][rows]  # [F, dim]
        state[f"{ours}shared_experts.{number}.up.weight"] = shared["up"][rows]  # [F, dim]
        state[f"{ours}shared_experts.{number}.down.weight"] = shared["down"][:, rows] / 2  # [dim, F]
    return state, used


def state_from_hf(config: ModelConfig, tensors: Tensors) -> Tensors:
    """attnlab state_dict (float32) from LlamaForCausalLM or Qwen2MoeForCausalLM tensors; every
    tensor must be used."""
    # rotary inverse frequencies are recomputed from rope_theta; a tied lm_head is the embedding
    ignored = {name for name in tensors if name.endswith("rotary_emb.inv_freq")}
    if config.tie_embeddings:
        ignored.add("lm_head.weight")
    names = weight_names(config)
    missing = [theirs for _, theirs in names if theirs not in tensors]
    used = {theirs for _, theirs in names}
    state = {ours: tensors[theirs] for ours, theirs in names if theirs in tensors}
    if config.feed_forward == "moe" and not missing:
        for index in range(config.depth):
            layer_state, layer_used = moe_state(config, tensors, index)
            state.update(layer_state)
            used.update(layer_used)
    unexpected = sorted(set(tensors) - used - ignored)
    if missing or unexpected:
        detail = [f"missing {', '.join(missing[:3])}"] if missing else []
        detail += [f"unexpected {', '.join(unexpected[:3])}"] if unexpected else []
        raise ConversionError(f"weights do not match a {hf_family(config)} model of this config: {'; '.join(detail)}")
    state = {name: value.to(torch.float32) for name, value in state.items()}
    if config.tie_embeddings:
        state["head.weight"] = state["token_embedding.embed.weight"]
    return state


def import_hf(hf_dir: str | Path, run_dir: str | Path, overwrite: bool = False) -> Path:
    """`attnlab import-hf DIR --out RUN`: a Llama (or attnlab-shaped Qwen2-MoE) checkpoint folder as
    an attnlab run directory (config.yaml, checkpoints/step-0000000.pt holding the weights,
    tokenizer/ when DIR has one), loadable by `attnlab.load_model`, `attnlab sample`, `attnlab eval`.

    A model with a tokenizer and a vocabulary other than 256 becomes a tokenized run whose token
    folder is RUN itself (`data.source: tokens`, `data.path: RUN`): RUN/tokenizer/ is where
    tokenized runs find their tokenizer (data/pretrain.py), so `attnlab sample` encodes prompts and
    decodes tokens with it; RUN holds no shards, so `attnlab eval` needs `--data SHARDS`. Otherwise
    it is a byte-level run (token id = byte value, as attnlab's byte-level exports are)."""
    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    model_config = model_config_from_hf(read_hf_config(hf_dir))
    state = state_from_hf(model_config, read_hf_weights(hf_dir))
    model = Transformer(model_config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:  # a shape that contradicts config.json
        first = str(error).strip().splitlines()[-1].strip()[:200]
        raise ConversionError(f"weights do not match config.json: {first}") from error
    # a short default training window: the model's own max_seq_len may be far longer than a CPU can train
    train = TrainConfig(seq_len=min(TrainConfig().seq_len, model_config.max_seq_len))
    tokenized = (hf_dir / TOKENIZER_FILES[0]).is_file() and model_config.num_tokens != 256
    if tokenized and BOS_TOKEN not in (hf_dir / TOKENIZER_FILES[0]).read_text(encoding="utf-8"):
        log.warning("the tokenizer of %s lacks attnlab's %s: `attnlab sample` needs it to start prompts; "
                    "load the model from Python instead", hf_dir, BOS_TOKEN)
    data = DataConfig(source="tokens", path=str(run_dir.resolve())) if tokenized else DataConfig()  # any cwd
    config = RunConfig(
        name=run_dir.name, out_dir=str(run_dir.parent), model=model_config, train=train, data=data,
        description=f"imported from the Hugging Face checkpoint {hf_dir}",
    )
    _prepare_out_dir(run_dir, overwrite, own_checkpoint=checkpoint_path(run_dir, 0))
    save_config(config, run_dir / "config.yaml")
    save_checkpoint(checkpoint_path(run_dir, 0), {"config": config_to_dict(config), "model": model.state_dict(),
                                                  "step": 0})
    if (hf_dir / TOKENIZER_FILES[0]).is_file():
        (run_dir / RUN_TOKENIZER_DIR).mkdir(exist_ok=True)
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                copy_atomic(hf_dir / name, run_dir / RUN_TOKENIZER_DIR / name)
    run_info = {"imported_from": str(hf_dir.resolve())}
    write_atomic(run_dir / "run_info.json", (json.dumps(run_info, indent=2) + "\n").encode())
    log.info("imported %s (%.2fM parameters) -> %s", hf_dir, model.num_parameters() / 1e6, run_dir)
    return run_dir
