"""Portable run folders: a run directory holds what is needed to use its model elsewhere.

    RUN/tokenizer/       a tokenized run's tokenizer, copied when training starts, so `sample`,
                         `speculative` and `export` work where the token shards (or the cache that
                         built them) are not: on another machine, after the cache is cleared
    RUN/model.safetensors  the final weights alone (the moving average when the run keeps one, as
                         `attnlab export` takes them), attnlab's names, float32, the resolved config
                         and the checksum of its tensors in its metadata: for tools that read
                         safetensors, without the checkpoint's optimiser state
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from attnlab.config import config_to_dict
from attnlab.data.files import copy_atomic
from attnlab.data.shards import TOKENIZER_FOLDER
from attnlab.hf import TOKENIZER_FILES
from attnlab.train.checkpoint import list_checkpoints, load_model
from attnlab.train.checksum import save_safetensors

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"


def run_directory(run_or_checkpoint: str | Path) -> Path:
    """The run directory of a run directory or of one of its checkpoints (RUN/checkpoints/step-N.pt)."""
    path = Path(run_or_checkpoint)
    return path if path.is_dir() else path.parent.parent


def copy_tokenizer(corpus: Any, run_dir: Path) -> None:
    """Copy a tokenized corpus's tokenizer files into RUN/tokenizer/ (nothing for byte-level data),
    each atomically: every start of a run copies them again, over the copy a sample may be reading."""
    tokenizer = getattr(corpus, "tokenizer", None)
    if tokenizer is None:
        return
    target = Path(run_dir) / TOKENIZER_FOLDER
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer.folder / name).is_file():
            copy_atomic(tokenizer.folder / name, target / name)


def write_weights_file(run_dir: Path) -> Path | None:
    """RUN/model.safetensors from the run's latest checkpoint (read back, so every distribution
    strategy gives the same full weights); None when the run has no checkpoint. A tied output
    matrix is stored once, as the embedding."""
    if not list_checkpoints(run_dir):
        return None
    model = load_model(run_dir, weights="auto")
    state = model.state_dict()
    if model.config.tie_embeddings:
        del state["head.weight"]  # the same tensor as token_embedding.embed.weight
    tensors = {name: value.contiguous() for name, value in state.items()}
    metadata = {"step": str(model.checkpoint_step), "config": json.dumps(config_to_dict(model.run_config))}
    path = Path(run_dir) / WEIGHTS_FILE
    save_safetensors(tensors, path, metadata)
    log.info("final weights (step %d) -> %s", model.checkpoint_step, path)
    return path
