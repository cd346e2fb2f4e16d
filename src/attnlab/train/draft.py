"""Training a draft model with its target, for speculative decoding (generate/speculative.py decodes
with the pair; `attnlab speculative train` calls this module).

The data sampler is counter-based (batch i depends only on the corpus, seq_len, batch_size and
(seed, i)), so a draft trained with the target's values of these sees exactly the target's batches,
in the same order, as the seed's joint training loop does, while each run keeps its own optimiser.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from attnlab.config import RunConfig, load_config
from attnlab.errors import ConfigError
from attnlab.train.loop import TrainResult, train

log = logging.getLogger(__name__)

# What decides the batches a run sees, besides the data (the module docstring)
SHARED_TRAIN_FIELDS = ("seq_len", "batch_size", "grad_accum", "seed", "max_steps")


def draft_config_for(target: RunConfig, draft: RunConfig) -> RunConfig:
    """The draft's config with the target's data and batch settings (SHARED_TRAIN_FIELDS)."""
    shared = {name: getattr(target.train, name) for name in SHARED_TRAIN_FIELDS}
    changed = [
        f"train.{name}: {getattr(draft.train, name)} -> {value}"
        for name, value in shared.items() if getattr(draft.train, name) != value
    ]
    if draft.data != target.data:
        changed.append("data: the target's")
    if changed:
        log.info("draft %s takes the target's batch settings: %s", draft.name, "; ".join(changed))
    if draft.model.num_tokens != target.model.num_tokens:
        raise ConfigError(
            f"draft and target must share a vocabulary: model.num_tokens {draft.model.num_tokens} "
            f"!= {target.model.num_tokens}"
        )
    if draft.run_dir == target.run_dir:
        raise ConfigError(f"draft and target would both write to {draft.run_dir}: give them different names")
    return dataclasses.replace(draft, data=target.data, train=dataclasses.replace(draft.train, **shared))


def train_pair(
    target: RunConfig | None,
    draft: RunConfig,
    target_settings: RunConfig | None = None,
    resume: bool = False,
    command_line: list[str] | None = None,
    distill_weight: float | None = None,
    target_dir: Path | None = None,
    draft_steps: int | None = None,
) -> tuple[TrainResult | None, TrainResult | None]:
    """Train a target and its draft on the same batches (one after the other, each with its own
    optimiser), or, with target None, only a draft for the existing target whose config is
    `target_settings` and whose run is `target_dir`. Returns (target result or None, draft result);
    the draft's is None when a stop signal arrived while the target trained (its last step saved:
    `--resume` continues the pair from there): the draft would train on, or distil from, an
    unfinished target, or start after the command was asked to stop.

    distill_weight: the draft also learns the target's distribution, from the target's final
    checkpoint (train.distill_from and train.distill_weight, train/distill.py).
    draft_steps: only for a draft of an existing target: train it for this many steps instead of
    the target's. It still reads the target's batch stream: the target's batches first, in order,
    then the ones that follow them."""
    reference = target if target is not None else target_settings
    if reference is None:
        raise ValueError("give a target config to train, or the settings of an existing target")
    draft = draft_config_for(reference, draft)
    if draft_steps is not None:
        if target is not None:
            raise ConfigError("the draft's own step count (--draft-steps) needs an existing target (--target RUN): "
                              "a draft trained together with its target sees exactly the target's batches")
        if draft_steps < 1:
            raise ConfigError(f"the draft's steps must be >= 1, got {draft_steps}")
        log.info("draft %s trains for %d steps (the target took %d)", draft.name, draft_steps, draft.train.max_steps)
        draft = dataclasses.replace(draft, train=dataclasses.replace(draft.train, max_steps=draft_steps))
    if distill_weight is not None:
        teacher = target.run_dir if target is not None else target_dir
        if teacher is None:
            raise ValueError("distilling a draft for an existing target needs its run directory (target_dir)")
        draft = dataclasses.replace(
            draft, train=dataclasses.replace(draft.train, distill_from=str(teacher), distill_weight=distill_weight)
        )
    target_result = None
    if target is not None:
        log.info("training the target %s", target.name)
        target_result = train(target, resume=resume or None, command_line=command_line)
        if target_result.stop_signal:
            return target_result, None
    log.info("training the draft %s on the target's batches", draft.name)
    draft_result = train(draft, resume=resume or None, command_line=command_line)
    return target_result, draft_result


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """key=value for both, target.key=value for the target, draft.key=value for the draft."""
    target, draft = [], []
    for override in overrides:
        if override.startswith("target."):
            target.append(override.removeprefix("target."))
        elif override.startswith("draft."):
            draft.append(override.removeprefix("draft."))
        elif override.split("=", 1)[0].strip() == "name":
            raise ConfigError("name= would give both runs the same name: use target.name=... or draft.name=...")
        else:
            target.append(override)
            draft.append(override)
    return target, draft


def existing_target_settings(run_dir: Path, overrides: list[str]) -> RunConfig:
    """The saved config of an existing target run, for training only a draft for it (train_pair with
    target None); target.* overrides are refused: that target is not trained again."""
    settings = Path(run_dir) / "config.yaml"
    if not settings.is_file():
        raise ConfigError(f"{settings} not found: --target needs a run directory")
    if any(override.startswith("target.") for override in overrides):
        raise ConfigError("with --target RUN the target is not trained: target.* overrides do not apply")
    return load_config(settings)
