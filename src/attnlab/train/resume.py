"""Which checkpoint a run continues from, checked before anything is built.

    --resume (auto)      the newest intact checkpoint of the run directory: its file matches its
                         checksum and, for FSDP and DeepSpeed, so does its engine folder; a newer
                         damaged one is skipped with a message saying so
    --resume CHECKPOINT  that one, or a one-line error naming what is damaged and what is intact
    no --resume          a fresh run, refused where checkpoints already exist

The checkpoint's model must be the configured one (an error lists the settings that differ), and it
is resumed the way it was written (check_distribution): by a strategy that reads its optimiser state
(single and ddp share the single file; fsdp and deepspeed keep theirs in their own folders) and by
as many processes (each rank's RNG state and slice of the global batch are its own).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from attnlab.config import ModelConfig, RunConfig, config_from_dict, config_to_dict
from attnlab.errors import AttnlabError, CheckpointError, ConfigError
from attnlab.train.checkpoint import describe_corruption, list_checkpoints, read_checkpoint
from attnlab.train.checksum import verify_manifest
from attnlab.train.distributed import STRATEGY

log = logging.getLogger(__name__)


def read_intact(path: Path, engine_folder: str | None, config: RunConfig, world_size: int) -> dict[str, Any]:
    """A checkpoint's state, after checking it and its engine folder (RUN/<engine_folder>/step-N/)
    against their checksums; CheckpointError naming the damaged file otherwise. One written by
    another strategy or number of processes is a ConfigError (check_distribution), raised before
    its engine folder is looked for: it is not damaged, and an older checkpoint is no way round."""
    state = read_checkpoint(path)
    check_distribution(state, config, world_size, path)
    if engine_folder is not None:
        folder = Path(path).parent.parent / engine_folder / Path(path).stem
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint {path} has no {engine_folder} checkpoint {folder}")
        verify_manifest(folder, required=state["format_version"] >= 3)
    return state


def choose_checkpoint(
    config: RunConfig, resume: str | bool | None, engine_folder: str | None, world_size: int = 1
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from and its state, or None for a fresh run. resume: None/False
    (fresh), True or "auto" (the newest intact one of the run directory), or a path. `world_size`:
    the number of processes of this run."""
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
            return path, checked(read_intact(path, engine_folder, config, world_size), config, path)
        except CheckpointError as error:
            raise describe_corruption(path, error) from error
    if not existing:
        log.info("no checkpoint in %s: starting a new run", run_dir)
        return None
    damaged = []
    for path in reversed(existing):
        try:
            state = read_intact(path, engine_folder, config, world_size)
        except CheckpointError as error:
            damaged.append(str(error))
            log.warning("%s; trying the one before it", error)
            continue
        if damaged:
            log.warning("resuming from %s, the newest intact checkpoint (%d newer damaged)", path, len(damaged))
        return path, checked(state, config, path)
    raise CheckpointError(f"none of the {len(existing)} checkpoints in {run_dir} is intact; the newest: {damaged[0]}")


def check_distribution(state: dict[str, Any], config: RunConfig, world_size: int, path: Path) -> None:
    """Refuse, before anything is built, to resume a checkpoint under a strategy that cannot read its
    optimiser state (FSDP and DeepSpeed keep theirs only in their own folders, the single file holds
    none; single and ddp keep it in the file, which neither engine reads), or on another number of
    processes (each rank's RNG state and slice of the global batch are its own)."""
    saved_strategy = state["config"].get("dist", {}).get("strategy", "single")
    written_by = len(state["rng"]) if isinstance(state.get("rng"), list) else None  # None: not a resumable file
    engine_folder = STRATEGY.get(saved_strategy).engine_folder
    same_engine = STRATEGY.get(config.dist.strategy).engine_folder == engine_folder
    if same_engine and written_by in (None, world_size):
        return
    readers = " or ".join(name for name in STRATEGY.names() if STRATEGY.get(name).engine_folder == engine_folder)
    if not same_engine:
        stored = f"RUN/{engine_folder}/" if engine_folder else "the checkpoint file"
        reason = f"its optimiser state is in {stored}, which only {readers} reads"
    else:
        reason = "each process resumes its own RNG state and slice of the global batch"
    processes = "" if written_by is None else " on one process" if written_by == 1 else f" on {written_by} processes"
    raise ConfigError(
        f"--resume {path}: written by dist.strategy={saved_strategy}{processes}, this run is "
        f"dist.strategy={config.dist.strategy} on {world_size} ({reason}); resume it with dist.strategy={readers}"
        f"{processes}, or start a new run (another name=) from its weights alone with train.init_from={path}")


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
