"""The training loop, read top to bottom: prepare the run, then repeat one optimiser step and the
actions that are due after it.

    prepare(config) -> Run   check the config, own the run directory (lock, resume point, timeline),
                             load the data, build the model, its EMA copy and the optimiser (the
                             distribution strategy wraps and keeps them), restore a resumed run
    train_step(run)          one optimiser step: set the learning rate, run `grad_accum` micro-batches
                             (forward under autocast, the distillation loss when there is a teacher,
                             backward of the loss weighted by the micro-batch's share of the step's
                             counted targets), clip and step on finite gradients only (train/finite.py),
                             let modules with explicit per-step state update it (`after_optimizer_step`,
                             e.g. routing centroids), update the EMA weights, check the weights
    record_metrics, validate, log_sample, write_checkpoint
                             the periodic actions, each on its own schedule
    train(config)            the loop: a step, then what is due; a stop signal (Ctrl-C, SIGTERM, SIGHUP,
                             SIGUSR1: train/signals.py) stops after a step, with a checkpoint

A checkpoint holds everything the next step depends on (weights, optimiser, scaler, EMA, step,
RNG states, data sampler position), so a resumed run continues bit for bit (tests/test_train.py).

Dimensions: B micro-batch rows (per rank), T train.seq_len, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import platform
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from attnlab.config import RunConfig, config_to_dict, save_config
from attnlab.data.byte_corpus import ByteCorpus
from attnlab.data.corpus import load_corpus
from attnlab.data.files import write_atomic
from attnlab.data.sampler import (
    RandomWindowSampler,
    check_eval_split,
    make_sampler,
    prime_tokens,
    randomly_truncate,
)
from attnlab.errors import AttnlabError, CheckpointError, ConfigError
from attnlab.evaluate import evaluate
from attnlab.flops import flops_per_token, peak_flops
from attnlab.generate.sampling import SamplingConfig, generate
from attnlab.model.transformer import Transformer
from attnlab.train import retrofit
from attnlab.train.checkpoint import (
    checkpoint_path,
    discard_engine_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    read_checkpoint,
    save_checkpoint,
)
from attnlab.train.distill import load_teacher, student_loss
from attnlab.train.distributed import STRATEGY, SingleProcess, local_device, strategy_for_launcher
from attnlab.train.ema import WeightEMA
from attnlab.train.finite import NonFiniteSteps, TrainingError, check_weights, nonfinite_names
from attnlab.train.metrics import Metrics, open_metrics, read_metrics
from attnlab.train.optim import build_optimizer, learning_rate
from attnlab.train.portable import copy_tokenizer, write_weights_file
from attnlab.train.resume import choose_checkpoint
from attnlab.train.run_lock import RunLock, not_writable
from attnlab.train.signals import StopSignals
from attnlab.train.timeline import start_timeline

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # optimiser steps completed
    interrupted: bool  # stopped by a signal before its last step, with a checkpoint of the step it reached
    last_eval: dict[str, float] | None
    # the signal that stopped it, or that arrived during its last step (the run is complete, but
    # what was to follow it should not start: train/draft.py); train/signals.py gives its exit status
    stop_signal: int | None = None


def resolve_device(name: str) -> torch.device:
    """The device of train.device, checked to exist on this machine before anything is built: torch
    itself fails only when the model is moved, after the data is loaded, with a traceback."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    available = {
        "cuda": torch.cuda.is_available,
        "mps": torch.backends.mps.is_available,
        "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
    }.get(device.type, lambda: True)
    if not available():
        raise AttnlabError(f"train.device={name} but {device.type.upper()} is not available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise AttnlabError(f"train.device={name} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain float32."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": list(random.getstate()[1]),
        "numpy": np.random.get_state()[1].tolist(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate((3, tuple(state["python"]), None))
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), 624, 0, 0.0))


def write_run_info(config: RunConfig, run_dir: Path, command_line: list[str] | None) -> None:
    """The resolved config, command line, git revision and library versions, for reproduction."""
    save_config(config, run_dir / "config.yaml")
    try:
        revision = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).parent,
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        revision = None
    info = {
        "command": command_line if command_line is not None else sys.argv,
        "git_revision": revision,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    write_atomic(run_dir / "run_info.json", (json.dumps(info, indent=2) + "\n").encode())


def sample_text(model: Transformer, corpus: ByteCorpus, config: RunConfig, step: int) -> tuple[str, str]:
    """A prime from the validation data and the model's continuation of it, as text."""
    train = config.train
    prime = prime_tokens(corpus.val, train.prime_length, seed=step)  # [P], P <= prime_length
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(step)
    output = generate(
        model, prime[None].to(device), train.sample_length, SamplingConfig(temperature=1.0, top_k=None),
        generator=generator,
    )
    return corpus.decode(prime.tolist()), corpus.decode(output[0, len(prime) :].tolist())


def load_initial_weights(config: RunConfig) -> dict[str, Tensor] | None:
    """The weights of train.init_from (a run directory or a checkpoint) that fit this run's model,
    which may differ from the source's, e.g. in its attention (train/retrofit.py); None without it.
    Only the weights: optimiser, schedule, data order and step count start afresh."""
    if not config.train.init_from:
        return None
    return retrofit.initial_weights(config.train.init_from, config.model)


# --------------------------------------------------------------------------------------------
# Preparing the run


@dataclass
class Run:
    """What a training run holds from one step to the next. The strategy holds the module forward
    is called on, the optimiser and the EMA copy it laid out (train/distributed.py)."""

    config: RunConfig
    strategy: SingleProcess
    model: Transformer  # the plain model: its mode, statistics and per-step updates
    corpus: ByteCorpus  # or a TokenCorpus (data/pretrain.py)
    sampler: RandomWindowSampler  # or a token corpus's own sampler; its position is checkpointed
    scaler: torch.amp.GradScaler  # loss scaling, enabled for fp16 only
    autocast_dtype: torch.dtype | None  # None: plain float32
    teacher: Transformer | None  # train.distill_from, frozen
    ema: WeightEMA | None  # the averaged weights evaluation and sampling use (train.ema)
    tokens_per_step: int  # over all micro-batches and ranks
    step_flops: float  # model FLOPs of one optimiser step (flops.py)
    device_peak_flops: float | None  # per device; None: no MFU reported
    metrics: Metrics = dataclasses.field(default_factory=lambda: Metrics([]))  # rank 0's sinks; other ranks write none
    step: int = 0  # optimiser steps completed
    train_seconds: float = 0.0  # optimiser-step time so far, carried across resumes (for wall-time plots)
    last_eval: dict[str, float] | None = None
    nonfinite: NonFiniteSteps = dataclasses.field(default_factory=lambda: NonFiniteSteps("stop"))
    show_progress: bool = False  # a progress bar (rank 0, log.progress, stdout a terminal); else metrics lines


def load_training_corpus(config: RunConfig, strategy: SingleProcess) -> ByteCorpus:
    """ByteCorpus, or TokenCorpus for tokenized documents, checked against the model's vocabulary
    and, where the run evaluates, for a validation split that holds one window (sampler.check_eval_split).
    Rank 0 first: loading may build the corpus into the shared cache (built-in corpora, tokenizer,
    shards), which ranks must not do at once."""
    corpus = load_corpus(config.data) if strategy.is_main else None
    strategy.barrier()
    if corpus is None:
        with quiet_data_logs():  # rank 0 has said what it found or built; the others find the same
            corpus = load_corpus(config.data)
    if getattr(corpus, "vocab_size", 256) > config.model.num_tokens:
        raise AttnlabError(f"the data's vocabulary has {corpus.vocab_size} tokens but model.num_tokens="
                           f"{config.model.num_tokens}; set model.num_tokens={corpus.vocab_size}")
    if config.train.eval_every > 0:
        check_eval_split(corpus.val, config.train.seq_len)
    return corpus


@contextmanager
def quiet_data_logs() -> Iterator[None]:
    """The data modules' warnings and errors only, not their progress lines ("tokenizer: cached at ...")."""
    logger = logging.getLogger("attnlab.data")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def prepare(config: RunConfig, resume: str | bool | None, command_line: list[str] | None, cleanup: ExitStack) -> Run:
    """Everything the loop needs, checked in an order that fails early (the run directory, the
    checkpoint, teacher and initial weights before any data is built), and restored from the
    checkpoint when resuming. `cleanup` releases the run directory when the run ends."""
    config = strategy_for_launcher(config)  # torchrun with several processes: DDP, not N lone runs
    tc = config.train
    check_training_config(config)
    device = local_device(tc.device) if config.dist.strategy != "single" else resolve_device(tc.device)
    strategy = STRATEGY.get(config.dist.strategy)(config, device)
    resume_from, state = own_run_directory(config, resume, strategy, cleanup)

    teacher = load_teacher(config, device)  # train.distill_from, or None; checked before any data is built
    # train.init_from: a fresh run's starting weights; a resumed run continues from its own checkpoint
    initial_weights = load_initial_weights(config) if state is None else None
    # precision of the DeepSpeed engine comes from its own config
    autocast_dtype = None if strategy.owns_accumulation else resolve_precision(tc.precision, device)
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    np.random.seed(tc.seed)
    corpus = load_training_corpus(config, strategy)
    if strategy.is_main:
        write_run_info(config, config.run_dir, command_line)
        copy_tokenizer(corpus, config.run_dir)  # a portable run: sample and export without the shards

    model = Transformer(config.model).to(device)
    if initial_weights is not None:  # the tensors that fit; the others keep their initialisation
        model.load_state_dict(initial_weights, strict=False)
    ema = WeightEMA(model, tc.ema_decay) if tc.ema else None  # copied before wrapping, laid out like it after
    copies = {} if ema is None else {"ema": ema.model}  # saved and restored with the model
    strategy.wrap(model, lambda module: build_optimizer(module, tc), copies)
    tokens_per_step = tc.batch_size * tc.grad_accum * tc.seq_len * strategy.world_size
    run = Run(
        config=config, strategy=strategy, model=model, corpus=corpus,
        scaler=torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16),
        sampler=make_sampler(corpus, tc, rank=strategy.rank, world_size=strategy.world_size),
        autocast_dtype=autocast_dtype, teacher=teacher, ema=ema, tokens_per_step=tokens_per_step,
        step_flops=flops_per_token(config.model, tc.seq_len) * tokens_per_step,
        device_peak_flops=peak_flops(device, autocast_dtype, tc.peak_tflops), nonfinite=NonFiniteSteps(tc.on_nonfinite),
        show_progress=config.log.progress and strategy.is_main and sys.stdout.isatty(),
    )
    if state is not None:
        restore(run, state, resume_from)
    if tc.compile:
        strategy.compile()
    if strategy.is_main:
        run.metrics = open_metrics(config.log, config.run_dir, config.name, config_to_dict(config), run.step)
    log_start(run, resume_from)
    return run


def log_start(run: Run, resumed_from: Path | None) -> None:
    """The run's start-up lines, from rank 0 only: every rank would print the same."""
    if not run.strategy.is_main:
        return
    config, strategy = run.config, run.strategy
    if resumed_from is not None:
        log.info("resumed from %s at step %d", resumed_from, run.step)
    log.info(
        "%s: %s, %.2fM parameters, %s on %s (%s, %s x %d)",
        config.name, config.model.attention.kind, run.model.num_parameters() / 1e6, run.corpus.description,
        strategy.device, "fp32" if run.autocast_dtype is None else str(run.autocast_dtype).split(".")[-1],
        config.dist.strategy, strategy.world_size,
    )
    warn_if_warm_up_outlasts_the_run(config)


def warn_if_warm_up_outlasts_the_run(config: RunConfig) -> None:
    """Allowed (a preset shortened for a trial), but the cosine schedule then never reaches train.lr
    nor decays: said once, with the start-up lines."""
    tc = config.train
    if tc.schedule == "cosine" and tc.warmup_steps > tc.max_steps:
        log.warning("train.warmup_steps=%d exceeds train.max_steps=%d: the learning rate ends its warm-up at %.2g of "
                    "train.lr and never decays (shorten train.warmup_steps for the whole schedule)",
                    tc.warmup_steps, tc.max_steps, tc.max_steps / tc.warmup_steps)


def check_training_config(config: RunConfig) -> None:
    tc = config.train
    if tc.max_steps < 1:
        raise ConfigError(f"train.max_steps must be at least 1, got {tc.max_steps}")
    if tc.on_nonfinite == "skip" and config.dist.strategy == "deepspeed":
        raise ConfigError("train.on_nonfinite=skip: DeepSpeed applies its own steps; use stop")
    if config.dist.deepspeed_config and config.dist.strategy != "deepspeed":  # else a DeepSpeed run silently is not
        raise ConfigError(f"dist.deepspeed_config is read by dist.strategy=deepspeed only, this run's is "
                          f"{config.dist.strategy}: add dist.strategy=deepspeed (as --deepspeed_config does)")


def own_run_directory(config: RunConfig, resume: str | bool | None, strategy: SingleProcess, cleanup: ExitStack
                      ) -> tuple[Path | None, dict[str, Any] | None]:
    """Rank 0 locks the run directory for the run's life (train/run_lock.py); the checkpoint to
    resume from is chosen (train/resume.py); rank 0 clears the directory for this run's timeline
    (train/timeline.py). Every rank raises if rank 0 could not."""
    failure = None
    if strategy.is_main:
        try:
            cleanup.enter_context(RunLock(config.run_dir))
        except AttnlabError as error:
            failure = error
    strategy.raise_together(failure)
    resume_from, state = resume_point(config, resume, strategy)
    failure = None
    if strategy.is_main:
        try:
            start_timeline(config.run_dir, None if state is None else int(state["step"]), strategy.engine_folder)
        except OSError as error:
            failure = not_writable(config.run_dir, error)
    strategy.raise_together(failure)
    return resume_from, state


def resume_point(config: RunConfig, resume: str | bool | None, strategy: SingleProcess
                 ) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint to continue from and its state (train/resume.py), chosen and checked by rank 0;
    the other ranks read the one it chose."""
    chosen, failure = None, None
    if strategy.is_main:
        try:
            chosen = choose_checkpoint(config, resume, strategy.engine_folder, strategy.world_size)
        except AttnlabError as error:
            failure = error
    strategy.raise_together(failure)
    path = strategy.gather_objects(None if chosen is None else str(chosen[0]))[0]
    if path is None:
        return None, None
    return Path(path), chosen[1] if chosen is not None else read_checkpoint(path)


def restore(run: Run, state: dict[str, Any], resume_from: Path) -> None:
    """Continue `run` from a checkpoint's state: weights, optimiser, EMA, scaler, data position, RNG."""
    strategy = run.strategy
    run.step = int(state["step"])
    run.train_seconds = float(state.get("train_seconds", 0.0))
    if run.ema is not None and state.get("ema") is None:
        raise CheckpointError(f"{resume_from} has no EMA weights but train.ema=true")
    strategy.restore(state, run.config.run_dir, run.step)
    if state["scaler"]:  # empty from a run without loss scaling: one resumed in fp16 starts its scale afresh
        run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])
    run.nonfinite.consecutive = int(state.get("skipped_in_a_row", 0))  # a streak goes on counting
    run.last_eval = restored_last_eval(state, run.config.run_dir if strategy.is_main else None)
    set_rng_state(state["rng"][strategy.rank])  # one state a process: their number checked at choose_checkpoint


def restored_last_eval(state: dict[str, Any], run_dir: Path | None) -> dict[str, float] | None:
    """The validation figures the run had at its checkpoint, so a resumed run that ends before its
    next evaluation still reports them. A checkpoint written before it held them ("last_eval"
    absent): the last validation record of run_dir's metrics.jsonl, which rank 0 has already cut
    at the checkpoint's step (train/timeline.py); None for the other ranks (run_dir None)."""
    if "last_eval" in state:
        saved = state["last_eval"]
        return None if saved is None else {name: float(value) for name, value in saved.items()}
    if run_dir is None or not (Path(run_dir) / "metrics.jsonl").is_file():
        return None
    found = [record for record in read_metrics(run_dir) if "val_bpb" in record and record["step"] <= state["step"]]
    return {name: found[-1][name] for name in ("val_loss", "val_bpb") if name in found[-1]} if found else None


# --------------------------------------------------------------------------------------------
# One optimiser step


@dataclass
class StepResult:
    losses: dict[str, float]  # by name, means over the micro-batches and the ranks
    grad_norm: float  # before clipping
    lr: float
    applied: bool  # False: the gradients were not finite and the update was skipped (train.on_nonfinite=skip)


def train_step(run: Run) -> StepResult:
    """One optimiser step over train.grad_accum micro-batches. Non-finite gradients are never applied
    (train/finite.py: the run stops, or skips the step); the weights are checked after the update."""
    tc, strategy = run.config.train, run.strategy
    lr = learning_rate(run.step, tc)
    for group in strategy.optimizer.param_groups:
        group["lr"] = lr
    losses: dict[str, float] = {}
    batches = [next_micro_batch(run, micro) for micro in range(tc.grad_accum)]  # [B, T+1], [B, T] or None
    shares = target_shares(run, batches)
    for micro, (tokens, loss_mask) in enumerate(batches):
        with strategy.micro_step_context(is_last=micro == tc.grad_accum - 1):
            with autocast(run):
                loss, named = micro_batch_loss(run, tokens, loss_mask, shares[micro])
            if strategy.owns_accumulation:  # DeepSpeed steps inside backward: check the loss before it
                stop_if_not_finite(run, loss)
            strategy.backward(loss, run.scaler)
        for name, value in named.items():
            losses[name] = losses.get(name, 0.0) + value.item() / tc.grad_accum
    grad_norm = strategy.step(run.scaler)  # applies finite gradients only
    losses = {name: strategy.mean(value) for name, value in losses.items()}
    if not (strategy.owns_accumulation or math.isfinite(grad_norm)) and not (
        run.scaler.is_enabled() and math.isfinite(losses["loss"])  # an fp16 overflow: the scaler's own skip
    ):
        run.nonfinite.not_applied(run.step + 1, losses["loss"], grad_norm, last_good_checkpoint(run))
        return StepResult(losses, grad_norm, lr, applied=False)
    run.nonfinite.applied()
    run.model.after_optimizer_step()  # explicit per-step state: routing centroids
    if run.ema is not None:
        with strategy.full_parameters():
            run.ema.update(run.model)
    weights = itertools.chain(run.model.named_parameters(), run.model.named_buffers())
    check_weights(weights, run.step + 1, lambda: last_good_checkpoint(run), strategy.any_rank)
    return StepResult(losses, grad_norm, lr, applied=True)


def next_micro_batch(run: Run, micro: int) -> tuple[Tensor, Tensor | None]:
    """Micro-batch `micro` of this step on the device: tokens [B, T+1] and loss_mask [B, T] or None."""
    tc, device = run.config.train, run.strategy.device
    batch = run.sampler.next_batch(run.corpus.train)  # Batch: tokens [B, T+1], loss_mask [B, T] | None
    if tc.randomly_truncate_sequence:
        batch = randomly_truncate(batch, tc.seed, run.step * tc.grad_accum + micro)
    tokens = batch.tokens.to(device, non_blocking=True)
    loss_mask = None if batch.loss_mask is None else batch.loss_mask.to(device, non_blocking=True)
    return tokens, loss_mask


def autocast(run: Run) -> AbstractContextManager:
    """Mixed precision for the forward (train.precision), or nothing in plain float32."""
    if run.autocast_dtype is None:
        return nullcontext()
    return torch.autocast(run.strategy.device.type, dtype=run.autocast_dtype)


def target_shares(run: Run, batches: list[tuple[Tensor, Tensor | None]]) -> list[float]:
    """The weight of each micro-batch's mean loss, so that the step minimises the mean over every
    counted target of the global batch (all micro-batches, all ranks), as one process with the
    whole batch would: padding masks and truncated windows make the counts differ, and a mean of
    per-micro-batch (per-rank) means would weigh a target by how full its batch was. Each weight is
    count * grad_accum * world_size / global count, undoing the strategies' plain averaging over
    micro-batches and ranks; exactly 1.0 where all counts are equal."""
    counts = [int(tokens.shape[0] * (tokens.shape[1] - 1)) if mask is None else int(mask.sum())
              for tokens, mask in batches]
    total = int(run.strategy.total(float(sum(counts))))
    scale = len(batches) * run.strategy.world_size
    return [count * scale / total if total else 0.0 for count in counts]


def micro_batch_loss(
    run: Run, tokens: Tensor, loss_mask: Tensor | None, share: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss to minimise on tokens [B, T+1] (toward the teacher when there is one: train/distill.py):
    its per-target part weighted by `share` (target_shares), plus the auxiliary losses, which are
    means over the micro-batch whatever it holds; and every loss by name, weighted alike, for the log."""
    inputs = tokens[:, :-1]  # [B, T]
    output = run.strategy.forward(inputs, targets=tokens[:, 1:], loss_mask=loss_mask)
    per_target, parts = output.lm_loss, {}
    if run.teacher is not None:
        per_target, parts = student_loss(output, run.teacher, inputs, loss_mask, run.config.train)
    loss = per_target * share + sum(output.aux_losses.values(), torch.zeros((), device=per_target.device))
    weighted = {name: value * share for name, value in {"lm_loss": output.lm_loss, **parts}.items()}
    return loss, {"loss": loss, **weighted, **output.aux_losses}


def stop_if_not_finite(run: Run, loss: Tensor) -> None:
    """Raise before the engine touches the weights, so the last checkpoint stays good."""
    if not torch.isfinite(loss):
        raise TrainingError(
            f"loss became {loss.item()} at step {run.step + 1}; stopped before updating the weights. "
            f"Last good checkpoint: {last_good_checkpoint(run)}. Try a lower train.lr or train.precision=fp32"
        )


def last_good_checkpoint(run: Run) -> str:
    kept = list_checkpoints(run.config.run_dir)
    return str(kept[-1]) if kept else "none"


# --------------------------------------------------------------------------------------------
# The periodic actions


def record_metrics(run: Run, result: StepResult, elapsed: float) -> None:
    """The step's losses, model statistics, learning rate, gradient norm and throughput; `skipped`
    marks a step whose update was left out."""
    tokens_per_step, step_flops, peak = run.tokens_per_step, run.step_flops, run.device_peak_flops
    run.metrics.write(run.step, {
        **result.losses, **run.model.collect_stats(), "lr": result.lr, "grad_norm": result.grad_norm,
        **({} if result.applied else {"skipped": 1}),
        "tokens_per_s": tokens_per_step / elapsed, "tokens": run.step * tokens_per_step,
        "model_tflops_per_s": step_flops / elapsed / 1e12,
        **({"mfu": step_flops / elapsed / run.strategy.world_size / peak} if peak else {}),
        "elapsed_s": run.train_seconds,
    })
    if run.strategy.is_main and not run.show_progress:  # a batch job's log: a line instead of the bar
        log.info("step %d: loss %.4f, lr %.2e, grad norm %.3g, %.0f tokens/s%s", run.step, result.losses["loss"],
                 result.lr, result.grad_norm, tokens_per_step / elapsed, "" if result.applied else " (skipped)")


def validate(run: Run) -> dict[str, float]:
    """Every rank evaluates the same windows, as many as one global batch holds (a sharded model
    needs all ranks in its forward); rank 0 records. The EMA weights are evaluated when kept."""
    tc, strategy = run.config.train, run.strategy
    result = evaluate(
        run.ema.model if run.ema is not None else strategy.forward, run.corpus.val, tc.seq_len,
        tc.eval_batches * tc.batch_size * strategy.world_size, tc.batch_size, autocast_dtype=run.autocast_dtype,
    )
    record = {"val_loss": result.loss, "val_bpb": result.bits_per_byte}
    run.metrics.write(run.step, record)
    if strategy.is_main:
        log.info("step %d: validation loss %.4f, %.4f bits per byte", run.step, result.loss, result.bits_per_byte)
    run.model.train()
    return record


def log_sample(run: Run) -> None:
    """A continuation of a validation prime, from the EMA weights when kept."""
    prime, text = sample_text(run.ema.model if run.ema is not None else run.model, run.corpus, run.config, run.step)
    log.info("step %d sample:\n--- prime ---\n%s\n--- continuation ---\n%s\n---", run.step, prime, text)
    run.model.train()


def write_checkpoint(run: Run) -> Path:
    """Every rank takes part (sharded engines write their own checkpoint); rank 0 writes the file.
    Nothing is written when any rank holds a non-finite tensor; rank 0's failure to write (a full
    disk) is every rank's error."""
    strategy, run_dir = run.strategy, run.config.run_dir
    path = checkpoint_path(run_dir, run.step)
    bad = nonfinite_names(strategy.state_tensors())
    if strategy.any_rank(bool(bad)):
        raise TrainingError(f"not saving step {run.step}: non-finite values in {', '.join(bad[:3]) or 'another rank'}"
                            f". Last good checkpoint: {last_good_checkpoint(run)}")
    states = strategy.checkpoint_states(run_dir, run.step)  # full, on rank 0
    rng_states = strategy.gather_objects(rng_state())
    failure = None
    if strategy.is_main:
        try:
            save_checkpoint(path, {
                "config": config_to_dict(run.config),
                "model": states["model"],
                "optimizer": states["optimizer"],
                "scaler": run.scaler.state_dict(),
                "ema": states.get("ema"),
                "step": run.step,
                "rng": rng_states,
                "sampler": run.sampler.state_dict(),
                "train_seconds": run.train_seconds,
                "skipped_in_a_row": run.nonfinite.consecutive,  # train.on_nonfinite=skip's count
                "last_eval": run.last_eval,  # what a resumed run reports until it evaluates again
            })
            prune_checkpoints(run_dir, run.config.train.keep_last, strategy.engine_folder)
        except AttnlabError as error:
            failure = error
            discard_engine_checkpoint(run_dir, strategy.engine_folder, run.step)
    strategy.raise_together(failure)
    return path


# --------------------------------------------------------------------------------------------
# The loop


def train(
    config: RunConfig,
    resume: str | bool | None = None,
    command_line: list[str] | None = None,
    until_step: int | None = None,
) -> TrainResult:
    """Train `config`; resume as in train/resume.py. `until_step` stops early (with a checkpoint)
    while keeping the schedule of train.max_steps: for time-sliced jobs. A stop signal during
    start-up raises `Stopped` (train/signals.py); in the loop it saves and stops."""
    with StopSignals() as signals, ExitStack() as cleanup:
        run = prepare(config, resume, command_line, cleanup)
        signals.in_loop = True
        result = loop(run, signals, until_step)
        strategy = run.strategy
        del run  # the strategy's close frees the model and its engine while every rank is still here
        strategy.close()
        return result


def loop(run: Run, signals: StopSignals, until_step: int | None) -> TrainResult:
    """A step, then what is due after it, until the last step or a stop signal."""
    config, tc = run.config, run.config.train
    progress = tqdm(total=tc.max_steps, initial=run.step, desc=config.name, dynamic_ncols=True,
                    disable=not run.show_progress)
    if run.step == 0 and tc.eval_every > 0:
        run.last_eval = validate(run)
    run.model.train()
    last_step = tc.max_steps if until_step is None else min(until_step, tc.max_steps)
    if run.step >= last_step:  # a resumed run at its end already: said, where nothing happened silently
        ends = f"--until-step {until_step}" if until_step is not None and until_step < tc.max_steps else \
            f"train.max_steps={tc.max_steps}"
        log.info("no step to train: the run is at step %d, and %s ends it there", run.step, ends)
    stopped_by = late_signal = None
    try:
        with logging_redirect_tqdm():
            while run.step < last_step and not (stopped_by := stop_agreed(signals, run.strategy)):
                started = time.perf_counter()
                result = train_step(run)
                run.step += 1
                elapsed = time.perf_counter() - started
                run.train_seconds += elapsed
                progress.update(1)
                progress.set_postfix(
                    loss=f"{result.losses['loss']:.3f}", lr=f"{result.lr:.2e}",
                    tok_s=f"{run.tokens_per_step / elapsed:.0f}",
                )
                if run.step % tc.log_every == 0 or run.step == tc.max_steps or not result.applied:
                    record_metrics(run, result, elapsed)
                if tc.eval_every > 0 and (run.step % tc.eval_every == 0 or run.step == tc.max_steps):
                    run.last_eval = validate(run)
                if tc.sample_every > 0 and run.step % tc.sample_every == 0 and run.strategy.world_size == 1:
                    log_sample(run)
                if run.step % tc.save_every == 0 or run.step in (tc.max_steps, until_step):
                    write_checkpoint(run)
            if not stopped_by and run.step >= last_step:  # a signal during the last step (agreed by every rank)
                late_signal = stop_agreed(signals, run.strategy) or None
            if stopped_by and run.step > 0:  # save the step just finished, unless it is saved
                if not checkpoint_path(config.run_dir, run.step).is_file():
                    write_checkpoint(run)
                log.info("stopped by %s at step %d, saved; continue with --resume", signal.Signals(stopped_by).name,
                         run.step)
    finally:
        progress.close()
        run.metrics.close()
    if run.strategy.is_main:
        write_weights_file(config.run_dir)  # RUN/model.safetensors: the latest weights alone
    return TrainResult(run_dir=config.run_dir, step=run.step, interrupted=bool(stopped_by),
                       last_eval=run.last_eval, stop_signal=stopped_by or late_signal)


def stop_agreed(signals: StopSignals, strategy: SingleProcess) -> int:
    """The stop signal any rank received (0: none), the same on every rank, so all stop after the
    same step and no collective is left waiting."""
    received = signals.received or 0
    return int(strategy.largest(received)) if strategy.world_size > 1 else received
