"""Run by tests/test_distributed.py under torchrun: several training runs one after another in the
same processes (one launch instead of one per run: starting the processes, torch and DeepSpeed is
most of the time). argv: a JSON file holding a list of runs, each [preset, override, ...].

After the last run it destroys the process groups and checks that none of their worker threads is
left: a group still referenced (by an engine, an optimiser or a parameter) would be torn down only
during the interpreter's shutdown, where a process once aborted."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path

from attnlab.config import load_config
from attnlab.train import distributed
from attnlab.train.loop import train

with contextlib.suppress(ImportError):
    # before any process group exists: imported later (after a DDP run), DeepSpeed keeps the world
    # group in a default argument (TorchBackend.barrier's), and the group outlives every run
    import deepspeed  # noqa: F401


def process_group_threads() -> list[str]:
    """The names of this process's gloo worker threads (Linux names threads in /proc)."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            names.append(Path(f"/proc/self/task/{task}/comm").read_text().strip())
    return [name for name in names if "gloo" in name]


if __name__ == "__main__":
    destroy_process_groups = distributed.destroy_process_groups
    distributed.destroy_process_groups = lambda: None  # keep the process group for the next run
    for preset, *overrides in json.loads(open(sys.argv[1]).read()):
        train(load_config(preset, overrides))
    destroy_process_groups()
    gc.collect()
    for _ in range(20):  # a group freed joins its threads at once; a little grace for the system's view
        if not (left := process_group_threads()):
            break
        time.sleep(0.1)
    else:
        sys.exit(f"process-group threads outlived every run: {left}")
