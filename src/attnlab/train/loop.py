"""The training loop: one readable function, `train(config)`, calling small helpers.

Each optimiser step: set the learning rate, run `grad_accum` micro-batches (forward under autocast,
backward of loss / grad_accum), stop on a non-finite loss before touching the weights, clip, step,
let modules with explicit per-step state update it (`after_optimizer_step`, e.g. routing centroids),
update the EMA weights. Then, on their schedules: metrics, validation, a sample, a checkpoint.

A checkpoint holds everything the next step depends on (weights, optimiser, scaler, EMA, step,
RNG states, data sampler position), so a resumed run continues bit for bit (tests/test_train.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from attnlab.config import RunConfig, config_to_dict, save_config
from attnlab.data.bytes import ByteCorpus, load_corpus
from attnlab.data.sampler import make_sampler, prime_tokens, randomly_truncate
from attnlab.errors import AttnlabError, CheckpointError, ConfigError
from attnlab.evaluate import evaluate
from attnlab.flops import flops_per_token, peak_flops
from attnlab.generate.sampling import SamplingConfig, generate
from attnlab.model.transformer import Transformer
from attnlab.train.checkpoint import (
    checkpoint_path,
    describe_corruption,
    list_checkpoints,
    load_model,
    prune_checkpoints,
    read_checkpoint,
    save_checkpoint,
)
from attnlab.train.distill import load_teacher, student_loss
from attnlab.train.distributed import STRATEGY, local_device
from attnlab.train.ema import WeightEMA
from attnlab.train.metrics import Metrics, open_metrics
from attnlab.train.optim import build_optimizer, learning_rate

log = logging.getLogger(__name__)


class TrainingError(AttnlabError):
    """Training cannot go on (a non-finite loss); the last good checkpoint is kept."""


@dataclass
class TrainResult:
    run_dir: Path
    step: int  # optimiser steps completed
    interrupted: bool
    last_eval: dict[str, float] | None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise AttnlabError(f"train.device={name} but CUDA is not available")
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
    (run_dir / "run_info.json").write_text(json.dumps(info, indent=2) + "\n")


def after_optimizer_step(model: torch.nn.Module) -> None:
    """Explicit once-per-step updates of module state that is not a gradient parameter."""
    for module in model.modules():
        update = getattr(module, "after_optimizer_step", None)
        if callable(update):
            update()


def find_resume_checkpoint(config: RunConfig, resume: str | bool | None) -> Path | None:
    """resume: None/False (fresh run), True or "auto" (latest in the run directory), or a path."""
    run_dir = config.run_dir
    existing = list_checkpoints(run_dir)
    if resume in (None, False):
        if existing:
            raise AttnlabError(
                f"{run_dir} already has checkpoints (latest {existing[-1].name}); pass --resume to "
                f"continue it, or choose another run name with name=..."
            )
        return None
    if resume in (True, "auto"):
        if not existing:
            log.info("no checkpoint in %s: starting a new run", run_dir)
            return None
        return existing[-1]
    return Path(str(resume))


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
    """The model weights of train.init_from (a run directory or a checkpoint), checked against
    this run's model; None without it. Only the weights: optimiser, schedule, data order and step
    count start afresh."""
    source = config.train.init_from
    if not source:
        return None
    try:
        start = load_model(source, weights="model")
    except CheckpointError as error:
        raise ConfigError(f"train.init_from: {error}") from error
    saved = start.run_config.model
    if saved != config.model:
        differences = [
            f"model.{name}: {getattr(saved, name)} there, {getattr(config.model, name)} here"
            for name in (field.name for field in dataclasses.fields(saved))
            if getattr(saved, name) != getattr(config.model, name)
        ]
        raise ConfigError(f"train.init_from={source}: its model differs from this run's: " + "; ".join(differences))
    log.info("starting from the weights of %s (step %d)", source, start.checkpoint_step)
    return start.state_dict()


def train(
    config: RunConfig,
    resume: str | bool | None = None,
    command_line: list[str] | None = None,
    until_step: int | None = None,
) -> TrainResult:
    """Train `config`; resume as in find_resume_checkpoint. `until_step` stops early (with a
    checkpoint) while keeping the schedule of train.max_steps: for time-sliced jobs."""
    tc = config.train
    run_dir = config.run_dir
    device = local_device(tc.device) if config.dist.strategy != "single" else resolve_device(tc.device)
    strategy = STRATEGY.get(config.dist.strategy)(config, device)
    resume_from = find_resume_checkpoint(config, resume)
    state = None
    if resume_from is not None:
        try:
            state = read_checkpoint(resume_from)
        except CheckpointError as error:
            raise describe_corruption(resume_from, error) from error

    teacher = load_teacher(config, device)  # train.distill_from, or None; checked before any data is built
    # train.init_from: a fresh run's starting weights; a resumed run continues from its own checkpoint
    initial_weights = load_initial_weights(config) if state is None else None
    # precision of the DeepSpeed engine comes from its own config
    autocast_dtype = None if strategy.owns_accumulation else resolve_precision(tc.precision, device)
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    np.random.seed(tc.seed)

    # ByteCorpus, or TokenCorpus for tokenized documents. Rank 0 first: loading may build the corpus
    # into the shared cache (built-in corpora, tokenizer, shards), which ranks must not do at once
    corpus = load_corpus(config.data) if strategy.is_main else None
    strategy.barrier()
    if corpus is None:
        corpus = load_corpus(config.data)
    if getattr(corpus, "vocab_size", 256) > config.model.num_tokens:
        raise AttnlabError(f"the data's vocabulary has {corpus.vocab_size} tokens but model.num_tokens="
                           f"{config.model.num_tokens}; set model.num_tokens={corpus.vocab_size}")
    if strategy.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_info(config, run_dir, command_line)

    model = Transformer(config.model).to(device)
    if initial_weights is not None:
        model.load_state_dict(initial_weights)
    ema = WeightEMA(model, tc.ema_decay) if tc.ema else None  # copied before wrapping, laid out like it after
    copies = {} if ema is None else {"ema": ema.model}  # saved and restored with the model
    strategy.wrap(model, lambda module: build_optimizer(module, tc), copies)
    scaler = torch.amp.GradScaler(device.type, enabled=autocast_dtype == torch.float16)
    sampler = make_sampler(corpus, tc, rank=strategy.rank, world_size=strategy.world_size)
    step = 0
    train_seconds = 0.0  # optimiser-step time so far, carried across resumes (for wall-time plots)
    if state is not None:
        step = int(state["step"])
        train_seconds = float(state.get("train_seconds", 0.0))
        if ema is not None and state.get("ema") is None:
            raise CheckpointError(f"{resume_from} has no EMA weights but train.ema=true")
        strategy.restore(state, run_dir, step)
        scaler.load_state_dict(state["scaler"])
        sampler.load_state_dict(state["sampler"])
        rng_states = state["rng"]
        if len(rng_states) != strategy.world_size:
            raise CheckpointError(f"{resume_from} was written by {len(rng_states)} processes; this run has "
                                  f"{strategy.world_size}")
        set_rng_state(rng_states[strategy.rank])
        log.info("resumed from %s at step %d", resume_from, step)
    if tc.compile:
        strategy.compile()
    forward = strategy.forward

    metrics = (
        open_metrics(config.log, run_dir, config.name, config_to_dict(config), step if state else None)
        if strategy.is_main else Metrics([])
    )
    log.info(
        "%s: %s, %.2fM parameters, %s on %s (%s, %s x %d)",
        config.name, config.model.attention.kind, model.num_parameters() / 1e6, corpus.description, device,
        "fp32" if autocast_dtype is None else str(autocast_dtype).split(".")[-1], config.dist.strategy,
        strategy.world_size,
    )

    def checkpoint() -> Path:
        """Every rank takes part (sharded engines write their own checkpoint); rank 0 writes the file."""
        path = checkpoint_path(run_dir, step)
        states = strategy.checkpoint_states(run_dir, step)  # full, on rank 0
        rng_states = strategy.gather_objects(rng_state())
        strategy.barrier()
        if strategy.is_main:
            save_checkpoint(path, {
                "config": config_to_dict(config),
                "model": states["model"],
                "optimizer": states["optimizer"],
                "scaler": scaler.state_dict(),
                "ema": states.get("ema"),
                "step": step,
                "rng": rng_states,
                "sampler": sampler.state_dict(),
                "train_seconds": train_seconds,
            })
            prune_checkpoints(run_dir, tc.keep_last, strategy.engine_folder)
        strategy.barrier()
        return path

    def validate() -> dict[str, float]:
        """Every rank evaluates the same windows, as many as one global batch holds (a sharded model
        needs all ranks in its forward); rank 0 records."""
        result = evaluate(
            ema.model if ema is not None else forward, corpus.val, tc.seq_len,
            tc.eval_batches * tc.batch_size * strategy.world_size, tc.batch_size, autocast_dtype=autocast_dtype,
        )
        record = {"val_loss": result.loss, "val_bpb": result.bits_per_byte}
        metrics.write(step, record)
        if strategy.is_main:
            log.info("step %d: validation loss %.4f, %.4f bits per byte", step, result.loss, result.bits_per_byte)
        return record

    tokens_per_step = tc.batch_size * tc.grad_accum * tc.seq_len * strategy.world_size
    step_flops = flops_per_token(config.model, tc.seq_len) * tokens_per_step  # model FLOPs (flops.py)
    peak = peak_flops(device, autocast_dtype, tc.peak_tflops)  # per device; None: no MFU reported
    autocast = (
        torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    )
    last_eval = None
    interrupted = False
    progress = tqdm(
        total=tc.max_steps, initial=step, desc=config.name, dynamic_ncols=True,
        disable=not (config.log.progress and strategy.is_main),
    )
    if step == 0 and tc.eval_every > 0:
        last_eval = validate()
    model.train()
    last_step = tc.max_steps if until_step is None else min(until_step, tc.max_steps)
    try:
        with StopOnInterrupt() as stop:
            while step < last_step and not stop_agreed(stop, strategy):
                started = time.perf_counter()
                lr = learning_rate(step, tc)
                for group in strategy.optimizer.param_groups:
                    group["lr"] = lr
                losses: dict[str, float] = {}
                for micro in range(tc.grad_accum):
                    batch = sampler.next_batch(corpus.train)  # Batch: tokens [B, T+1], loss_mask [B, T] | None
                    if tc.randomly_truncate_sequence:
                        batch = randomly_truncate(batch, tc.seed, step * tc.grad_accum + micro)
                    tokens = batch.tokens.to(device, non_blocking=True)
                    loss_mask = None if batch.loss_mask is None else batch.loss_mask.to(device, non_blocking=True)
                    with strategy.micro_step_context(is_last=micro == tc.grad_accum - 1):
                        with autocast:
                            output = forward(tokens[:, :-1], targets=tokens[:, 1:], loss_mask=loss_mask)
                            parts = {}
                            if teacher is not None:
                                output.loss, parts = student_loss(output, teacher, tokens[:, :-1], loss_mask, tc)
                        if not torch.isfinite(output.loss):
                            kept = list_checkpoints(run_dir)
                            raise TrainingError(
                                f"loss became {output.loss.item()} at step {step + 1}; stopped before "
                                f"updating the weights. Last good checkpoint: {kept[-1] if kept else 'none'}. "
                                f"Try a lower train.lr or train.precision=fp32"
                            )
                        strategy.backward(output.loss, scaler)
                    named = {"loss": output.loss, "lm_loss": output.lm_loss, **output.aux_losses, **parts}
                    for name, value in named.items():
                        losses[name] = losses.get(name, 0.0) + value.item() / tc.grad_accum
                grad_norm = strategy.step(scaler)
                after_optimizer_step(model)
                if ema is not None:
                    with strategy.full_parameters():
                        ema.update(model)
                step += 1

                losses = {name: strategy.mean(value) for name, value in losses.items()}
                elapsed = time.perf_counter() - started
                train_seconds += elapsed
                progress.update(1)
                progress.set_postfix(
                    loss=f"{losses['loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_step / elapsed:.0f}"
                )
                if step % tc.log_every == 0 or step == tc.max_steps:
                    metrics.write(step, {
                        **losses, **model.collect_stats(), "lr": lr, "grad_norm": grad_norm,
                        "tokens_per_s": tokens_per_step / elapsed, "tokens": step * tokens_per_step,
                        "model_tflops_per_s": step_flops / elapsed / 1e12,
                        **({"mfu": step_flops / elapsed / strategy.world_size / peak} if peak else {}),
                        "elapsed_s": train_seconds,
                    })
                if tc.eval_every > 0 and (step % tc.eval_every == 0 or step == tc.max_steps):
                    last_eval = validate()
                    model.train()
                if tc.sample_every > 0 and step % tc.sample_every == 0 and strategy.world_size == 1:
                    prime, text = sample_text(ema.model if ema is not None else model, corpus, config, step)
                    log.info("step %d sample:\n--- prime ---\n%s\n--- continuation ---\n%s\n---", step, prime, text)
                    model.train()
                if step % tc.save_every == 0 or step in (tc.max_steps, until_step):
                    checkpoint()
            if step < last_step:
                interrupted = True
                log.info("interrupted: saved %s (step %d); continue with --resume", checkpoint(), step)
    finally:
        progress.close()
        metrics.close()
    strategy.close()
    return TrainResult(run_dir=run_dir, step=step, interrupted=interrupted, last_eval=last_eval)


def stop_agreed(stop: StopOnInterrupt, strategy) -> bool:
    """All ranks stop at the same step if any was asked to (so no collective is left waiting)."""
    return strategy.mean(float(stop.requested)) > 0 if strategy.world_size > 1 else stop.requested


class StopOnInterrupt:
    """Turn the first Ctrl-C (SIGINT) into a request to stop after the current step, so the
    checkpoint written then is consistent; a second Ctrl-C aborts at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.info("stopping after this step and saving a checkpoint (Ctrl-C again to abort)")

    def __enter__(self) -> StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
