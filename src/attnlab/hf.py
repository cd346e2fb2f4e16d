"""Hugging Face Llama checkpoints: export an attnlab model as one, import one as an attnlab run.

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

Rotary positions need no permutation of the query and key rows: attnlab's RotaryEmbedding splits a
head into halves x1, x2 and returns (x1 cos - x2 sin, x2 cos + x1 sin), which is HF's
`x * cos + rotate_half(x) * sin` with rotate_half(x) = (-x2, x1), both pairing dimension i with
i + D/2 at frequency theta^(-2i/D). (Meta's original Llama weights pair neighbouring dimensions
and need a permutation; neither side here does.) Both scale attention scores by 1/sqrt(D).

RMSNorm epsilon: attnlab's `model.norm_eps: null` means nn.RMSNorm's default, the machine epsilon
of the input dtype; it is exported as float32's, 2^-23 ~ 1.19e-7, the value of a float32 model.

Checkpoints are read without unpickling: safetensors, or a torch file with `weights_only=True`.
Legend: V vocabulary, dim model width, H query heads, G key/value heads, D head width, F hidden width.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from attnlab.config import ModelConfig, RunConfig, TrainConfig, config_to_dict, save_config
from attnlab.errors import ConversionError
from attnlab.model.layers import hidden_width
from attnlab.model.transformer import Transformer
from attnlab.train.checkpoint import checkpoint_path, load_model, save_checkpoint

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SHARDED_INDEX_FILE = "model.safetensors.index.json"
TORCH_WEIGHTS_FILE = "pytorch_model.bin"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
RUN_TOKENIZER_DIR = "tokenizer"  # where a run keeps its tokenizer files (import writes them there)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------------------------
# The correspondence, shared by both directions


def llama_incompatibilities(config: ModelConfig) -> list[str]:
    """Why `config` has no Hugging Face Llama equivalent; empty when it has one."""
    reasons = []
    if config.attention.kind != "full":
        reasons.append(f"attention.kind={config.attention.kind} (Llama attends to every earlier token)")
    if config.norm != "rmsnorm":
        reasons.append(f"norm={config.norm} (Llama uses RMSNorm without bias)")
    if config.feed_forward == "moe":
        reasons.append("feed_forward=moe (Llama's feed-forward is one dense SwiGLU)")
    elif config.feed_forward != "swiglu":
        reasons.append(f"feed_forward={config.feed_forward} (Llama's feed-forward is SwiGLU)")
    if config.position != "rotary":
        reasons.append(f"position={config.position} (Llama uses rotary positions)")
    if config.emb_dim is not None:
        reasons.append(f"emb_dim={config.emb_dim} (Llama has no factorised embedding)")
    if config.reversible:
        reasons.append("reversible=true (Llama has ordinary residuals)")
    return reasons


def check_exportable(config: ModelConfig) -> None:
    reasons = llama_incompatibilities(config)
    if reasons:
        raise ConversionError(f"no Hugging Face Llama equivalent: {'; '.join(reasons)}")


def weight_names(config: ModelConfig) -> list[tuple[str, str]]:
    """(attnlab state_dict key, HF LlamaForCausalLM key) for every stored matrix and norm weight.
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
            (ours + "feed_forward.inner.gate.weight", theirs + "mlp.gate_proj.weight"),  # [F, dim]
            (ours + "feed_forward.inner.up.weight", theirs + "mlp.up_proj.weight"),  # [F, dim]
            (ours + "feed_forward.inner.down.weight", theirs + "mlp.down_proj.weight"),  # [dim, F]
        ]
    names.append(("norm.weight", "model.norm.weight"))
    if not config.tie_embeddings:
        names.append(("head.weight", "lm_head.weight"))
    return names


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


# --------------------------------------------------------------------------------------------
# Export


def find_tokenizer(run_dir: Path, run_config: RunConfig | None) -> Path | None:
    """The tokenizer folder of a run: RUN/tokenizer/, RUN itself, or the data config's tokenizer."""
    candidates = [run_dir / RUN_TOKENIZER_DIR, run_dir]
    configured = getattr(run_config.data, "tokenizer", None) if run_config is not None else None
    if configured:  # tokenized runs name their tokenizer folder in the data config
        candidates.insert(0, Path(configured))
    for folder in candidates:
        if (folder / TOKENIZER_FILES[0]).is_file():
            return folder
    return None


def special_token_ids(tokenizer_dir: Path | None) -> dict[str, int | None]:
    """bos/eos/pad ids named by a tokenizer folder's special_tokens_map.json, for config.json."""
    ids: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if tokenizer_dir is None or not (tokenizer_dir / "special_tokens_map.json").is_file():
        return ids
    tokenizer = json.loads((tokenizer_dir / TOKENIZER_FILES[0]).read_text())
    vocabulary = tokenizer["model"].get("vocab", {})
    added = {token["content"]: token["id"] for token in tokenizer.get("added_tokens", [])}
    special_map = json.loads((tokenizer_dir / "special_tokens_map.json").read_text())
    for role in ("bos", "eos", "pad"):
        token = special_map.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None:
            ids[f"{role}_token_id"] = added.get(token, vocabulary.get(token))
    return ids


def write_byte_tokenizer(out_dir: Path) -> bool:
    """A tokenizer whose ids are the bytes themselves (byte b -> id b), for byte-level models:
    byte-level BPE with no merges over GPT-2's byte alphabet. False when `tokenizers` is missing."""
    try:
        import tokenizers
    except ImportError:
        log.warning("tokenizers is not installed: no tokenizer written; token id = byte value")
        return False
    from attnlab.data.tokenizer import byte_symbols

    symbol_of, _ = byte_symbols()
    vocabulary = {symbol_of[byte]: byte for byte in range(256)}  # id b is byte b
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocabulary, merges=[]))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    tokenizer.save(str(out_dir / TOKENIZER_FILES[0]))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return True


def _prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConversionError(f"{out_dir} is not empty; choose another folder or pass --force")
    out_dir.mkdir(parents=True, exist_ok=True)


def export_model(
    model: Transformer,
    out_dir: str | Path,
    dtype: str = "float32",
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `model` as a Hugging Face Llama checkpoint: model.safetensors, config.json and, when
    given, the tokenizer files of `tokenizer_dir` (a 256-token model without one gets the byte
    tokenizer). Raises ConversionError, before writing anything, for architectures Llama lacks."""
    from safetensors.torch import save_file

    config = model.config
    check_exportable(config)
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    state = model.state_dict()
    names = weight_names(config)
    unmapped = sorted(set(state) - {ours for ours, _ in names} - ({"head.weight"} if config.tie_embeddings else set()))
    if unmapped:  # a weight Llama has no place for (a future option): refuse rather than drop it
        raise ConversionError(f"weights with no Llama counterpart: {', '.join(unmapped[:5])}")
    out_dir = Path(out_dir)
    _prepare_out_dir(out_dir, overwrite)
    # contiguous copies: safetensors refuses views and tensors that share memory
    tensors = {theirs: state[ours].detach().to("cpu", DTYPES[dtype]).contiguous().clone() for ours, theirs in names}
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})

    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copyfile(tokenizer_dir / name, out_dir / name)
    elif config.num_tokens == 256:
        write_byte_tokenizer(out_dir)
    else:
        log.warning("no tokenizer found for a %d-token model: exported without tokenizer files", config.num_tokens)
    hf_config = llama_config(config, dtype, special_token_ids(tokenizer_dir))
    (out_dir / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    log.info("exported %d tensors to %s (%s)", len(tensors), out_dir, dtype)
    return out_dir


def export_run(
    run_or_checkpoint: str | Path,
    out_dir: str | Path,
    weights: str = "auto",
    dtype: str = "float32",
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """`attnlab export RUN --format hf --out DIR`: the run's latest checkpoint (or the given one) as a
    Hugging Face Llama checkpoint, with the run's tokenizer when it has one."""
    model = load_model(run_or_checkpoint, weights=weights)
    check_exportable(model.config)
    path = Path(run_or_checkpoint)
    run_dir = path if path.is_dir() else path.parent.parent  # RUN/checkpoints/step-N.pt -> RUN
    if tokenizer_dir is None:
        tokenizer_dir = find_tokenizer(run_dir, model.run_config)
    return export_model(model, out_dir, dtype=dtype, tokenizer_dir=tokenizer_dir, overwrite=overwrite)


# --------------------------------------------------------------------------------------------
# Import


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    path = hf_dir / CONFIG_FILE
    if not path.is_file():
        raise ConversionError(f"{hf_dir} has no {CONFIG_FILE}: not a Hugging Face checkpoint folder")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConversionError(f"{path}: not valid JSON ({error.msg})") from error


def model_config_from_llama(hf: dict[str, Any]) -> ModelConfig:
    """The attnlab ModelConfig equal to a LlamaForCausalLM config.json; ConversionError for
    options attnlab does not compute (rope scaling, biases, another activation, ...)."""
    model_type = hf.get("model_type")
    if model_type != "llama":
        raise ConversionError(f"model_type {model_type!r} is not supported; only 'llama' (LlamaForCausalLM)")
    rope = hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = []
    if hf.get("rope_scaling") or rope_type != "default":
        problems.append(f"rope scaling ({hf.get('rope_scaling') or rope_type})")
    if hf.get("attention_bias"):
        problems.append("attention_bias=true")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # transformers maps both to SiLU
        problems.append(f"hidden_act={hf.get('hidden_act')} (attnlab's SwiGLU uses silu)")
    if problems:
        raise ConversionError(f"unsupported Llama options: {'; '.join(problems)}")
    heads = int(hf["num_attention_heads"])
    return ModelConfig(
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
        feed_forward="swiglu",
        ff_hidden=int(hf["intermediate_size"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: model.safetensors, a sharded safetensors index, or
    pytorch_model.bin read with weights_only=True (no arbitrary objects unpickled)."""
    from safetensors.torch import load_file

    if (hf_dir / WEIGHTS_FILE).is_file():
        return load_file(str(hf_dir / WEIGHTS_FILE))
    if (hf_dir / SHARDED_INDEX_FILE).is_file():
        shards = sorted(set(json.loads((hf_dir / SHARDED_INDEX_FILE).read_text())["weight_map"].values()))
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(load_file(str(hf_dir / shard)))
        return tensors
    if (hf_dir / TORCH_WEIGHTS_FILE).is_file():
        try:
            return torch.load(hf_dir / TORCH_WEIGHTS_FILE, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ConversionError(f"{hf_dir / TORCH_WEIGHTS_FILE} cannot be read safely ({type(error).__name__})") \
                from error
    raise ConversionError(f"{hf_dir} has no {WEIGHTS_FILE}, {SHARDED_INDEX_FILE} or {TORCH_WEIGHTS_FILE}")


def state_from_llama(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """attnlab state_dict (float32) from LlamaForCausalLM tensors; every tensor must be used."""
    # rotary inverse frequencies are recomputed from rope_theta; a tied lm_head is the embedding
    ignored = {name for name in tensors if name.endswith("rotary_emb.inv_freq")}
    if config.tie_embeddings:
        ignored.add("lm_head.weight")
    names = weight_names(config)
    missing = [theirs for _, theirs in names if theirs not in tensors]
    unexpected = sorted(set(tensors) - {theirs for _, theirs in names} - ignored)
    if missing or unexpected:
        detail = [f"missing {', '.join(missing[:3])}"] if missing else []
        detail += [f"unexpected {', '.join(unexpected[:3])}"] if unexpected else []
        raise ConversionError(f"weights do not match a LlamaForCausalLM of this config: {'; '.join(detail)}")
    state = {ours: tensors[theirs].to(torch.float32) for ours, theirs in names}
    if config.tie_embeddings:
        state["head.weight"] = state["token_embedding.embed.weight"]
    return state


def import_hf(hf_dir: str | Path, run_dir: str | Path, overwrite: bool = False) -> Path:
    """`attnlab import-hf DIR --out RUN`: a Llama checkpoint folder as an attnlab run directory
    (config.yaml, checkpoints/step-0000000.pt holding the weights, tokenizer/ when DIR has one),
    loadable by `attnlab.load_model`, `attnlab sample` and `attnlab eval`."""
    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    model_config = model_config_from_llama(read_hf_config(hf_dir))
    state = state_from_llama(model_config, read_hf_weights(hf_dir))
    model = Transformer(model_config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:  # a shape that contradicts config.json
        first = str(error).strip().splitlines()[-1].strip()[:200]
        raise ConversionError(f"weights do not match config.json: {first}") from error
    # a short default training window: the model's own max_seq_len may be far longer than a CPU can train
    train = TrainConfig(seq_len=min(TrainConfig().seq_len, model_config.max_seq_len))
    config = RunConfig(
        name=run_dir.name, out_dir=str(run_dir.parent), model=model_config, train=train,
        description=f"imported from the Hugging Face checkpoint {hf_dir}",
    )
    _prepare_out_dir(run_dir, overwrite)
    save_config(config, run_dir / "config.yaml")
    save_checkpoint(checkpoint_path(run_dir, 0), {"config": config_to_dict(config), "model": model.state_dict(),
                                                  "step": 0})
    if (hf_dir / TOKENIZER_FILES[0]).is_file():
        (run_dir / RUN_TOKENIZER_DIR).mkdir(exist_ok=True)
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                shutil.copyfile(hf_dir / name, run_dir / RUN_TOKENIZER_DIR / name)
    (run_dir / "run_info.json").write_text(json.dumps({"imported_from": str(hf_dir.resolve())}, indent=2) + "\n")
    log.info("imported %s (%.2fM parameters) -> %s", hf_dir, model.num_parameters() / 1e6, run_dir)
    return run_dir
