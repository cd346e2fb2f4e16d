"""One timeline per run directory: what a start does to the directory it owns before writing to it.

    leftovers       temporary files of killed writes (`checkpoints/.step-N.pt.tmp-PID`, a metrics or
                    checksum file's temporary) and engine checkpoint folders whose single-file
                    checkpoint was never written are removed
    resume at S     metric records after step S are dropped from `metrics.jsonl` (the resumed run
                    writes them again, the same); when checkpoints after S exist (a resume from an older
                    checkpoint, or past a damaged one) the run is starting a new timeline: those
                    checkpoints, their engine folders and the records after S are moved to
                    `RUN/superseded/<time>-from-step-S/`, never mixed with the new ones, never pruned
    fresh start     metric records of an earlier attempt that saved no checkpoint are moved aside the
                    same way, so a restart does not repeat their steps

`metrics.jsonl` is rewritten through a temporary file, flushed, then renamed over it: a kill while
it is rewritten leaves the old file or the new one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path

from attnlab.train.checkpoint import CHECKPOINT_DIR, checkpoint_path, list_checkpoints

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUPERSEDED_DIR = "superseded"
_TEMPORARY = re.compile(r"^\..*\.tmp-\d+$")
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


def start_timeline(run_dir: Path, resume_step: int | None, engine_folder: str | None) -> None:
    """Prepare `run_dir` (owned by this process) for a run that starts at `resume_step` (None: fresh)."""
    run_dir = Path(run_dir)
    remove_leftovers(run_dir, engine_folder)
    start = 0 if resume_step is None else resume_step
    later = [path for path in list_checkpoints(run_dir) if _step(path.stem) > start]
    metrics = run_dir / METRICS_FILE
    fresh_with_records = resume_step is None and metrics.is_file() and metrics.stat().st_size > 0
    if not later and not fresh_with_records:
        if resume_step is not None:
            split_metrics(metrics, resume_step, aside=None)
        return
    aside = run_dir / SUPERSEDED_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-from-step-{start}"
    aside.mkdir(parents=True, exist_ok=True)
    for path in later:
        (aside / CHECKPOINT_DIR).mkdir(exist_ok=True)
        os.replace(path, aside / CHECKPOINT_DIR / path.name)
        if engine_folder is not None and (run_dir / engine_folder / path.stem).is_dir():
            (aside / engine_folder).mkdir(exist_ok=True)
            os.replace(run_dir / engine_folder / path.stem, aside / engine_folder / path.stem)
    moved = split_metrics(metrics, -1 if resume_step is None else resume_step, aside=aside / METRICS_FILE)
    log.warning("%s: a new timeline from step %d; moved %d later checkpoint(s) and %d metric record(s) to %s",
                run_dir, start, len(later), moved, aside)


def remove_leftovers(run_dir: Path, engine_folder: str | None) -> None:
    """Temporary files of killed writes, and engine folders without their single-file checkpoint."""
    for folder in (run_dir, run_dir / CHECKPOINT_DIR):
        if folder.is_dir():
            for path in folder.iterdir():
                if _TEMPORARY.match(path.name) and path.is_file():
                    log.info("removing %s, left by a write that was killed", path)
                    path.unlink(missing_ok=True)
    if engine_folder is None or not (run_dir / engine_folder).is_dir():
        return
    for folder in (run_dir / engine_folder).iterdir():
        if _STEP_FOLDER.match(folder.name) and folder.is_dir():
            if not checkpoint_path(run_dir, _step(folder.name)).is_file():
                log.info("removing %s: its checkpoint was never completed", folder)
                shutil.rmtree(folder, ignore_errors=True)
            else:
                for path in folder.iterdir():
                    if _TEMPORARY.match(path.name):
                        path.unlink(missing_ok=True)


def split_metrics(path: Path, last_step: int, aside: Path | None) -> int:
    """Keep the records of steps <= `last_step` in `path` (rewritten atomically); the others go to
    `aside` (appended) or are dropped. Returns how many left."""
    if not path.is_file():
        return 0
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    moved = 0
    try:
        with open(path) as source, open(temporary, "w") as kept:
            removed = open(aside, "a") if aside is not None else None
            try:
                for line in source:
                    if _step_of(line) <= last_step:
                        kept.write(line if line.endswith("\n") else line + "\n")
                    elif line.strip():
                        moved += 1
                        if removed is not None:
                            removed.write(line if line.endswith("\n") else line + "\n")
            finally:
                if removed is not None:
                    removed.close()
            kept.flush()
            os.fsync(kept.fileno())
        if moved:
            os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return moved


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line).get("step", math.inf))
    except (ValueError, AttributeError):  # a line cut short by a kill, or not a record
        return math.inf


def _step(name: str) -> int:
    return int(name.rsplit("-", 1)[-1].split(".")[0])
