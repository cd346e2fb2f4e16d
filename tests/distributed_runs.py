"""Run by tests/test_distributed.py under torchrun: several `attnlab` command lines one after another
in the same processes (one launch instead of one per run: starting the processes, torch and
DeepSpeed is most of the time). argv: a JSON file holding a list of runs, each the arguments of one
`attnlab` command (as `attnlab.cli.main.main` takes them). Rank 0 writes each run's exit status, in
order, to the JSON file named like the list with `.status` added; a run that fails says why on
stderr, as the command would, and the next one starts.

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

from attnlab.cli.main import main
from attnlab.train import distributed

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
    listing = Path(sys.argv[1])
    destroy_process_groups = distributed.destroy_process_groups
    distributed.destroy_process_groups = lambda: None  # keep the process group for the next run
    statuses = [main(arguments) for arguments in json.loads(listing.read_text())]
    if os.environ.get("RANK") == "0":
        listing.with_name(listing.name + ".status").write_text(json.dumps(statuses))
    destroy_process_groups()
    for _ in range(50):  # a group freed joins its threads at once; a little grace for the system's view
        gc.collect()  # again each time: a finaliser run by one pass can leave more garbage for the next
        if not (left := process_group_threads()):
            break
        time.sleep(0.2)
    else:
        sys.exit(f"process-group threads outlived every run: {left}")
