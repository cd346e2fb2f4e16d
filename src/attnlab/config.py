"""Typed run configuration: dataclasses, YAML presets and dotted overrides.

Precedence, lowest first: dataclass defaults < preset < config file < `key.path=value` overrides.
A config file may name a preset to start from with `preset: NAME`.

Presets and config files: a preset is only ever chosen by its name (letters, digits, '-', '_', '.')
and found among the presets here; a config file is given as a path (a `Path`, or a string holding
a '/' or ending in .yaml/.yml) to an existing regular file. `attnlab train -p` takes a name, `-c`
a path; neither ever reads a file outside the presets by a preset's name (`-p ../../file`).

The loader is deliberately small and strict: YAML is parsed by PyYAML, then every key is checked
against the dataclasses here. Unknown keys fail with the nearest known key as a suggestion; values
are checked against their annotation (int, float, bool, str, Literal, Optional, tuples, nested
configs) and its constraints (`Size`: a positive integer, `Fraction`: in [0, 1], `PlainName`, ...),
then the fields that constrain each other (`check_run`), and what the model's constructor refuses
(the model is built on the meta device), so a bad value is one line naming its key.
OmegaConf structured configs were considered and rejected because they do not accept `Literal`
annotations, which we use for every choice-valued field.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from attnlab.errors import ConfigError

PRESET_DIR = Path(__file__).parent / "presets"
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's when PyYAML has it: the same rules, faster
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes; a larger "config" is the wrong file


# --------------------------------------------------------------------------------------------
# Value constraints: the loader checks a field's value against these, after its type
#
# A field annotated `Size` must be a positive integer, `Fraction` a number in [0, 1], and so on, so
# that a bad value is one line naming the key when the config is loaded, not a traceback from
# deep inside torch later.

MAX_INT = 2**31 - 1  # no size, count or step number attnlab uses is larger; beyond it torch overflows


@dataclass(frozen=True)
class Range:
    """A number in [low, high], an end excluded when marked open; a float must also be finite."""

    low: float
    high: float = MAX_INT
    open_low: bool = False
    open_high: bool = False

    def check(self, value: float, where: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number, got {value}")
        too_low = value <= self.low if self.open_low else value < self.low
        too_high = value >= self.high if self.open_high else value > self.high
        if too_low or too_high:
            raise ConfigError(f"{where} must be {self.describe()}, got {value}")

    def describe(self) -> str:
        if self.high == MAX_INT and not self.open_high:
            return f"{'>' if self.open_low else '>='} {self.low:g} (at most {MAX_INT})"
        if math.isinf(self.high):
            return f"{'>' if self.open_low else '>='} {self.low:g}"
        return f"in {'(' if self.open_low else '['}{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"


@dataclass(frozen=True)
class PlainName:
    """A name that becomes one folder: no path separator, not empty, not `.` or `..`."""

    def check(self, value: str, where: str) -> None:
        if value in ("", ".", "..") or "/" in value or "\\" in value or "\0" in value:
            raise ConfigError(f"{where} must be a plain name (no '/', not '.' or '..'): got {value!r}")


DEVICE_NAME = re.compile(r"auto|cpu|mps|(cuda|xpu)(:[0-9]+)?")
# every attention back-end a variant may offer (attention/kernels/__init__.py says what each runs)
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flex", "triton")


@dataclass(frozen=True)
class DeviceName:
    """auto, cpu, cuda, cuda:N (xpu, mps): what torch.device accepts, checked before torch sees it."""

    def check(self, value: str, where: str) -> None:
        if not DEVICE_NAME.fullmatch(value):
            raise ConfigError(f"{where}: {value!r} is not a device (auto, cpu, cuda, cuda:N, mps, xpu)")


Size = Annotated[int, Range(1)]  # a width, a length, a count of things that must exist
Count = Annotated[int, Range(0)]  # a count that may be zero (0 often disables)
Positive = Annotated[float, Range(0, math.inf, open_low=True)]
NonNegative = Annotated[float, Range(0, math.inf)]
Fraction = Annotated[float, Range(0, 1)]
Rate = Annotated[float, Range(0, 1, open_high=True)]  # dropout, decays, Adam betas: 1 would never change
Share = Annotated[float, Range(0, 1, open_low=True, open_high=True)]  # a part of something: neither none nor all
Weight = Annotated[float, Range(0, 1, open_low=True)]  # a mixing weight: 0 would turn its term off


# --------------------------------------------------------------------------------------------
# Model


@dataclass(kw_only=True)
class FullAttentionConfig:
    backend: Literal["auto", "torch", "cpu", "triton"] = "auto"  # attention/kernels/__init__.py; cpu, triton: cached
    # calls (CPU; CUDA)


@dataclass(kw_only=True)
class LocalAttentionConfig:
    window_size: Size = 128  # keys visible to a query, itself included
    backend: Literal["auto", "torch", "flex", "cpu", "triton"] = "auto"  # attention/kernels/__init__.py; flex: GPU
    # (CPU: forward only); cpu, triton: cached calls (CPU; CUDA)


# ---- routing (owned by attention/routing.py)
@dataclass(kw_only=True)
class RoutingAttentionConfig:
    window_size: Size = 128  # most recent same-cluster keys a token attends to (and the local window)
    n_clusters: Size | None = None  # k-means centroids per routed head; None: max_seq_len // window_size
    n_local_heads: Count | tuple[Count, ...] = 0  # heads using the local window, one int or one per layer
    ema_decay: Rate = 0.999  # centroid moving-average decay, applied once per optimiser step
    commitment_weight: NonNegative = 1e-4  # weight of the k-means commitment loss (seed 000's default)
    backend: Literal["auto", "torch", "cpu", "flex"] = "auto"  # attention/kernels/__init__.py


# ---- sinkhorn (owned by attention/sinkhorn.py)
@dataclass(kw_only=True)
class SinkhornAttentionConfig:
    bucket_size: Size = 128  # tokens per bucket
    n_sortcut: Size = 1  # past buckets each bucket attends to, chosen by the sorting network
    sinkhorn_iter: Count = 5  # row/column normalisation rounds of the sorting matrix
    temperature: Positive = 0.75  # divides the sorting logits (and Gumbel noise) before normalising
    n_local_heads: Count = 0  # heads using the local window of bucket_size instead of sorted buckets
    backend: Literal["auto", "torch", "cpu", "flex"] = "auto"  # attention/kernels/__init__.py


# ---- nsa (owned by attention/nsa.py)
@dataclass(kw_only=True)
class NSAAttentionConfig:
    sliding_window_size: Size = 64  # sliding branch: keys visible to a query, itself included
    compress_block_size: Size = 16  # compressed branch: tokens summarised by one compressed key (paper's l)
    compress_stride: Size = 8  # compressed branch: distance between block starts (paper's d); divides both block sizes
    compressor: Literal["mlp", "mean", "conv", "attention"] = "mlp"  # network turning a block into one key/value
    # mlp compressor hidden width, as a multiple of block * dim_head (1/64: 16 at blocks of 16 and heads of 64,
    # so the compressors hold fewer parameters than the layer's projections; 1.0, as wide as its input, was
    # the earlier default: six times the rest of a small model for about the same learning, docs/nsa.md)
    compress_mlp_mult: Positive = 1 / 64
    compress_positions: bool = True  # learned intra-block position embeddings added before compressing
    selection_block_size: Size = 16  # selected branch: tokens per selectable block (paper's l')
    # selected blocks per query, the initial and the current block included (n)
    num_selected: Annotated[int, Range(2)] = 4
    use_diff_topk: bool = False  # straight-through gates so the selection scores get gradients (seed 002)
    # independent keys and values for the three branches (the paper's section 3.3.3, against shortcut learning
    # across branches): the shared projection serves the compressed branch, `branch_kv` the selected and
    # sliding ones. False shares one key/value projection (the earlier default; 3 seeds of the built-in
    # corpus's recipe learned 0.03 bits per byte slower at step 300, docs/nsa.md "Learning quality")
    separate_branch_kv: bool = True
    # initial gate logits: -b for the compressed and selected branches, +b for the sliding one, so the layer
    # starts as local attention (0: every gate at 0.5, the first default, which learned slower early on;
    # 4 learned faster than 2 by step 100 on 8 seeds of 9 and alike by step 300, docs/nsa.md "Learning quality")
    gate_init_bias: NonNegative = 4.0
    backend: Literal["auto", "torch", "cpu", "flex", "triton"] = "auto"  # attention/kernels/__init__.py
    query_chunk_size: Size = 256  # queries processed together; bounds the selected and compressed scores


@dataclass(kw_only=True)
class AttentionConfig:
    kind: str = "full"  # registry name: full | local | routing | sinkhorn | nsa
    dropout: Rate = 0.0  # dropout on attention probabilities (training only)
    full: FullAttentionConfig = field(default_factory=FullAttentionConfig)
    local: LocalAttentionConfig = field(default_factory=LocalAttentionConfig)
    routing: RoutingAttentionConfig = field(default_factory=RoutingAttentionConfig)
    sinkhorn: SinkhornAttentionConfig = field(default_factory=SinkhornAttentionConfig)
    nsa: NSAAttentionConfig = field(default_factory=NSAAttentionConfig)


# ---- mixture of experts (owned by model/moe.py)
@dataclass(kw_only=True)
class MoEConfig:
    n_experts: Size = 4  # routed SwiGLU experts (MiniMind's n_routed_experts)
    top_k: Size = 2  # experts each token is sent to (MiniMind's num_experts_per_tok)
    n_shared_experts: Count = 1  # experts every token goes through, unrouted (DeepSeekMoE / MiniMind)
    normalize_top_k: bool = True  # renormalise the top-k router probabilities to sum to 1 (MiniMind's norm_topk_prob)
    balance_loss_weight: NonNegative = 0.1  # Switch load-balance loss weight (MiniMind's aux_loss_alpha)
    z_loss_weight: NonNegative = 0.0  # router z-loss weight (ST-MoE, arXiv 2202.08906); 0 disables


@dataclass(kw_only=True)
class ModelConfig:
    num_tokens: Size = 256  # vocabulary size (256 for bytes)
    dim: Size = 256  # residual stream width
    depth: Size = 4  # number of blocks
    heads: Size = 4  # query heads
    dim_head: Size = 64  # width of one head
    kv_heads: Size | None = None  # key/value heads for GQA; None means equal to heads
    max_seq_len: Size = 256  # longest sequence the positions and caches are built for
    emb_dim: Size | None = None  # factorised embedding width (seed 001 uses 128); None: dim
    position: Literal["rotary", "learned", "none"] = "rotary"  # how positions enter the model
    rope_theta: Positive = 10000.0  # rotary base
    norm: str = "layernorm"  # registry name: layernorm | rmsnorm
    norm_eps: Positive | None = None  # norm epsilon; None: the norm's default (LayerNorm 1e-5, RMSNorm machine eps)
    feed_forward: str = "gelu"  # registry name: gelu | swiglu | moe
    ff_mult: Positive = 4.0  # hidden width of the feed-forward as a multiple of dim
    ff_hidden: Size | None = None  # exact feed-forward hidden width (HF intermediate_size); None: from ff_mult
    ff_chunks: Size = 1  # run the feed-forward over this many sequence chunks to save memory
    dropout: Rate = 0.0  # residual dropout
    tie_embeddings: bool = False  # share the input embedding with the output projection
    # initial weights (Transformer.initialise): "torch", linear layers and embeddings as torch makes them
    # (Kaiming-uniform, N(0, 1)); "gpt2", N(0, 0.02) with the residual projections scaled by 1/sqrt(2 depth),
    # the earlier default, which learned markedly slower here (docs/nsa.md "Learning quality")
    init: Literal["torch", "gpt2"] = "torch"
    reversible: bool = False  # two-stream reversible residuals: activation memory flat in depth
    loss_chunk_size: Count = 0  # >0: training loss over this many tokens at a time, full logits never built
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
    val_fraction: Share = 0.05  # share held out for validation: of the bytes, or of the documents (tokens)
    # token sources: padded = MiniMind's one document per sample, BOS + text + EOS, padded to seq_len + 1
    # with the loss masked on padding; packed = random windows of the documents joined by end tokens
    layout: Literal["padded", "packed"] = "padded"
    vocab_size: Size = 6400  # builtin-tokens: BPE vocabulary trained on the built-in corpus (MiniMind: 6400)
    enwik8_train_bytes: Size = 90_000_000  # enwik8 split as the seeds use it
    enwik8_val_bytes: Size = 5_000_000


# --------------------------------------------------------------------------------------------
# Training


@dataclass(kw_only=True)
class TrainConfig:
    seq_len: Size = 256  # tokens per training window (windows hold seq_len + 1 tokens)
    batch_size: Size = 16  # windows per micro-batch
    grad_accum: Size = 1  # micro-batches per optimiser step
    max_steps: Count = 1000  # optimiser steps
    lr: Positive = 1e-3  # peak learning rate
    min_lr_ratio: Fraction = 0.1  # cosine floor as a fraction of lr
    schedule: Literal["cosine", "minimind", "constant"] = "cosine"
    warmup_steps: Count = 100  # linear warm-up (cosine schedule)
    weight_decay: NonNegative = 0.1  # applied to matrices only, never to norms, biases or embeddings
    beta1: Rate = 0.9
    beta2: Rate = 0.95
    eps: Positive = 1e-8
    grad_clip: NonNegative = 1.0  # max global gradient norm; 0 disables
    on_nonfinite: Literal["stop", "skip"] = "stop"  # non-finite gradients: stop the run, or skip the step (finite.py)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    device: Annotated[str, DeviceName()] = "auto"  # auto | cpu | cuda | cuda:N
    seed: Annotated[int, Range(0, 2**32 - 1)] = 0  # numpy's seeds are 32-bit
    ema: bool = False  # keep an exponential moving average of the weights (seeds' --use_ema)
    ema_decay: Rate = 0.999
    eval_every: Count = 100  # validation loss every N steps
    eval_batches: Size = 8  # validation windows = eval_batches * batch_size
    sample_every: Count = 500  # print a sample from a validation prime every N steps; 0 disables
    sample_length: Size = 200  # tokens generated for that sample
    prime_length: Size = 64  # prime taken from validation data
    save_every: Size = 500  # checkpoint every N steps (and at the end)
    keep_last: Size = 2  # checkpoints kept in the run directory
    log_every: Size = 10  # metrics line every N steps
    compile: bool = False  # torch.compile the model
    peak_tflops: NonNegative = 0.0  # device peak for the logged MFU; 0: known GPUs' bf16 peak, none on CPU
    randomly_truncate_sequence: bool = False  # seed 000: now and then train on a shorter prefix (p 0.1)
    distill_from: str | None = None  # teacher run or checkpoint: also train toward its distribution (train/distill.py)
    distill_weight: Weight = 0.5  # with distill_from: loss = (1 - w) data cross-entropy + w distillation loss
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
    name: Annotated[str, PlainName()] = "run"  # run directory name under out_dir
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
        data = yaml.load(path.read_bytes().decode("utf-8"), Loader=YAML_LOADER)
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not a text file ({error.reason} at byte {error.start})") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(error).split())[:300]})") from error
    except RecursionError as error:
        raise ConfigError(f"{path}: nested too deeply to be a config") from error
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values, got {type(data).__name__}")
    return data


PRESET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def looks_like_path(source: str) -> bool:
    """The rule that tells a config file from a preset: a path holds a '/' or ends in .yaml or .yml;
    anything else is a preset's name."""
    return "/" in source or "\\" in source or source.endswith((".yaml", ".yml"))


def check_preset_name(name: str) -> str:
    """`name` if it can name a preset (letters, digits, '-', '_', '.'; never a path), else ConfigError."""
    if not PRESET_NAME.fullmatch(name) or looks_like_path(name):
        raise ConfigError(f"{name!r} is not a preset name: presets are chosen by name ({', '.join(known_presets())}); "
                          "a config file is given with -c FILE")
    return name


def _preset_dict(name: str) -> dict[str, Any]:
    path = PRESET_DIR / f"{check_preset_name(name)}.yaml"
    if not path.is_file():
        known = known_presets()
        near = difflib.get_close_matches(name, known, n=1)
        hint = f" Did you mean '{near[0]}'?" if near else ""
        raise ConfigError(f"unknown preset '{name}'.{hint} Known presets: {', '.join(known)}")
    return _read_yaml(path)


def _config_file_dict(path: Path) -> dict[str, Any]:
    """A config file's values (the preset it names first): it must exist and be a regular file."""
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if not path.is_file():
        raise ConfigError(f"config file {path} is not a regular file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} has {path.stat().st_size:,} bytes: not a config file")
    file_values = _read_yaml(path)
    base = file_values.pop("preset", None)
    if base is None:
        return file_values
    if not isinstance(base, str):
        raise ConfigError(f"{path}: preset: expected a preset name, got {base!r}")
    return _deep_merge(_preset_dict(base), file_values)


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
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override '{text}' must look like key.path=value (a key is missing)")
    if not is_utf8_text(text):
        # a command line's bytes that the locale's encoding cannot decode arrive surrogate-escaped; the
        # resolved config is saved as YAML, which cannot hold them, so the run could never be read back
        encoding = sys.getfilesystemencoding()
        raise ConfigError(f"override {text!r} holds bytes that are not {encoding} text (a file name?): "
                          f"rename the file, or link it under a name in {encoding}")
    try:
        value = yaml.load(raw, Loader=YAML_LOADER) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    except RecursionError as error:
        raise ConfigError(f"override '{text[:60]}...': the value is nested too deeply") from error
    nested: dict[str, Any] = {}
    cursor = nested
    for part in parts[:-1]:
        cursor = cursor.setdefault(part, {})
    cursor[parts[-1]] = value
    return nested


def is_utf8_text(text: str) -> bool:
    """Whether `text` is text that UTF-8 can encode (no surrogates left by undecodable bytes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(value: Any) -> str:
    """A value as an error message quotes it: its repr, cut short (it may be a 5,000-character list)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text):,} characters)"


def _check_value(value: Any, annotation: Any, where: str) -> Any:
    """Return `value` converted to `annotation`, or raise ConfigError naming `where`."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return value
    if origin is Annotated:  # a type and its constraints (Range, PlainName, DeviceName)
        base, *constraints = typing.get_args(annotation)
        value = _check_value(value, base, where)
        for constraint in constraints:
            constraint.check(value, where)
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
        raise ConfigError(errors[-1] if errors else f"{where}: invalid value {_shown(value)}")
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{where}: {_shown(value)} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_shown(value)}")
        (item_type, *_rest) = typing.get_args(annotation) or (Any,)
        return tuple(_check_value(item, item_type, f"{where}[{i}]") for i, item in enumerate(value))
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {_shown(value)}")
        return _build(annotation, value, where)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {_shown(value)}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {_shown(value)}")
    if annotation is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e308 else math.inf  # a 400-digit int overflows float()
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None or not math.isfinite(number):
            raise ConfigError(f"{where}: expected a finite number, got {_shown(value)}")
        return number
    if annotation is str:  # YAML reads `name=7` as a number and `name=2024-06-01` as a date
        if isinstance(value, (str, int, float, datetime.date)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {_shown(value)}")
    raise ConfigError(f"{where}: unsupported annotation {annotation!r}")


def _build(cls: type, values: dict[str, Any], where: str = "") -> Any:
    hints = typing.get_type_hints(cls, include_extras=True)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{(where + '.') if where else ''}{near[0]}'?" if near else ""
            raise ConfigError(f"unknown config key '{path}'{hint}")
        kwargs[key] = _check_value(value, hints[key], path)
    return cls(**kwargs)


def check_model(model: ModelConfig, where: str = "model.") -> None:
    """The constraints between model fields that no single field's type says, then what the model's
    constructor refuses (_check_model_builds: the model built on the meta device); ConfigError
    naming them."""
    if model.heads % model.n_kv_heads:
        raise ConfigError(f"{where}heads={model.heads} must be a multiple of {where}kv_heads={model.kv_heads}")
    if model.position == "rotary" and model.dim_head % 2:
        raise ConfigError(f"{where}dim_head={model.dim_head} must be even for rotary positions ({where}position)")
    kind = model.attention.kind
    if kind in ("routing", "sinkhorn"):  # the other variants' sections are not read
        local_heads = getattr(model.attention, kind).n_local_heads
        per_layer = local_heads if isinstance(local_heads, tuple) else (local_heads,) * model.depth
        key = f"{where}attention.{kind}.n_local_heads"
        if len(per_layer) < model.depth:
            raise ConfigError(f"{key} has {len(per_layer)} values; {where}depth={model.depth} needs one per layer")
        if max(per_layer) > model.heads:
            raise ConfigError(f"{key}={local_heads} must be at most {where}heads={model.heads}")
    _check_model_builds(model)


def _check_model_builds(model: ModelConfig) -> None:
    """What the model's constructor refuses, refused here: a name no registry holds (attention kind,
    feed-forward, norm) and each part's own rules (NSA's stride dividing its block sizes, MoE's top_k
    at most n_experts, a back-end without attention dropout). The rules stay with the parts that own
    them; building on the meta device allocates nothing, and a run is refused before it prepares data
    or writes its run directory."""
    import torch  # imported here: the model imports this module, and the CLI's parser imports no torch

    from attnlab.model.transformer import Transformer

    with torch.device("meta"):
        Transformer(model)


def samples_in_training(train: TrainConfig) -> bool:
    """Whether the run prints a sample at some step: every train.sample_every steps up to
    train.max_steps, so never where sample_every is 0 or beyond max_steps. A resume that raises
    max_steps is checked again with its own config."""
    return 0 < train.sample_every <= train.max_steps


def check_run(config: RunConfig) -> None:
    """check_model, and the training windows against the model: learned positions end at max_seq_len."""
    check_model(config.model)
    train, longest = config.train, config.model.max_seq_len
    if config.model.position == "learned":
        if train.seq_len > longest:
            raise ConfigError(f"train.seq_len={train.seq_len} exceeds model.max_seq_len={longest}, where learned "
                              "positions end")
        if samples_in_training(train) and train.prime_length + train.sample_length > longest:
            raise ConfigError(f"train.prime_length + train.sample_length = {train.prime_length + train.sample_length} "
                              f"exceeds model.max_seq_len={longest}, where learned positions end (shorten the "
                              "samples, or train.sample_every=0)")


def config_from_dict(values: dict[str, Any], cls: type = RunConfig) -> Any:
    """Build and validate a config dataclass from plain nested dicts."""
    config = _build(cls, values)
    if isinstance(config, RunConfig):
        check_run(config)
    elif isinstance(config, ModelConfig):
        check_model(config, where="")
    return config


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict (tuples as lists) that config_from_dict turns back into `config`."""

    def plain(value: Any) -> Any:
        if isinstance(value, tuple):
            return [plain(item) for item in value]
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        return value

    return plain(dataclasses.asdict(config))


def load_config(source: str | Path | None = "demo", overrides: list[str] | None = None) -> RunConfig:
    """Resolve a run config: a preset, or a config file, then `key.path=value` overrides.

    source: a preset's name (a str), or a YAML config file (a Path, or a str that looks like a path:
    see `looks_like_path`). A preset is only ever found by name among the presets."""
    values: dict[str, Any] = {}
    if isinstance(source, Path) or (source is not None and looks_like_path(source)):
        values = _config_file_dict(Path(source))
    elif source is not None:
        values = _preset_dict(source)
    for override in overrides or []:
        values = _deep_merge(values, parse_override(override))
    return config_from_dict(values)


def save_config(config: Any, path: Path) -> None:
    """config as YAML at `path`, written whole or not at all (a run's config.yaml is written again at
    every start, and read by whatever loads the run)."""
    from attnlab.data.files import write_atomic  # a leaf module, which imports this one

    write_atomic(Path(path), yaml.safe_dump(config_to_dict(config), sort_keys=False).encode())
