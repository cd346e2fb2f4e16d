"""Where metrics go: `metrics.jsonl` in the run directory (the source of truth), and optionally
TensorBoard and Weights & Biases. Each sink takes flat {name: number} records with a step."""

from __future__ import annotations

import json
import logging
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
    def __init__(self, config: LogConfig, run_name: str, run_dir: Path, resolved: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as error:
            raise ConfigError("log.wandb=true needs wandb: pip install wandb") from error
        # one wandb run per attnlab run: its id is kept in the run directory, so a resumed run
        # continues the same curves instead of starting a new one
        id_file = run_dir / "wandb_id.txt"
        if not id_file.exists():
            id_file.write_text(wandb.util.generate_id() + "\n")
        self.run = wandb.init(
            project=config.wandb_project, name=run_name, dir=str(run_dir), mode=config.wandb_mode,
            config=resolved, id=id_file.read_text().strip(), resume="allow",
        )

    def write(self, step: int, record: dict[str, Any]) -> None:
        self.run.log(record, step=step)

    def close(self) -> None:
        self.run.finish()


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
        sinks.append(WandbSink(config, run_name, run_dir, resolved))
    return Metrics(sinks)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
