"""Run by tests/test_distributed.py under torchrun: several training runs one after another in the
same processes (one launch instead of one per run: starting the processes, torch and DeepSpeed is
most of the time). argv: a JSON file holding a list of runs, each [preset, override, ...]."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from attnlab.config import load_config
from attnlab.train.distributed import _ProcessGroupStrategy
from attnlab.train.loop import train

_ProcessGroupStrategy.close = lambda self: dist.barrier()  # keep the process group for the next run

if __name__ == "__main__":
    for preset, *overrides in json.loads(open(sys.argv[1]).read()):
        train(load_config(preset, overrides))
    dist.destroy_process_group()
