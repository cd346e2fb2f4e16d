"""Which checkpoint a run continues from, checked before anything is built.

    --resume (auto)      the newest intact checkpoint of the run directory: its file matches its
                         checksum and, for FSDP and DeepSpeed, so does its engine folder; a newer
                         damaged one is skipped with a message saying so
    --resume CHECKPOINT  that one, or a one-line error naming what is damaged and what is intact
    no --resume          a fresh run, refused where checkpoints already exist

The checkpoint's model must be the configured one (an error lists the settings that differ).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from attnlab.config import ModelConfig, RunConfig, config_from_dict, config_to_dict
from attnlab.errors import AttnlabError, CheckpointError, ConfigError
from attnlab.train.checkpoint import describe_corruption, list_checkpoints, read_checkpoint
from attnlab.train.checksum import verify_manifest

log = logging.getLogger(__name__)


def read_intact(path: Path, engine_folder: str | None) -> dict[str, Any]:
    """A checkpoint's state, after checking it and its engine folder (RUN/<engine_folder>/step-N/)
    against their checksums; CheckpointError naming the damaged file otherwise."""
    state = read_checkpoint(path)
    if engine_folder is not None:
        folder = Path(path).parent.parent / engine_folder / Path(path).stem
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint {path} has no {engine_folder} checkpoint {folder}")
        verify_manifest(folder, required=state["format_version"] >= 3)
    return state


def choose_checkpoint(
    config: RunConfig, resume: str | bool | None, engine_folder: str | None
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from and its state, or None for a fresh run. resume: None/False
    (fresh), True or "auto" (the newest intact one of the run directory), or a path."""
    run_dir = config.run_dir
    existing = list_checkpoints(run_dir)
    if resume in (None, False):
        if existing:
            raise AttnlabError(
                f"{run_dir} already has checkpoints (latest {existing[-1].name}); pass --resume to "
                f"continue it, or choose another run name with name=..."
            )
        return None
    if resume not in (True, "auto"):
        path = Path(str(resume))
        if path.is_dir():  # read_checkpoint would say it "does not exist"
            raise CheckpointError(f"--resume {path}: a folder, not a checkpoint file; --resume alone continues "
                                  f"{run_dir} from its newest checkpoint, --resume RUN/checkpoints/step-N.pt "
                                  "from that one")
        try:
            return path, checked(read_intact(path, engine_folder), config, path)
        except CheckpointError as error:
            raise describe_corruption(path, error) from error
    if not existing:
        log.info("no checkpoint in %s: starting a new run", run_dir)
        return None
    damaged = []
    for path in reversed(existing):
        try:
            state = read_intact(path, engine_folder)
        except CheckpointError as error:
            damaged.append(str(error))
            log.warning("%s; trying the one before it", error)
            continue
        if damaged:
            log.warning("resuming from %s, the newest intact checkpoint (%d newer damaged)", path, len(damaged))
        return path, checked(state, config, path)
    raise CheckpointError(f"none of the {len(existing)} checkpoints in {run_dir} is intact; the newest: {damaged[0]}")


def checked(state: dict[str, Any], config: RunConfig, path: Path) -> dict[str, Any]:
    """`state`, if its model is the configured one."""
    try:
        saved = config_from_dict(state["config"]).model
    except ConfigError as error:
        raise CheckpointError(f"checkpoint {path} holds a config this version cannot read ({error})") from error
    differences = model_differences(saved, config.model)
    if differences:
        raise ConfigError(f"--resume {path}: its model differs from this run's: {'; '.join(differences)}; "
                          f"resume with the model settings it was trained with")
    return state


def model_differences(saved: ModelConfig, wanted: ModelConfig) -> list[str]:
    """`model.<key>: <saved> there, <wanted> here` for every model setting that differs."""
    there, here = flat(config_to_dict(saved), "model"), flat(config_to_dict(wanted), "model")
    return [f"{key}: {there.get(key)} there, {here.get(key)} here"
            for key in {**there, **here} if there.get(key) != here.get(key)]


def flat(values: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}.{key}"))
        else:
            out[f"{prefix}.{key}"] = value
    return out
