"""Typed run configuration: dataclasses, YAML presets and dotted overrides.

Precedence, lowest first: dataclass defaults < preset < config file < `key.path=value` overrides.
A config file may name a preset to start from with `preset: NAME`.

The loader is deliberately small and strict: YAML is parsed by PyYAML, then every key is checked
against the dataclasses here. Unknown keys fail with the nearest known key as a suggestion; values
are checked against their annotation (int, float, bool, str, Literal, Optional, tuples, nested
configs). OmegaConf structured configs were considered and rejected because they do not accept
`Literal` annotations, which we use for every choice-valued field.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from attnlab.errors import ConfigError

PRESET_DIR = Path(__file__).parent / "presets"


# --------------------------------------------------------------------------------------------
# Model


@dataclass(kw_only=True)
class LocalAttentionConfig:
    window_size: int = 128  # keys visible to a query, itself included
    backend: Literal["auto", "torch", "flex"] = "auto"  # attention/kernels/__init__.py; flex: GPU (CPU: forward only)


# ---- routing (owned by attention/routing.py)
@dataclass(kw_only=True)
class RoutingAttentionConfig:
    window_size: int = 128  # most recent same-cluster keys a token attends to (and the local window)
    n_clusters: int | None = None  # k-means centroids per routed head; None: max_seq_len // window_size
    n_local_heads: int | tuple[int, ...] = 0  # heads using the local window, one int or one per layer
    ema_decay: float = 0.999  # centroid moving-average decay, applied once per optimiser step
    commitment_weight: float = 1e-4  # weight of the k-means commitment loss (seed 000's default)
    backend: Literal["auto", "torch", "cpu", "flex"] = "auto"  # attention/kernels/__init__.py


# ---- sinkhorn (owned by attention/sinkhorn.py)
@dataclass(kw_only=True)
class SinkhornAttentionConfig:
    bucket_size: int = 128  # tokens per bucket
    n_sortcut: int = 1  # past buckets each bucket attends to, chosen by the sorting network
    sinkhorn_iter: int = 5  # row/column normalisation rounds of the sorting matrix
    temperature: float = 0.75  # divides the sorting logits (and Gumbel noise) before normalising
    n_local_heads: int = 0  # heads using the local window of bucket_size instead of sorted buckets
    backend: Literal["auto", "torch", "cpu", "flex"] = "auto"  # attention/kernels/__init__.py


# ---- nsa (owned by attention/nsa.py)
@dataclass(kw_only=True)
class NSAAttentionConfig:
    sliding_window_size: int = 64  # sliding branch: keys visible to a query, itself included
    compress_block_size: int = 16  # compressed branch: tokens summarised by one compressed key (paper's l)
    compress_stride: int = 8  # compressed branch: distance between block starts (paper's d); divides both block sizes
    compressor: Literal["mlp", "mean", "conv", "attention"] = "mlp"  # network turning a block into one key/value
    compress_mlp_mult: float = 1.0  # mlp compressor hidden width, as a multiple of block * dim_head
    selection_block_size: int = 16  # selected branch: tokens per selectable block (paper's l')
    num_selected: int = 4  # selected blocks per query, the initial and the current block included (n)
    use_diff_topk: bool = False  # straight-through gates so the selection scores get gradients (seed 002)
    separate_branch_kv: bool = False  # own key/value projections for each of the three branches
    backend: Literal["auto", "torch", "cpu", "flex", "triton"] = "auto"  # attention/kernels/__init__.py
    query_chunk_size: int = 256  # queries processed together; bounds the selected and compressed scores


@dataclass(kw_only=True)
class AttentionConfig:
    kind: str = "full"  # registry name: full | local | routing | sinkhorn | nsa
    dropout: float = 0.0  # dropout on attention probabilities (training only)
    local: LocalAttentionConfig = field(default_factory=LocalAttentionConfig)
    routing: RoutingAttentionConfig = field(default_factory=RoutingAttentionConfig)
    sinkhorn: SinkhornAttentionConfig = field(default_factory=SinkhornAttentionConfig)
    nsa: NSAAttentionConfig = field(default_factory=NSAAttentionConfig)


# ---- mixture of experts (owned by model/moe.py)
@dataclass(kw_only=True)
class MoEConfig:
    n_experts: int = 4  # routed SwiGLU experts (MiniMind's n_routed_experts)
    top_k: int = 2  # experts each token is sent to (MiniMind's num_experts_per_tok)
    n_shared_experts: int = 1  # experts every token goes through, unrouted (DeepSeekMoE / MiniMind)
    normalize_top_k: bool = True  # renormalise the top-k router probabilities to sum to 1 (MiniMind's norm_topk_prob)
    balance_loss_weight: float = 0.1  # Switch load-balance loss weight (MiniMind's aux_loss_alpha)
    z_loss_weight: float = 0.0  # router z-loss weight (ST-MoE, arXiv 2202.08906); 0 disables


@dataclass(kw_only=True)
class ModelConfig:
    num_tokens: int = 256  # vocabulary size (256 for bytes)
    dim: int = 256  # residual stream width
    depth: int = 4  # number of blocks
    heads: int = 4  # query heads
    dim_head: int = 64  # width of one head
    kv_heads: int | None = None  # key/value heads for GQA; None means equal to heads
    max_seq_len: int = 256  # longest sequence the positions and caches are built for
    emb_dim: int | None = None  # factorised embedding width (seed 001 uses 128); None: dim
    position: Literal["rotary", "learned", "none"] = "rotary"  # how positions enter the model
    rope_theta: float = 10000.0  # rotary base
    norm: str = "layernorm"  # registry name: layernorm | rmsnorm
    norm_eps: float | None = None  # norm epsilon; None: the norm's default (LayerNorm 1e-5, RMSNorm machine eps)
    feed_forward: str = "gelu"  # registry name: gelu | swiglu | moe
    ff_mult: float = 4.0  # hidden width of the feed-forward as a multiple of dim
    ff_hidden: int | None = None  # exact feed-forward hidden width (HF intermediate_size); None: from ff_mult
    ff_chunks: int = 1  # run the feed-forward over this many sequence chunks to save memory
    dropout: float = 0.0  # residual dropout
    tie_embeddings: bool = False  # share the input embedding with the output projection
    reversible: bool = False  # two-stream reversible residuals: activation memory flat in depth
    loss_chunk_size: int = 0  # >0: training loss over this many tokens at a time, full logits never built
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)  # read when feed_forward=moe

    @property
    def n_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads


# --------------------------------------------------------------------------------------------
# Data


@dataclass(kw_only=True)
class DataConfig:
    # builtin | file | enwik8: bytes; tokens: token shards at `path` from `attnlab data prepare`;
    # builtin-tokens: the built-in jsonl corpus, tokenized with BPE trained on it (built and cached)
    source: Literal["builtin", "file", "enwik8", "tokens", "builtin-tokens"] = "builtin"
    path: str | None = None  # the file for source=file or enwik8 (.gz, .zip or raw bytes); the folder for tokens
    cache_dir: str | None = None  # prepared corpora; None: $ATTNLAB_CACHE or ~/.cache/attnlab
    val_fraction: float = 0.05  # share held out for validation: of the bytes, or of the documents (tokens)
    # token sources: padded = MiniMind's one document per sample, BOS + text + EOS, padded to seq_len + 1
    # with the loss masked on padding; packed = random windows of the documents joined by end tokens
    layout: Literal["padded", "packed"] = "padded"
    vocab_size: int = 6400  # builtin-tokens: BPE vocabulary trained on the built-in corpus (MiniMind: 6400)
    enwik8_train_bytes: int = 90_000_000  # enwik8 split as the seeds use it
    enwik8_val_bytes: int = 5_000_000


# --------------------------------------------------------------------------------------------
# Training


@dataclass(kw_only=True)
class TrainConfig:
    seq_len: int = 256  # tokens per training window (windows hold seq_len + 1 tokens)
    batch_size: int = 16  # windows per micro-batch
    grad_accum: int = 1  # micro-batches per optimiser step
    max_steps: int = 1000  # optimiser steps
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    schedule: Literal["cosine", "minimind", "constant"] = "cosine"
    warmup_steps: int = 100  # linear warm-up (cosine schedule)
    weight_decay: float = 0.1  # applied to matrices only, never to norms, biases or embeddings
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables
    on_nonfinite: Literal["stop", "skip"] = "stop"  # non-finite gradients: stop the run, or skip the step (finite.py)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0
    ema: bool = False  # keep an exponential moving average of the weights (seeds' --use_ema)
    ema_decay: float = 0.999
    eval_every: int = 100  # validation loss every N steps
    eval_batches: int = 8  # validation windows = eval_batches * batch_size
    sample_every: int = 500  # print a sample from a validation prime every N steps; 0 disables
    sample_length: int = 200  # tokens generated for that sample
    prime_length: int = 64  # prime taken from validation data
    save_every: int = 500  # checkpoint every N steps (and at the end)
    keep_last: int = 2  # checkpoints kept in the run directory
    log_every: int = 10  # metrics line every N steps
    compile: bool = False  # torch.compile the model
    peak_tflops: float = 0.0  # device peak for the logged MFU; 0: known GPUs' bf16 peak, none on CPU
    randomly_truncate_sequence: bool = False  # seed 000: now and then train on a shorter prefix (p 0.1)
    distill_from: str | None = None  # teacher run or checkpoint: also train toward its distribution (train/distill.py)
    distill_weight: float = 0.5  # with distill_from: loss = (1 - w) data cross-entropy + w distillation loss
    distill_loss: Literal["kl", "tv"] = "kl"  # kl: KL(teacher || model); tv: total variation, 1 - acceptance
    init_from: str | None = None  # run or checkpoint whose model weights a fresh run starts from (fine-tuning)


@dataclass(kw_only=True)
class LogConfig:
    tensorboard: bool = False  # also write TensorBoard events
    wandb: bool = False  # also log to Weights & Biases
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    wandb_project: str = "attnlab"
    progress: bool = True  # tqdm progress bar


@dataclass(kw_only=True)
class DistConfig:
    strategy: Literal["single", "ddp", "fsdp", "deepspeed"] = "single"  # see train/distributed.py
    deepspeed_config: str | None = None  # DeepSpeed JSON config (strategy=deepspeed)


@dataclass(kw_only=True)
class RunConfig:
    name: str = "run"  # run directory name under out_dir
    out_dir: str = "runs"  # parent of run directories
    description: str = ""  # what this configuration reproduces
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name


# --------------------------------------------------------------------------------------------
# Loading and validation


def known_presets() -> list[str]:
    return sorted(path.stem for path in PRESET_DIR.glob("*.yaml"))


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({error})") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values, got {type(data).__name__}")
    return data


def _preset_dict(name: str) -> dict[str, Any]:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        known = known_presets()
        near = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        raise ConfigError(f"unknown preset '{name}'.{hint} Known presets: {', '.join(known)}")
    return _read_yaml(path)


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def parse_override(text: str) -> dict[str, Any]:
    """`a.b.c=value` -> {"a": {"b": {"c": value}}}, the value parsed as YAML (so 1e-4, true, [8,4])."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key.path=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    nested: dict[str, Any] = {}
    cursor = nested
    parts = key.strip().split(".")
    for part in parts[:-1]:
        cursor = cursor.setdefault(part, {})
    cursor[parts[-1]] = value
    return nested


def _check_value(value: Any, annotation: Any, where: str) -> Any:
    """Return `value` converted to `annotation`, or raise ConfigError naming `where`."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_value(value, option, where)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[-1] if errors else f"{where}: invalid value {value!r}")
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_type, *_rest) = typing.get_args(annotation) or (Any,)
        return tuple(_check_value(item, item_type, f"{where}[{i}]") for i, item in enumerate(value))
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _build(annotation, value, where)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported annotation {annotation!r}")


def _build(cls: type, values: dict[str, Any], where: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f"; did you mean '{(where + '.') if where else ''}{near[0]}'?" if near else ""
            raise ConfigError(f"unknown config key '{path}'{hint}")
        kwargs[key] = _check_value(value, hints[key], path)
    return cls(**kwargs)


def config_from_dict(values: dict[str, Any], cls: type = RunConfig) -> Any:
    """Build and validate a config dataclass from plain nested dicts."""
    return _build(cls, values)


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) that config_from_dict turns back into `config`."""

    def plain(value: Any) -> Any:
        if isinstance(value, tuple):
            return [plain(item) for item in value]
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        return value

    return plain(dataclasses.asdict(config))


def load_config(preset_or_path: str | Path | None = "demo", overrides: list[str] | None = None) -> RunConfig:
    """Resolve a run config: a preset name or YAML file path, then `key.path=value` overrides."""
    values: dict[str, Any] = {}
    if preset_or_path is not None:
        text = str(preset_or_path)
        path = Path(text)
        if text.endswith((".yaml", ".yml")) or path.is_file():
            if not path.is_file():
                raise ConfigError(f"config file {path} does not exist")
            file_values = _read_yaml(path)
            base = file_values.pop("preset", None)
            if base is not None:
                values = _preset_dict(str(base))
            values = _deep_merge(values, file_values)
        else:
            values = _preset_dict(text)
    for override in overrides or []:
        values = _deep_merge(values, parse_override(override))
    return config_from_dict(values)


def save_config(config: Any, path: Path) -> None:
    path.write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
