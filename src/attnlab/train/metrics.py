"""Where metrics go: `metrics.jsonl` in the run directory (the source of truth), and optionally
TensorBoard and Weights & Biases. Each sink takes flat {name: number} records with a step."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from attnlab.config import LogConfig
from attnlab.errors import ConfigError

log = logging.getLogger(__name__)


class JsonlSink:
    """Appends one line per record. A resumed run's file has already lost the records after its
    checkpoint (train/timeline.py), so each step appears once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle = open(path, "a")

    def write(self, step: int, record: dict[str, Any]) -> None:
        self.handle.write(json.dumps({"step": step, **record}) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


class TensorBoardSink:
    def __init__(self, folder: Path, start_step: int = 0) -> None:
        """start_step: the step a resumed run continues from; TensorBoard drops the events the
        earlier run wrote after it, as metrics.jsonl drops its records (train/timeline.py), so a
        run resumed from an earlier checkpoint shows one curve, not two over the same steps."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ConfigError("log.tensorboard=true needs tensorboard: pip install tensorboard") from error
        self.writer = SummaryWriter(str(folder), purge_step=start_step + 1 if start_step else None)

    def write(self, step: int, record: dict[str, Any]) -> None:
        for name, value in record.items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One wandb run per attnlab run: its id is kept in RUN/wandb_id.txt, so a resumed run continues
    the same curves, and the last step given to it in RUN/wandb_step.txt. wandb cannot drop the
    records of a step it holds (it ignores a step lower than its latest), so where the run resumes
    from a checkpoint at a step earlier than that (its predecessor logged past its last checkpoint,
    or the run goes back to an older one) this run logs only the steps after it, with a warning that
    the steps between are the earlier process's, unlike metrics.jsonl and TensorBoard, which hold
    this run's. A fresh start in a directory whose earlier attempt logged (no checkpoint left, its
    records moved aside: train/timeline.py) starts a new wandb run."""

    def __init__(self, config: LogConfig, run_name: str, run_dir: Path, resolved: dict[str, Any],
                 start_step: int = 0) -> None:
        try:
            import wandb
        except ImportError as error:
            raise ConfigError("log.wandb=true needs wandb: pip install wandb") from error
        id_file, self.step_file = run_dir / "wandb_id.txt", run_dir / "wandb_step.txt"
        self.tracked = config.wandb_mode != "disabled"  # a disabled run keeps nothing
        logged = read_logged_step(self.step_file)  # the last step the run's wandb run holds; -1: none
        if not id_file.exists() or (start_step == 0 and logged >= 0):
            id_file.write_text(wandb.util.generate_id() + "\n")
            self.step_file.unlink(missing_ok=True)
            logged = -1
        elif logged > start_step:
            log.warning("log.wandb: this run resumes at step %d, but its wandb run holds steps up to %d, which "
                        "wandb cannot drop: steps %d to %d keep the earlier process's records there (metrics.jsonl "
                        "holds this run's) and this run logs to wandb from step %d on",
                        start_step, logged, start_step + 1, logged, logged + 1)
        self.skip_through = logged  # steps wandb already holds: not logged again
        self.last_step = logged
        self.run = wandb.init(
            project=config.wandb_project, name=run_name, dir=str(run_dir), mode=config.wandb_mode,
            config=resolved, id=id_file.read_text().strip(), resume="allow",
        )

    def write(self, step: int, record: dict[str, Any]) -> None:
        if step <= self.skip_through:
            return
        self.run.log(record, step=step)
        if self.tracked and step > self.last_step:
            self.last_step = step
            temporary = self.step_file.with_name(f".{self.step_file.name}.tmp-{os.getpid()}")
            temporary.write_text(f"{step}\n")  # not synced: a lost update only repeats steps wandb then ignores
            os.replace(temporary, self.step_file)

    def close(self) -> None:
        self.run.finish()


def read_logged_step(path: Path) -> int:
    """The step recorded in RUN/wandb_step.txt; -1 when there is none (or it is unreadable)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return -1


class Metrics:
    """Fans each record out to every configured sink."""

    def __init__(self, sinks: list) -> None:
        self.sinks = sinks

    def write(self, step: int, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(step, record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_metrics(config: LogConfig, run_dir: Path, run_name: str, resolved: dict[str, Any],
                 start_step: int = 0) -> Metrics:
    """The sinks of a run that starts (or resumes) at start_step."""
    sinks: list = [JsonlSink(run_dir / "metrics.jsonl")]
    if config.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard", start_step))
    if config.wandb:
        sinks.append(WandbSink(config, run_name, run_dir, resolved, start_step))
    return Metrics(sinks)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of run_dir's metrics.jsonl. A line that is no record (the last one cut short by a
    kill while it was written, as train/timeline.py expects too) is skipped with one warning."""
    path = Path(run_dir) / "metrics.jsonl"
    records, skipped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and "step" in record:
            records.append(record)
        else:
            skipped += 1
    if skipped:
        log.warning("%s: skipped %d line(s) that are not metric records (cut short by a kill?)", path, skipped)
    return records
