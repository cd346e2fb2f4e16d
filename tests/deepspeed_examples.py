"""Run by tests/test_distributed.py under torchrun: train every DeepSpeed config given on the
command line for two steps, one after another in the same processes (one launch instead of one per
config: starting DeepSpeed is most of the time). argv: OUT_DIR CORPUS CONFIG.json..."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from attnlab.config import load_config
from attnlab.train.distributed import DeepSpeed
from attnlab.train.loop import train

DeepSpeed.close = lambda self: dist.barrier()  # keep the process group for the next config

if __name__ == "__main__":
    out_dir, corpus, *configs = sys.argv[1:]
    for path in configs:
        config = load_config("demo", [
            f"name={Path(path).stem}", f"out_dir={out_dir}", "model.dim=32", "model.depth=2", "model.heads=2",
            "model.dim_head=16", "model.max_seq_len=64", "data.source=file", f"data.path={corpus}",
            "train.seq_len=32", "train.batch_size=2", "train.max_steps=2", "train.eval_every=0",
            "train.sample_every=0", "train.save_every=2", "train.log_every=1", "log.progress=false",
            "dist.strategy=deepspeed", f"dist.deepspeed_config={path}",
        ])
        assert train(config).step == 2
    dist.destroy_process_group()
